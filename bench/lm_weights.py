"""--lm-weights auto's table: the LM's decode step eager, per weight format, side by side.

  .venv/bin/python bench/lm_weights.py [--weights same,bfloat16,int4] [--batches 1,8]
      [--context 256] [--calls 30]
      [--quick --lm-model DIR]   (smoke run: tiny model, batch 1 and 2, context 32, 3 calls)

Every format is loaded in this process (the service's own loader and decode step, mode none)
and the timed calls are interleaved round by round on the same inputs, so a drift of a
shared machine hits every format alike. Prints the CPU (what inference_svc/models/cpu.py
reads), the median step per format and batch with its speed-up over ``same``, and what
``--lm-weights auto`` chooses here; writes results/lm_weights.json. A benchmark, not a test:
it prints figures and asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import add_quick_flags, results_dir  # noqa: E402
from inference_api.plan import Bucket, CompilationMode, Phase  # noqa: E402
from inference_svc.compile_monitor import CompileMonitor, Origin  # noqa: E402
from inference_svc.limits import GenLimits  # noqa: E402
from inference_svc.models import cpu  # noqa: E402
from inference_svc.models.compile import ModelContext  # noqa: E402
from inference_svc.models.generative import GenerativeModel, load_generative  # noqa: E402
from inference_svc.models.loading import resolve_lm_dir  # noqa: E402

SHOWN_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")


def load(model: str, weights: str, rows: int) -> GenerativeModel:
    ctx = ModelContext("lm", CompilationMode.NONE, CompileMonitor(), torch.device("cpu"),
                       torch.float32)  # fmt: skip
    cache = Path("~/.cache/inference-svc/models").expanduser()
    m = load_generative(ctx, resolve_lm_dir(model), GenLimits(rows, 512, 512, 64), cache, weights)
    m.allocate_cache(rows)
    return m


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure(
    models: dict[str, GenerativeModel], batches: list[int], context: int, calls: int
) -> dict[tuple[str, int], float]:
    """Median ms per (weights, batch): each round times one call of every pair."""
    gen = torch.Generator().manual_seed(0)
    vocab = min(m.lm.shape.vocab_size for m in models.values())
    calls_of = {}
    for b in batches:
        ids = torch.randint(0, vocab, (b, 1), generator=gen)
        pos = torch.randint(0, context, (b, 1), generator=gen)
        pos[0, 0] = context - 1
        calls_of[b] = (ids, pos, Bucket(Phase.DECODE, b, 1, context))
    times: dict[tuple[str, int], list[float]] = {(w, b): [] for w in models for b in batches}
    with torch.inference_mode():
        for m in models.values():
            for b in batches:
                for _ in range(3):  # warm: first calls allocate, pack and dispatch
                    m.decode(*calls_of[b], Origin.WARMUP)
        for _ in range(calls):
            for b in batches:
                for w, m in models.items():
                    start = time.perf_counter()
                    m.decode(*calls_of[b], Origin.WARMUP)
                    times[(w, b)].append(time.perf_counter() - start)
    return {key: statistics.median(t) * 1e3 for key, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--weights", default="same,bfloat16,int4", help="--lm-weights schemes")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--context", type=int, default=256, help="slots attended")
    p.add_argument("--calls", type=int, default=30, help="timed calls per point (median)")
    add_quick_flags(p)
    a = p.parse_args(argv)
    if a.quick:
        a.batches, a.calls, a.context = "1,2", 3, 32
    weights = a.weights.split(",")
    batches = [int(b) for b in a.batches.split(",")]
    caps = cpu.capabilities()
    flags = [f for f in SHOWN_FLAGS if f in caps.flags]
    print(f"CPU {cpu_name()}; torch {torch.__version__} capability {caps.isa}; flags "
          f"{' '.join(flags) or 'none of ' + ' '.join(SHOWN_FLAGS)}; "
          f"{torch.get_num_threads()} threads", flush=True)  # fmt: skip
    models = {w: load(a.lm_model or "default", w, max(batches)) for w in weights}
    ms = measure(models, batches, a.context, a.calls)
    print(f"\ndecode step, eager, context {a.context}, median of {a.calls} calls: ms "
          f"(speed-up over {weights[0]})")  # fmt: skip
    print(f"{'weights':9}" + "".join(f" {'batch ' + str(b):>9} {'x':>5}" for b in batches))
    for w in weights:
        cells = [f" {ms[(w, b)]:9.2f} {ms[(weights[0], b)] / ms[(w, b)]:5.2f}" for b in batches]
        print(f"{w:9}" + "".join(cells))
    choice = cpu.choose_lm_weights("auto", torch.device("cpu"))
    print(f"--lm-weights auto here: {choice.scheme} ({choice.reason})")
    out = results_dir(a) / "lm_weights.json"
    rows = [{"weights": w, "batch": b, "ms": ms[(w, b)]} for w in weights for b in batches]
    out.write_text(json.dumps({
        "cpu": cpu_name(), "capability": caps.isa, "flags": flags, "auto": choice.scheme,
        "threads": torch.get_num_threads(), "rows": rows, **vars(a) | {"results": None},
    }, indent=1, default=str))  # fmt: skip
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
