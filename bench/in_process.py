"""What the in-process step benchmarks share (bench/decode_step.py, bench/embed_step.py): the
CPU line, an arm's model context (eager, or run from an AOTInductor package built here), and
the end of a run (package build times, what auto picks here, the results JSON)."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable, Hashable
from pathlib import Path

import torch

from bench.common import results_dir
from inference_api.plan import CompilationMode
from inference_svc.compile_monitor import CompileMonitor
from inference_svc.models import cpu
from inference_svc.models.aoti import ScratchPackages
from inference_svc.models.compile import ModelContext

SHOWN_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")
Arm = tuple[str, str]  # (weights or dtype, backend)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def shown_flags() -> list[str]:
    caps = cpu.capabilities()
    return [f for f in SHOWN_FLAGS if f in caps.flags]


def print_cpu(extra: str = "") -> None:
    """The CPU as inference_svc/models/cpu.py reads it, and the thread count."""
    caps, flags = cpu.capabilities(), shown_flags()
    print(f"CPU {cpu_name()}; torch {torch.__version__} capability {caps.isa}; flags "
          f"{' '.join(flags) or 'none of ' + ' '.join(SHOWN_FLAGS)}; "
          f"{torch.get_num_threads()} threads{extra}", flush=True)  # fmt: skip


def arm_context(
    a: argparse.Namespace, name: str, dtype: torch.dtype, backend: str, stores: list
) -> tuple[ModelContext, CompilationMode]:
    """One arm's context: eager (mode none), or --mode with a package built at the first
    call (``a.mode``, ``a.freeze_weights``) in a scratch store appended to ``stores``."""
    aoti = backend == "aoti"
    mode = CompilationMode(a.mode) if aoti else CompilationMode.NONE
    store = ScratchPackages() if aoti else None
    if store is not None:
        stores.append(store)
    ctx = ModelContext(
        name, mode, CompileMonitor(), torch.device("cpu"), dtype,
        aoti and a.freeze_weights == "on", "aoti" if aoti else "torch-compile", store,
    )  # fmt: skip
    return ctx, mode


def interleaved(
    models: dict[Arm, object], points: list[Hashable], calls: int,
    call: Callable[[object, Hashable], object],
) -> dict[tuple[Arm, Hashable], float]:  # fmt: skip
    """Median ms of ``call(model, point)`` per (arm, point): each of ``calls`` rounds times
    one call of every pair, so a drift of a shared machine hits every arm alike."""
    times: dict[tuple[Arm, Hashable], list[float]] = {(a, p): [] for a in models for p in points}
    for _ in range(calls):
        for point in points:
            for arm, m in models.items():
                start = time.perf_counter()
                call(m, point)
                times[(arm, point)].append(time.perf_counter() - start)
    return {key: statistics.median(t) * 1e3 for key, t in times.items()}


def finish(
    a: argparse.Namespace, name: str, flag: str, choice: cpu.WeightsChoice,
    first: dict[Arm, float], rows: list[dict], **extra: object,
) -> None:  # fmt: skip
    """Print the packages' first calls (their builds) and what ``flag`` auto picks here;
    write results/NAME.json with the CPU, the rows and the arguments."""
    builds = {f"{w} {be}": round(s, 1) for (w, be), s in first.items() if be.startswith("aoti")}
    if builds:
        print(f"first calls (package build included) seconds: {builds}")
    print(f"{flag} auto here: {choice.scheme} ({choice.reason})")
    out = results_dir(a) / f"{name}.json"
    out.write_text(json.dumps({
        "cpu": cpu_name(), "capability": cpu.capabilities().isa, "flags": shown_flags(),
        "auto": choice.scheme, "threads": torch.get_num_threads(), **extra, "rows": rows,
        **vars(a) | {"results": None},
    }, indent=1, default=str))  # fmt: skip
    print(f"wrote {out}")
