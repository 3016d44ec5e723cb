"""Embed's forward in process, per dtype and backend: what compiled packages and bfloat16 pay
before gRPC and batching come into it.

  .venv/bin/python bench/embed_step.py [--dtypes float32,bfloat16] [--backends eager,aoti]
      [--shapes 1x16,8x64,32x128] [--calls 15] [--mode max-autotune] [--freeze-weights on]
      [--quick --embed-model DIR]   (smoke run: tiny model, float32 eager, 1x16 and 2x16, 3 calls)

The service's own loader and forward (padding, pooling, normalisation): eager (mode none)
and from an AOTInductor package (built here at its first call, exported over the service's
Embed ranges). Every (dtype, backend) arm is loaded in this process and the timed calls are
interleaved round by round on the same random token ids, so a drift of a shared machine
hits every arm alike. Prints the median forward per arm and shape (batch x tokens) with its
speed-up over the first arm, texts/s at each shape, the cosine of each arm's vectors with
the first arm's on the same ids, and what ``--embed-dtype auto`` picks here; writes
results/embed_step.json. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import add_quick_flags  # noqa: E402
from bench.in_process import Arm, arm_context, finish, interleaved, print_cpu  # noqa: E402
from inference_svc.compile_monitor import Origin  # noqa: E402
from inference_svc.engine.buckets import EmbedBuckets  # noqa: E402
from inference_svc.models import cpu  # noqa: E402
from inference_svc.models.aoti import ScratchPackages  # noqa: E402
from inference_svc.models.embedding import EmbeddingModel, load_embedding  # noqa: E402
from inference_svc.models.loading import resolve_embed_dir  # noqa: E402


def load(a: argparse.Namespace, dtype: str, backend: str, stores: list) -> EmbeddingModel:
    """One arm: eager (mode none), or the same model run from an AOTInductor package."""
    ctx, mode = arm_context(a, "embedding", getattr(torch, dtype), backend, stores)
    m = load_embedding(ctx, resolve_embed_dir(a.embed_model or "default"))
    ranges = EmbedBuckets.plan(32, m.max_input_tokens, mode, aoti=backend == "aoti").ranges()
    for graph in m.graphs:
        graph.ranges = ranges
    return m


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--backends", default="eager,aoti", help="eager and/or aoti")
    p.add_argument("--shapes", default="1x16,8x64,32x128", help="batch x tokens, padded")
    p.add_argument("--calls", type=int, default=15, help="timed calls per point (median)")
    p.add_argument("--mode", default="max-autotune", choices=("default", "max-autotune"))
    p.add_argument("--freeze-weights", default="on", choices=("on", "off"))
    add_quick_flags(p)
    a = p.parse_args(argv)
    if a.quick:
        a.dtypes, a.backends, a.shapes, a.calls = "float32", "eager", "1x16,2x16", 3
    shapes = [tuple(int(n) for n in s.split("x")) for s in a.shapes.split(",")]
    print_cpu()
    stores: list[ScratchPackages] = []
    dtypes, backends = a.dtypes.split(","), a.backends.split(",")
    # Loaded outside inference mode: torch.export cannot trace inference tensors.
    models = {(d, be): load(a, d, be, stores) for d in dtypes for be in backends}
    gen = torch.Generator().manual_seed(0)
    vocab = min(m.vocab_size for m in models.values())
    inputs = {s: torch.randint(1000, vocab, s, generator=gen) for s in shapes}
    first: dict[Arm, float] = {}
    vectors: dict[Arm, torch.Tensor] = {}
    for arm, m in models.items():
        start = time.perf_counter()
        for ids in inputs.values():  # the first call builds a package; vectors: the last shape
            vectors[arm] = m.forward(ids, torch.ones_like(ids), Origin.WARMUP)
            m.forward(ids, torch.ones_like(ids), Origin.WARMUP)
        first[arm] = time.perf_counter() - start
    masks = {s: torch.ones_like(ids) for s, ids in inputs.items()}
    ms = interleaved(
        models, shapes, a.calls, lambda m, s: m.forward(inputs[s], masks[s], Origin.WARMUP)
    )
    for store in stores:
        store.close()
    base = next(iter(models))
    print(f"\nEmbed forward in process, median of {a.calls} calls (ms); x: speed-up over "
          f"{base[0]} {base[1]}; packages: mode {a.mode}, freeze {a.freeze_weights}")  # fmt: skip
    head = "".join(f" {f'{b}x{n}':>9} {'x':>5} {'texts/s':>8}" for b, n in shapes)
    print(f"{'dtype':9} {'backend':7} {'cosine':>8}" + head)
    rows = []
    for arm in models:
        cos = float(torch.nn.functional.cosine_similarity(vectors[arm], vectors[base]).min())
        cells = "".join(f" {ms[(arm, s)]:9.2f} {ms[(base, s)] / ms[(arm, s)]:5.2f} "
                        f"{s[0] / ms[(arm, s)] * 1e3:8.1f}" for s in shapes)  # fmt: skip
        print(f"{arm[0]:9} {arm[1]:7} {cos:8.6f}" + cells)
        rows += [{"dtype": arm[0], "backend": arm[1], "batch": s[0], "tokens": s[1],
                  "ms": ms[(arm, s)], "cosine_min": cos, "first_calls_s": first[arm]}
                 for s in shapes]  # fmt: skip
    choice = cpu.choose_embed_dtype("auto", torch.device("cpu"))
    finish(a, "embed_step", "--embed-dtype", choice, first, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
