"""Decode attention: torch's SDPA against this project's kernel (--decode-attention native).

  .venv/bin/python bench/decode_attention.py [--shapes 1x256,1x1024,8x256,16x256,16x512]
      [--calls 100] [--quick]

One decode step's attention for SmolLM2's layout (3 KV heads, 3 query heads each, head size
64), batch x slots per shape, over 30 layers that each have their own cache (as a step reads
them: cold), eager: SDPA as ``LlamaLM.decode`` calls it with ``--decode-attention sdpa``
(query heads grouped per KV head, a boolean mask up to each row's position) against
``torch.ops.inference.decode_attention`` (inference_svc/kernels, built or loaded from the
user's cache), the two timed in turns (bench/in_process.py's interleaved medians). The
first row attends to every slot, the others to a random number of them, as rows of
different ages do. A third arm runs the kernel on the same caches in transparent huge
pages, allocated as the service allocates its cache (inference_svc/models/hugepages.py; the
others lie in torch's 4 KiB pages). Prints microseconds a layer for each, the time the bytes
the rows attend to take at the machine's measured read bandwidth, and the largest difference
between SDPA and the kernel; writes results/decode_attention.json. A benchmark, not a test:
it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import add_quick_flags, results_dir  # noqa: E402
from bench.decode_step import bandwidth_gib_s  # noqa: E402
from bench.in_process import interleaved  # noqa: E402
from inference_svc import kernels  # noqa: E402
from inference_svc.models import hugepages  # noqa: E402

KV, GROUP, HEAD = 3, 3, 64


def measure(batch: int, slots: int, layers: int, calls: int, gib_s: float) -> dict:
    gen = torch.Generator().manual_seed(0)
    rows, capacity = batch + 1, slots + 1  # views of a larger cache, as the step passes them
    ks = [torch.randn(rows, KV, capacity, HEAD, generator=gen) for _ in range(layers)]
    vs = [torch.randn(rows, KV, capacity, HEAD, generator=gen) for _ in range(layers)]
    pos = torch.randint(0, slots, (batch,), generator=gen)
    pos[0] = slots - 1
    mask = (torch.arange(slots)[None, :] <= pos[:, None])[:, None, None, :]
    q = torch.randn(batch, KV, GROUP, HEAD, generator=gen)
    scale = HEAD**-0.5
    op = torch.ops.inference.decode_attention

    def sdpa() -> None:
        for k, v in zip(ks, vs, strict=True):
            F.scaled_dot_product_attention(q, k[:batch, :, :slots], v[:batch, :, :slots],
                                           attn_mask=mask, scale=scale)  # fmt: skip

    def native() -> None:
        for k, v in zip(ks, vs, strict=True):
            op(q, k[:batch, :, :slots], v[:batch, :, :slots], pos, 0, scale)

    huge_k, pages = hugepages.zeros(layers, tuple(ks[0].shape), torch.float32)
    huge_v, _ = hugepages.zeros(layers, tuple(ks[0].shape), torch.float32)
    for copy, source in zip([*huge_k, *huge_v], [*ks, *vs], strict=True):
        copy.copy_(source)

    def native_huge() -> None:
        for k, v in zip(huge_k, huge_v, strict=True):
            op(q, k[:batch, :, :slots], v[:batch, :, :slots], pos, 0, scale)

    k, v = ks[0][:batch, :, :slots], vs[0][:batch, :, :slots]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    got = op(q, k, v, pos, 0, scale)
    arms = {"sdpa": sdpa, "native": native, "huge": native_huge}
    for fn in arms.values():
        for _ in range(5):  # warm: first calls allocate
            fn()
    ms = interleaved(arms, [0], calls, lambda fn, _: fn())
    read = 2 * KV * HEAD * 4 * int((pos + 1).sum())  # the keys and values the rows attend to
    return {
        "batch": batch, "slots": slots,
        "sdpa_us": ms[("sdpa", 0)] * 1e3 / layers,
        "native_us": ms[("native", 0)] * 1e3 / layers,
        "native_huge_us": ms[("huge", 0)] * 1e3 / layers,
        "huge_pages": pages,
        "bytes_us": read / (gib_s * 2**30) * 1e6,
        "max_diff": float((want - got).abs().max()),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="1x256,1x1024,8x256,16x256,16x512", help="BATCHxSLOTS")
    p.add_argument("--calls", type=int, default=100, help="rounds, each timing both arms (median)")
    add_quick_flags(p)
    a = p.parse_args(argv)
    out = results_dir(a)
    if a.quick:
        a.shapes, a.calls = "1x64,2x64", 3
    layers = 2 if a.quick else 30
    kernels.load()
    gib_s = bandwidth_gib_s(64 if a.quick else 512)
    rows = []
    for shape in a.shapes.split(","):
        batch, slots = (int(x) for x in shape.split("x"))
        rows.append(measure(batch, slots, layers, a.calls, gib_s))
    print(
        f"decode attention, {layers} layers with their own caches, eager, "
        f"{torch.get_num_threads()} threads, read bandwidth {gib_s:.1f} GiB/s; us a layer"
    )
    print(f"native in huge pages: {rows[0]['huge_pages'] if rows else '-'}")
    print(f"{'batch':>5} {'slots':>6} {'SDPA':>8} {'native':>8} {'SDPA/native':>11} "
          f"{'huge':>8} {'huge/native':>11} {'bytes':>7} {'max diff':>9}")  # fmt: skip
    for r in rows:
        print(
            f"{r['batch']:>5} {r['slots']:>6} {r['sdpa_us']:>8.1f} {r['native_us']:>8.1f} "
            f"{r['sdpa_us'] / r['native_us']:>11.2f} {r['native_huge_us']:>8.1f} "
            f"{r['native_huge_us'] / r['native_us']:>11.2f} {r['bytes_us']:>7.1f} "
            f"{r['max_diff']:>9.1e}"
        )
    (out / "decode_attention.json").write_text(
        json.dumps({"threads": torch.get_num_threads(), "bandwidth_gib_s": gib_s, "rows": rows},
                   indent=2)
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
