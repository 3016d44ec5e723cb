"""The warmup steps: PROFILE, COMPILE and SAMPLER, each run on the compute thread.

Each step is idempotent (what already ran is not run again) and reports what it
ran, what it skipped and why, how long it took and the compile events it caused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from itertools import product

import torch

from inference_api.plan import Bucket, CompilationMode, LogprobsMode, Phase, SamplerPath, StepKind
from inference_svc.compile_monitor import CompileMonitor
from inference_svc.engine.memory import available_bytes, peak_during
from inference_svc.engine.runner import random_logits, request_generator, sampling_metadata
from inference_svc.engine.runtime import StepReport, timed
from inference_svc.engine.types import GenerateParams
from inference_svc.errors import ResourceExhausted
from inference_svc.models.compile import bucket_for
from inference_svc.models.embedding import EmbeddingModel
from inference_svc.models.generative import GenerativeModel
from inference_svc.sampling import MAX_LOGPROBS, Sampler

log = logging.getLogger(__name__)
WARMUP_SEED = 1234  # the warmup's own generator: the global random state is untouched
NOTHING_COMPILES = "compilation mode NONE: nothing compiles"


def embed_buckets(m: EmbeddingModel) -> tuple[Bucket, ...]:
    return tuple(Bucket(Phase.EMBED, b, n) for b, n in product(m.batch_buckets, m.length_buckets))


def generative_buckets(m: GenerativeModel) -> tuple[Bucket, ...]:
    """Every shape the scheduler can run: a prefill chunk (one row) of each chunk bucket
    against each context bucket that can hold it, and a decode step of each batch bucket
    against each context bucket."""
    rows = m.usable_batch_buckets() if m.cache_rows else m.batch_buckets
    slots = m.limits.max_seq_len
    # A chunk starts at a multiple of the chunk limit and ends by the prompt's last chunk.
    limit = m.chunk_buckets[-1]
    furthest = bucket_for(
        min(-(-m.limits.max_input_tokens // limit) * limit, slots), m.context_buckets
    )
    prefill = [
        Bucket(Phase.PREFILL, 1, c, ctx)
        for c, ctx in product(m.chunk_buckets, m.context_buckets)
        if bucket_for(min(c, slots), m.context_buckets) <= ctx <= furthest
    ]
    decode = [Bucket(Phase.DECODE, b, 1, ctx) for b, ctx in product(rows, m.context_buckets)]
    return (*prefill, *decode)


def profile(
    m: GenerativeModel,
    fraction: float,
    compiled: set[Bucket],
    monitor: CompileMonitor,
    loaded: bool = False,
) -> StepReport:
    """Size the KV cache from a profile forward at the largest shape. ``loaded``: the
    graphs came from kept artifacts, so the measured run is also their first."""
    if m.cache_rows:
        report = StepReport.skip(
            m.name, StepKind.PROFILE, f"KV cache already sized: {m.kv_cache_tokens} tokens"
        )
        report.kv_cache_tokens = m.kv_cache_tokens
        return report
    report = StepReport(m.name, StepKind.PROFILE)
    gen = torch.Generator().manual_seed(WARMUP_SEED)

    def run() -> None:
        m.allocate_cache(m.limits.max_batch * m.limits.max_seq_len)
        cache_bytes = m.kv_cache_tokens * m.kv_bytes_per_token()
        # The largest shapes: a decode step over every row, a full chunk at full context.
        batch, context = m.batch_buckets[-1], m.context_buckets[-1]
        chunk = [b for b in generative_buckets(m) if b.phase is Phase.PREFILL][-1]
        largest = (Bucket(Phase.DECODE, batch, 1, context), chunk)

        def forwards() -> None:
            m.dummy_decode(batch, context, gen)
            m.dummy_prefill(chunk.seq_len, chunk.context_len, gen)

        compiles = m.mode is not CompilationMode.NONE
        if compiles and not loaded:
            # Compile first, then measure a second run: the compiler's own memory is not
            # the forward's and would shrink the cache for nothing. (Graphs loaded from
            # artifacts do not compile: one run. Should one miss, the compiler's memory
            # counts as the forward's: a smaller cache, never a larger one.)
            forwards()
        peak = peak_during(m.device, forwards)
        if compiles:
            compiled.update(largest)
        report.buckets.extend(largest)
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
            f"activation peak {peak / 2**20:.0f} MiB at decode {batch} rows, {chunk}; "
            f"KV cache {m.kv_cache_tokens} tokens ({m.cache_rows} sequences)"
        )

    return timed(monitor, report, run)


def compile_buckets(
    name: str,
    mode: CompilationMode,
    buckets: tuple[Bucket, ...],
    compiled: set[Bucket],
    run_bucket: Callable[[Bucket, torch.Generator], object],
    monitor: CompileMonitor,
    after: Callable[[], None] | None = None,
    artifacts: str = "",
) -> StepReport:
    """A dummy forward at every bucket not compiled yet, largest first; then ``after`` (a
    request through the whole request path, so its eager steps are not first run by a
    client)."""
    if mode is CompilationMode.NONE:
        return StepReport.skip(name, StepKind.COMPILE, NOTHING_COMPILES)
    todo = [b for b in buckets if b not in compiled]
    if not todo:
        return StepReport.skip(
            name, StepKind.COMPILE, f"all {len(buckets)} buckets already compiled"
        )
    report = StepReport(name, StepKind.COMPILE)
    gen = torch.Generator().manual_seed(WARMUP_SEED)
    phases = list(Phase)

    def run() -> None:
        for bucket in sorted(
            todo, key=lambda b: (phases.index(b.phase), -b.batch_size, -b.seq_len)
        ):
            run_bucket(bucket, gen)
            compiled.add(bucket)
            report.buckets.append(bucket)
        if after is not None:
            after()
        report.detail = f"{len(todo)} of {len(buckets)} buckets run"
        if artifacts == "loaded":  # the proof: its compile events are what was missing
            report.detail += ", graphs from kept artifacts"

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
    if m.mode is CompilationMode.NONE:
        return StepReport.skip(m.name, StepKind.SAMPLER, NOTHING_COMPILES)
    report = StepReport(m.name, StepKind.SAMPLER)
    gen = torch.Generator().manual_seed(WARMUP_SEED)
    vocab = m.lm.shape.vocab_size

    def run() -> None:
        for path in paths:
            for batch in m.usable_batch_buckets():
                params = [_warm_params(path, row) for row in range(batch)]
                gens = {i: g for i, p in enumerate(params) if (g := request_generator(p, m.device))}
                md = sampling_metadata(list(params), gens, m.device, mode)
                sampler(random_logits(batch, vocab, gen, m.device), md)
            report.sampler_paths.append(path)
        report.detail = f"{len(paths)} paths x batch {list(m.usable_batch_buckets())}"

    return timed(monitor, report, run)
