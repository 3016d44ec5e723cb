"""The LM's decode step per weight format and backend, against the machine's limit.

  .venv/bin/python bench/decode_step.py [--weights same,bfloat16,int4] [--batches 1,8]
      [--backends eager,aoti] [--context 256] [--calls 30] (--weights int4:native: int4 on
      this project's linear kernel)
      [--mode max-autotune] [--freeze-weights on] [--attention native,sdpa]
      [--kv-pages huge,4k] [--kv-cache-dtype same,float16]
      [--quick --lm-model DIR]   (smoke run: tiny model, batch 1 and 2, 3 calls)

The service's own model code and padding: eager (mode none) and from an AOTInductor
package (--backends aoti; built here, at the first call), the decode attention this
project's kernel or torch's SDPA (--attention). Every (weights, backend) arm is
loaded in this process and the timed calls are interleaved round by round on the same
inputs, so a drift of a shared machine hits every arm alike. A decode step reads every
weight once (plus the rows' KV cache), so at small batches its floor is weight bytes /
memory bandwidth (measured here: a sum over 512 MiB); a step above it is overhead, not
arithmetic. Prints the CPU (what inference_svc/models/cpu.py reads), the median step per
arm and batch with its speed-up over the first weights' eager step and its ratio to the
floor (--kv-pages huge,4k: each arm also with its KV cache in torch's 4 KiB pages, a row
"BACKEND/4k": the same model, the cache swapped in for its calls; --kv-cache-dtype
same,float16: each arm also with a float16 cache, a row "BACKEND/kv16"), and what
``--lm-weights auto`` chooses here (its table comes from the eager columns); writes
results/decode_step.json. A benchmark, not a test: it asserts nothing.
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
from inference_api.plan import Bucket, Phase  # noqa: E402
from inference_svc.compile_monitor import Origin  # noqa: E402
from inference_svc.engine.buckets import GenBuckets  # noqa: E402
from inference_svc.limits import GenLimits  # noqa: E402
from inference_svc.models import cpu  # noqa: E402
from inference_svc.models.aoti import ScratchPackages  # noqa: E402
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
    a: argparse.Namespace, weights: str, backend: str, max_batch: int, stores: list
) -> GenerativeModel:
    """One arm: eager (mode none), or the same model run from an AOTInductor package;
    ``backend`` "eager" or "aoti", with ":native" or ":sdpa" for the decode attention, then
    "/kv16" for a float16 KV cache (--kv-cache-dtype float16); ``weights`` a --lm-weights
    scheme, with ":native" for int4 on this project's linear kernel (--linear-kernel native;
    torch's otherwise)."""
    backend, kv16, _ = backend.partition("/kv16")
    backend, _, attention = backend.partition(":")
    weights, _, linear = weights.partition(":")
    ctx, mode = arm_context(a, "lm", torch.float32, backend, stores)
    limits = GenLimits(max_batch, 512, 512, 64)
    cache = Path("~/.cache/inference-svc/models").expanduser()
    m = load_generative(ctx, resolve_lm_dir(a.lm_model or "default"), limits, cache, weights,
                        attention=attention or "native", linear=linear or "torch",
                        kv_cache="float16" if kv16 else "same")  # fmt: skip
    m.set_ranges(GenBuckets.plan(limits, mode, aoti=backend == "aoti").ranges())
    m.allocate_cache(max_batch)
    return m


class FourKiB:
    """A model's decode step on a KV cache in torch's own 4 KiB pages (the service's lies in
    huge pages where the kernel gives them: models/hugepages.py): the same model and
    packages, this cache swapped in for each call."""

    def __init__(self, m: GenerativeModel) -> None:
        assert m.k_cache is not None, "allocate the model's cache first"
        self.m, self.lm = m, m.lm
        with torch.inference_mode(False):
            self.k = [torch.zeros_like(t) for t in m.k_cache]
            self.v = [torch.zeros_like(t) for t in m.v_cache]

    def decode(self, *args: object) -> torch.Tensor:
        m = self.m
        own = m.k_cache, m.v_cache
        m.k_cache, m.v_cache = self.k, self.v
        try:
            return m.decode(*args)
        finally:
            m.k_cache, m.v_cache = own


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


def measure(
    models: dict[Arm, GenerativeModel], batches: list[int], context: int, calls: int
) -> tuple[dict[tuple[Arm, int], float], dict[Arm, float]]:
    """Median ms per (arm, batch), each round timing one call of every pair; and the
    seconds each arm's first call took (a package's build)."""
    gen = torch.Generator().manual_seed(0)
    vocab = min(m.lm.shape.vocab_size for m in models.values())
    calls_of = {}
    for b in batches:
        ids = torch.randint(0, vocab, (b, 1), generator=gen)
        pos = torch.randint(0, context, (b, 1), generator=gen)
        pos[0, 0] = context - 1
        calls_of[b] = (ids, pos, Bucket(Phase.DECODE, b, 1, context))
    first: dict[Arm, float] = {}
    for arm, m in models.items():
        first[arm] = _timed(lambda m=m: m.decode(*calls_of[batches[0]], Origin.WARMUP))
        for b in batches:
            for _ in range(3):  # warm: first calls allocate, pack and dispatch
                m.decode(*calls_of[b], Origin.WARMUP)
    ms = interleaved(models, batches, calls, lambda m, b: m.decode(*calls_of[b], Origin.WARMUP))
    return ms, first


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--weights", default="same,bfloat16,int4",
                   help="--lm-weights schemes; int4:native for int4 on this project's kernel "
                   "(--linear-kernel native)")  # fmt: skip
    p.add_argument("--batches", default="1,8")
    p.add_argument("--backends", default="eager,aoti", help="eager and/or aoti")
    p.add_argument(
        "--attention",
        default="native",
        help="native and/or sdpa: the decode step's attention (--decode-attention)",
    )
    p.add_argument("--context", type=int, default=256, help="slots attended")
    p.add_argument("--kv-pages", default="huge", choices=("huge", "huge,4k"),
                   help="huge,4k: each arm also on a cache in 4 KiB pages")  # fmt: skip
    p.add_argument("--kv-cache-dtype", default="same", choices=("same", "same,float16"),
                   help="same,float16: each arm also with a float16 cache, 'BACKEND/kv16' "
                   "(its own packages)")  # fmt: skip
    p.add_argument("--calls", type=int, default=30, help="timed calls per point (median)")
    p.add_argument("--mode", default="max-autotune", choices=("default", "max-autotune"))
    p.add_argument("--freeze-weights", default="on", choices=("on", "off"))
    add_quick_flags(p)
    a = p.parse_args(argv)
    if a.quick:
        a.weights, a.batches, a.calls, a.mode, a.context = "same,int4", "1,2", 3, "default", 32
    weights, backends = a.weights.split(","), a.backends.split(",")
    attentions = a.attention.split(",")
    if len(attentions) > 1:  # each backend with each attention: "aoti:native", "aoti:sdpa"
        backends = [f"{be}:{at}" for be in backends for at in attentions]
    if a.kv_cache_dtype == "same,float16":
        backends = [f"{be}{kv}" for be in backends for kv in ("", "/kv16")]
    batches = [int(b) for b in a.batches.split(",")]
    bandwidth = bandwidth_gib_s(64 if a.quick else 512)
    print_cpu(f"; memory read bandwidth {bandwidth:.1f} GiB/s")
    stores: list[ScratchPackages] = []
    top = max(max(batches), 2)
    # Loaded outside inference mode: torch.export cannot trace inference tensors.
    models = {(w, be): load(a, w, be, top, stores) for w in weights for be in backends}
    if a.kv_pages == "huge,4k":
        models |= {(w, f"{be}/4k"): FourKiB(m) for (w, be), m in list(models.items())}
    floors = {arm: weight_bytes(m) / 2**30 / bandwidth * 1e3 for arm, m in models.items()}
    with torch.inference_mode():
        ms, first = measure(models, batches, a.context, a.calls)
    for store in stores:
        store.close()
    base = (weights[0], backends[0])
    print(f"\ndecode step, context {a.context}, median of {a.calls} calls (ms); x: speed-up over "
          f"{base[0]} {base[1]}; /floor: over reading the weights once; packages: mode "
          f"{a.mode}, freeze {a.freeze_weights}")  # fmt: skip
    head = "".join(f" {'batch ' + str(b):>9} {'x':>5} {'/floor':>6}" for b in batches)
    print(f"{'weights':9} {'backend':11} {'floor':>6}" + head)
    rows = []
    for arm in models:
        cells = "".join(f" {ms[(arm, b)]:9.2f} {ms[(base, b)] / ms[(arm, b)]:5.2f} "
                        f"{ms[(arm, b)] / floors[arm]:6.2f}" for b in batches)  # fmt: skip
        print(f"{arm[0]:9} {arm[1]:11} {floors[arm]:6.2f}" + cells)
        rows += [{"weights": arm[0], "backend": arm[1], "batch": b, "ms": ms[(arm, b)],
                  "floor_ms": floors[arm], "first_call_s": first[arm]}
                 for b in batches]  # fmt: skip
    choice = cpu.choose_lm_weights("auto", torch.device("cpu"))
    finish(a, "decode_step", "--lm-weights", choice, first, rows, bandwidth_gib_s=bandwidth)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
