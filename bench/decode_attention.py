"""Decode attention: torch's SDPA (what every graph calls today) against a plain C++ kernel.

  .venv/bin/python bench/decode_attention.py [--shapes 1x256,1x1024,8x256,16x256,16x512]
      [--calls 100] [--quick]

One decode step's attention for SmolLM2's layout (3 KV heads, 3 query heads each, head size
64), batch x slots per shape, over 30 layers that each have their own cache (as a step reads
them: cold), eager: SDPA as ``LlamaLM.decode`` calls it (query heads grouped per KV head, a
boolean mask up to each row's position), against a 40-line C++ kernel built here with
``torch.utils.cpp_extension.load_inline`` (``-O3 -march=native``, one task per row and KV
head, scores, softmax and the weighted sum of values in one pass over the cache), the two
timed in turns (bench/in_process.py's interleaved medians). Prints
microseconds a layer for each and the time the cache's bytes take at the machine's measured
read bandwidth, and the largest difference between the two. The kernel is a measurement of
what a decode attention of our own could gain (it is not called by the service: a custom op
that AOTInductor packages call would be); writes results/decode_attention.json. A
benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import add_quick_flags, results_dir  # noqa: E402
from bench.decode_step import bandwidth_gib_s  # noqa: E402
from bench.in_process import interleaved  # noqa: E402

KV, GROUP, HEAD = 3, 3, 64
KERNEL = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>
// q [B, KV, G, D] f32; k, v [R, KV, S, D] f32 (cache, first L slots used); pos [B] int64:
// row b attends slots 0..pos[b]. out [B, KV, G, D].
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                               torch::Tensor pos, int64_t L, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat && k.dtype() == torch::kFloat);
  TORCH_CHECK(v.dtype() == torch::kFloat);
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && L <= k.size(2));
  q = q.contiguous();
  pos = pos.to(torch::kLong).contiguous();
  const int64_t B = q.size(0), KV = q.size(1), G = q.size(2), D = q.size(3);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  at::parallel_for(0, B * KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sc(G * L);
    std::vector<float> acc(D);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / KV, h = t % KV;
      const int64_t n = std::min<int64_t>(pp[b] + 1, L);
      const float* kb = kp + b * ks0 + h * ks1;
      const float* vb = vp + b * vs0 + h * vs1;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qp + ((b * KV + h) * G + g) * D;
        float* s = sc.data() + g * L;
        float mx = -INFINITY;
        for (int64_t j = 0; j < n; ++j) {
          const float* kj = kb + j * ks2;
          float d = 0.f;
          #pragma omp simd reduction(+:d)
          for (int64_t x = 0; x < D; ++x) d += qg[x] * kj[x];
          s[j] = d * (float)scale;
          mx = std::max(mx, s[j]);
        }
        float sum = 0.f;
        for (int64_t j = 0; j < n; ++j) { s[j] = std::exp(s[j] - mx); sum += s[j]; }
        for (int64_t x = 0; x < D; ++x) acc[x] = 0.f;
        for (int64_t j = 0; j < n; ++j) {
          const float* vj = vb + j * vs2; const float w = s[j];
          #pragma omp simd
          for (int64_t x = 0; x < D; ++x) acc[x] += w * vj[x];
        }
        float* o = op + ((b * KV + h) * G + g) * D;
        for (int64_t x = 0; x < D; ++x) o[x] = acc[x] / sum;
      }
    }
  });
  return out;
}
"""


def build(directory: Path):
    from torch.utils.cpp_extension import load_inline

    # torch runs `ninja` from PATH: the one pip put beside this interpreter, if not on it
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"

    directory.mkdir(parents=True, exist_ok=True)
    return load_inline(
        "decode_attention_bench", cpp_sources=KERNEL, functions=["decode_attention"],
        extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
    )  # fmt: skip


def measure(ext, batch: int, slots: int, layers: int, calls: int, gib_s: float) -> dict:
    gen = torch.Generator().manual_seed(0)
    rows, capacity = batch + 1, slots + 1
    ks = [torch.randn(rows, KV, capacity, HEAD, generator=gen) for _ in range(layers)]
    vs = [torch.randn(rows, KV, capacity, HEAD, generator=gen) for _ in range(layers)]
    pos = torch.randint(0, slots, (batch,), generator=gen)
    pos[0] = slots - 1
    mask = (torch.arange(slots)[None, :] <= pos[:, None])[:, None, None, :]
    q = torch.randn(batch, KV, GROUP, HEAD, generator=gen)
    scale = HEAD**-0.5

    def sdpa() -> None:
        for k, v in zip(ks, vs, strict=True):
            F.scaled_dot_product_attention(q, k[:batch, :, :slots], v[:batch, :, :slots],
                                           attn_mask=mask)  # fmt: skip

    def plain() -> None:
        for k, v in zip(ks, vs, strict=True):
            ext.decode_attention(q, k, v, pos, slots, scale)

    want = F.scaled_dot_product_attention(q, ks[0][:batch, :, :slots], vs[0][:batch, :, :slots],
                                          attn_mask=mask)  # fmt: skip
    got = ext.decode_attention(q, ks[0], vs[0], pos, slots, scale)
    arms = {"sdpa": sdpa, "plain": plain}
    for fn in arms.values():
        for _ in range(5):  # warm: first calls allocate
            fn()
    ms = interleaved(arms, [0], calls, lambda fn, _: fn())
    cache_bytes = 2 * batch * KV * slots * HEAD * 4
    return {
        "batch": batch, "slots": slots,
        "sdpa_us": ms[("sdpa", 0)] * 1e3 / layers,
        "plain_us": ms[("plain", 0)] * 1e3 / layers,
        "bytes_us": cache_bytes / (gib_s * 2**30) * 1e6,
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
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp) if a.quick else Path.home() / ".cache/inference-svc/decode-attention"
        ext = build(where)
        gib_s = bandwidth_gib_s(64 if a.quick else 512)
        rows = []
        for shape in a.shapes.split(","):
            batch, slots = (int(x) for x in shape.split("x"))
            rows.append(measure(ext, batch, slots, layers, a.calls, gib_s))
    print(
        f"decode attention, {layers} layers with their own caches, eager, "
        f"{torch.get_num_threads()} threads, read bandwidth {gib_s:.1f} GiB/s; us a layer"
    )
    print(f"{'batch':>5} {'slots':>6} {'SDPA':>8} {'plain C++':>10} {'SDPA/C++':>9} "
          f"{'bytes':>7} {'max diff':>9}")  # fmt: skip
    for r in rows:
        print(
            f"{r['batch']:>5} {r['slots']:>6} {r['sdpa_us']:>8.1f} {r['plain_us']:>10.1f} "
            f"{r['sdpa_us'] / r['plain_us']:>9.2f} {r['bytes_us']:>7.1f} {r['max_diff']:>9.1e}"
        )
    (out / "decode_attention.json").write_text(
        json.dumps({"threads": torch.get_num_threads(), "bandwidth_gib_s": gib_s, "rows": rows},
                   indent=2)
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
