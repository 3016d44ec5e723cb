"""The warmup steps: PROFILE, COMPILE and SAMPLER, each run on the model's thread.

Each step is idempotent (what already ran is not run again) and reports what it
ran, what it skipped and why, how long it took and the compile events it caused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import product

import torch

from inference_svc.compile_monitor import CompileMonitor
from inference_svc.engine.generation import random_logits, sampling_metadata
from inference_svc.engine.memory import available_bytes, peak_during
from inference_svc.engine.types import GenerateParams
from inference_svc.errors import FailedPrecondition, ResourceExhausted
from inference_svc.models.embedding import EmbeddingModel
from inference_svc.models.generative import GenerativeModel
from inference_svc.sampling import MAX_LOGPROBS, Sampler
from warmup_ctl.plan import CompilationMode, LogprobsMode, SamplerPath, StepKind

log = logging.getLogger(__name__)
Bucket = tuple[str, int, int]  # (phase, batch, seq_len)
WARMUP_SEED = 1234  # the warmup's own generator: the global random state is untouched


@dataclass
class StepReport:
    model: str
    step: StepKind
    skipped: bool = False
    skip_reason: str = ""
    shapes: list[Bucket] = field(default_factory=list)
    paths: list[SamplerPath] = field(default_factory=list)
    seconds: float = 0.0
    compile_events: int = 0
    kv_cache_tokens: int = 0
    detail: str = ""


def timed(monitor: CompileMonitor, report: StepReport, fn: Callable[[], None]) -> StepReport:
    start = time.perf_counter()
    with monitor.counting() as box:
        fn()
    report.seconds = time.perf_counter() - start
    report.compile_events = box[0]
    return report


def embed_buckets(m: EmbeddingModel) -> list[Bucket]:
    return [("embed", b, n) for b, n in product(m.batch_buckets, m.length_buckets)]


def generative_buckets(m: GenerativeModel) -> list[Bucket]:
    rows = m.usable_batch_buckets() if m.cache_rows else m.batch_buckets
    prefill = [("prefill", b, n) for b, n in product(rows, m.prefill_buckets)]
    return prefill + [("decode", b, 1) for b in rows]


def profile(
    m: GenerativeModel, fraction: float, compiled: set[Bucket], monitor: CompileMonitor
) -> StepReport:
    """Size the KV cache from a profile forward at the largest shape."""
    report = StepReport(m.name, StepKind.PROFILE)
    if m.cache_rows:
        report.skipped = True
        report.skip_reason = f"KV cache already sized: {m.kv_cache_tokens} tokens"
        report.kv_cache_tokens = m.kv_cache_tokens
        return report
    gen = torch.Generator().manual_seed(WARMUP_SEED)

    def run() -> None:
        m.allocate_cache(m.limits.max_batch * m.limits.max_seq_len)
        cache_bytes = m.kv_cache_tokens * m.kv_bytes_per_token()
        batch, length = m.batch_buckets[-1], m.prefill_buckets[-1]
        if m.mode is not CompilationMode.NONE:
            # Compile first, then measure a second run: the compiler's own memory is not
            # the forward's and would shrink the cache for nothing.
            m.dummy_prefill(batch, length, gen)
            compiled.add(("prefill", batch, length))
        peak = peak_during(m.device, lambda: m.dummy_prefill(batch, length, gen))
        report.shapes.append(("prefill", batch, length))
        budget = int((available_bytes(m.device) + cache_bytes) * fraction) - peak
        fits = max(budget, 0) // (m.kv_bytes_per_token() * m.limits.max_seq_len)
        rows = min(m.limits.max_batch, fits)
        if rows < 2:
            m.k_cache = m.v_cache = None
            raise ResourceExhausted(
                f"KV cache: {budget} bytes available hold {rows} sequences of "
                f"{m.limits.max_seq_len} tokens, fewer than 2; free memory, raise "
                "--kv-cache-memory-fraction or lower --max-new-tokens"
            )
        if rows < m.cache_rows:
            m.allocate_cache(rows * m.limits.max_seq_len)
        report.kv_cache_tokens = m.kv_cache_tokens
        report.detail = (
            f"activation peak {peak / 2**20:.0f} MiB at batch {batch} x {length}; "
            f"KV cache {m.kv_cache_tokens} tokens ({m.cache_rows} sequences)"
        )

    return timed(monitor, report, run)


def compile_buckets(
    model: GenerativeModel | EmbeddingModel,
    compiled: set[Bucket],
    monitor: CompileMonitor,
    after: Callable[[], None] | None = None,
) -> StepReport:
    """Dummy forwards over every shape bucket not compiled yet; then ``after`` (a request
    through the whole request path, so its eager steps are not first run by a client)."""
    report = StepReport(model.name, StepKind.COMPILE)
    if model.mode is CompilationMode.NONE:
        report.skipped, report.skip_reason = True, "compilation mode NONE: nothing compiles"
        return report
    if isinstance(model, GenerativeModel) and not model.cache_rows:
        raise FailedPrecondition(
            f"COMPILE {model.name}: the KV cache is not sized yet; run PROFILE first"
        )
    if isinstance(model, EmbeddingModel):
        buckets = embed_buckets(model)
    else:
        buckets = generative_buckets(model)
    todo = [b for b in buckets if b not in compiled]
    if not todo:
        report.skipped = True
        report.skip_reason = f"all {len(buckets)} buckets already compiled"
        return report
    gen = torch.Generator().manual_seed(WARMUP_SEED)

    def run() -> None:
        for bucket in sorted(todo, key=lambda b: (b[0], -b[1], -b[2])):  # largest first
            phase, batch, length = bucket
            if phase == "embed":
                model.dummy_run(batch, length, gen)
            elif phase == "prefill":
                model.dummy_prefill(batch, length, gen)
            else:
                model.dummy_decode(batch, gen)
            compiled.add(bucket)
            report.shapes.append(bucket)
        if after is not None:
            after()
        report.detail = f"{len(todo)} of {len(buckets)} buckets run"

    return timed(monitor, report, run)


def _warm_params(path: SamplerPath, row: int) -> GenerateParams:
    random = path is not SamplerPath.GREEDY and not (path is SamplerPath.LOGPROBS and row == 0)
    return GenerateParams(
        prompt="warmup",
        messages=(),
        temperature=0.8 if random else 0.0,
        top_k=40 if row % 2 else 0,
        top_p=0.9,
        seed=WARMUP_SEED + row if path in (SamplerPath.SEEDED, SamplerPath.LOGPROBS) else None,
        logprobs=MAX_LOGPROBS if path is SamplerPath.LOGPROBS else 0,
    )


def warm_sampler(
    m: GenerativeModel,
    sampler: Sampler,
    paths: list[SamplerPath],
    mode: LogprobsMode,
    monitor: CompileMonitor,
) -> StepReport:
    """Sample from random logits on each path, at every batch bucket."""
    report = StepReport(m.name, StepKind.SAMPLER)
    if m.mode is CompilationMode.NONE:
        report.skipped, report.skip_reason = True, "compilation mode NONE: nothing compiles"
        return report
    gen = torch.Generator().manual_seed(WARMUP_SEED)
    vocab = m.lm.shape.vocab_size

    def run() -> None:
        for path in paths:
            for batch in m.usable_batch_buckets():
                params = [_warm_params(path, row) for row in range(batch)]
                md = sampling_metadata(list(params), m.device, mode)
                sampler(random_logits(batch, vocab, gen, m.device), md)
            report.paths.append(path)
        report.detail = f"{len(paths)} paths x batch {list(m.usable_batch_buckets())}"

    return timed(monitor, report, run)
