"""How far is a decode step from the machine's limit? The LM's decode step, eager and from
an AOTInductor package (the service's own model code and padding), per batch, against the
time it takes to read the weights once at this machine's memory bandwidth.

  .venv/bin/python bench/decode_step.py [--weights same,bfloat16] [--batches 1,2,8,16]
      [--context 256] [--calls 30] [--mode max-autotune] [--freeze-weights on]
      [--quick --lm-model DIR]   (smoke run: tiny model, batch 1 and 2, 3 calls)

A decode step reads every weight once (plus the rows' KV cache), so at small batches its
floor is weight bytes / bandwidth; a step above it is overhead, not arithmetic. Both arms
run in this process, one after the other, on the same inputs; the bandwidth is measured
here too (a sum over 512 MiB). Prints the table, writes bench/results/decode_step.json.
A benchmark, not a test: it prints figures and asserts nothing.
"""

from __future__ import annotations

import argparse
import json
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
from inference_svc.engine.buckets import GenBuckets  # noqa: E402
from inference_svc.limits import GenLimits  # noqa: E402
from inference_svc.models.aoti import ScratchPackages  # noqa: E402
from inference_svc.models.compile import ModelContext  # noqa: E402
from inference_svc.models.generative import GenerativeModel, load_generative  # noqa: E402
from inference_svc.models.loading import resolve_lm_dir  # noqa: E402


def bandwidth_gib_s(mib: int = 512) -> float:
    """Read bandwidth: a sum over ``mib`` MiB of float32, best of 5."""
    x = torch.ones(mib * 2**18)
    x.sum()
    best = min(_timed(lambda: x.sum()) for _ in range(5))
    return mib / 1024 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def load(
    model: str, weights: str, mode: CompilationMode, freeze: bool, max_batch: int, aoti: bool
) -> tuple[GenerativeModel, ScratchPackages | None]:
    limits = GenLimits(max_batch, 512, 512, 64)
    store = ScratchPackages() if aoti else None
    ctx = ModelContext(
        "lm", mode, CompileMonitor(), torch.device("cpu"), torch.float32, freeze,
        "aoti" if aoti else "torch-compile", store,
    )  # fmt: skip
    cache = Path("~/.cache/inference-svc/models").expanduser()
    m = load_generative(ctx, resolve_lm_dir(model), limits, cache, weights)
    buckets = GenBuckets.plan(limits, mode, aoti=aoti)
    m.set_ranges(buckets.ranges())
    m.allocate_cache(max_batch)
    return m, store


def step_ms(m: GenerativeModel, batch: int, context: int, calls: int) -> float:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, m.lm.shape.vocab_size, (batch, 1), generator=gen)
    pos = torch.randint(0, context, (batch, 1), generator=gen)
    pos[0, 0] = context - 1
    shape = Bucket(Phase.DECODE, batch, 1, context)
    m.decode(ids, pos, shape, Origin.WARMUP)
    times = [_timed(lambda: m.decode(ids, pos, shape, Origin.WARMUP)) for _ in range(calls)]
    return statistics.median(times) * 1e3


def weight_bytes(m: GenerativeModel) -> int:
    """Bytes a decode step reads at least: every weight once (parameters and buffers, e.g.
    bfloat16 or int4 linears), the token embedding only where it is the output layer too
    (an untied embedding is read one row per token)."""
    lm = m.lm
    embed = lm.model.embed_tokens.weight
    seen, total = set(), 0
    for t in [*lm.parameters(), *lm.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    if getattr(lm.lm_head, "weight", None) is not embed:
        total -= embed.numel() * embed.element_size()
    return total


def measure(a: argparse.Namespace, weights: str, bandwidth: float) -> list[dict]:
    mode = CompilationMode(a.mode)
    freeze = a.freeze_weights == "on"
    batches = [int(b) for b in a.batches.split(",")]
    top = max(max(batches), 2)
    eager, _ = load(a.lm_model or "default", weights, CompilationMode.NONE, False, top, False)
    floor_ms = weight_bytes(eager) / 2**30 / bandwidth * 1e3
    rows = [{"weights": weights, "batch": b, "eager_ms": step_ms(eager, b, a.context, a.calls)}
            for b in batches]  # fmt: skip
    del eager
    packaged, store = load(a.lm_model or "default", weights, mode, freeze, top, True)
    start = time.perf_counter()
    step_ms(packaged, batches[0], a.context, 1)  # builds the package
    build_s = time.perf_counter() - start
    for row in rows:
        row["aoti_ms"] = step_ms(packaged, row["batch"], a.context, a.calls)
        row["floor_ms"] = floor_ms
        row["build_s"] = build_s
    assert store is not None
    store.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--weights", default="same,bfloat16", help="--lm-weights options")
    p.add_argument("--batches", default="1,2,8,16")
    p.add_argument("--context", type=int, default=256, help="slots attended")
    p.add_argument("--calls", type=int, default=30, help="timed calls per point (median)")
    p.add_argument("--mode", default="max-autotune", choices=("default", "max-autotune"))
    p.add_argument("--freeze-weights", default="on", choices=("on", "off"))
    add_quick_flags(p)
    a = p.parse_args(argv)
    if a.quick:
        a.weights, a.batches, a.calls, a.mode, a.context = "same", "1,2", 3, "default", 32
    bandwidth = bandwidth_gib_s(64 if a.quick else 512)
    cpu = torch.backends.cpu.get_cpu_capability()
    print(f"memory read bandwidth {bandwidth:.1f} GiB/s; CPU {cpu}, "
          f"{torch.get_num_threads()} threads", flush=True)  # fmt: skip
    rows = []  # loaded outside inference mode: torch.export cannot trace inference tensors
    for weights in a.weights.split(","):
        rows += measure(a, weights, bandwidth)
    print(f"\ndecode step at context {a.context}, mode {a.mode}, freeze {a.freeze_weights} (ms)")
    print(f"{'weights':10} {'batch':>5} {'eager':>8} {'aoti':>8} {'eager/aoti':>10} "
          f"{'floor':>7} {'aoti/floor':>10}")  # fmt: skip
    for r in rows:
        print(f"{r['weights']:10} {r['batch']:>5} {r['eager_ms']:8.2f} {r['aoti_ms']:8.2f} "
              f"{r['eager_ms'] / r['aoti_ms']:10.2f} {r['floor_ms']:7.2f} "
              f"{r['aoti_ms'] / r['floor_ms']:10.2f}")  # fmt: skip
    builds = {r["weights"]: round(r["build_s"], 1) for r in rows}
    print(f"package build (export + compile) seconds: {builds}")
    out = results_dir(a) / "decode_step.json"
    out.write_text(json.dumps({"bandwidth_gib_s": bandwidth, "rows": rows, **vars(a) | {
        "results": None}}, indent=1, default=str))  # fmt: skip
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
