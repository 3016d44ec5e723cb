"""The warmup steps: PROFILE, COMPILE and SAMPLER, each run on the compute thread.

Each step is idempotent (what already ran is not run again) and reports what it
ran, what it skipped and why, how long it took and the compile events it caused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from inference_api.plan import Bucket, CompilationMode, LogprobsMode, Phase, SamplerPath, StepKind
from inference_svc.compile_monitor import CompileMonitor
from inference_svc.engine.memory import available_bytes, peak_during
from inference_svc.engine.runner import (
    GenerateRunner,
    random_logits,
    request_generator,
    sampling_metadata,
)
from inference_svc.engine.runtime import StepReport, timed
from inference_svc.engine.types import GenerateParams
from inference_svc.errors import ResourceExhausted
from inference_svc.models.aoti import AotiGraph
from inference_svc.sampling import MAX_LOGPROBS, Sampler

log = logging.getLogger(__name__)
WARMUP_SEED = 1234  # the warmup's own generator: the global random state is untouched
NOTHING_COMPILES = "compilation mode NONE: nothing compiles"


def profile(
    runner: GenerateRunner,
    fraction: float,
    compiled: set[Bucket],
    monitor: CompileMonitor,
    loaded: bool = False,
) -> StepReport:
    """Size the KV cache from a profile forward at the largest shapes. ``loaded``: the
    graphs came from kept artifacts, so the measured run is also their first."""
    m = runner.model
    if m.cache_rows:
        report = StepReport.skip(
            m.name, StepKind.PROFILE, f"KV cache already sized: {m.kv_cache_tokens} tokens"
        )
        report.kv_cache_tokens = m.kv_cache_tokens
        return report
    report = StepReport(m.name, StepKind.PROFILE)
    gen = torch.Generator().manual_seed(WARMUP_SEED)

    def run() -> None:
        b = runner.buckets
        m.allocate_cache(b.batch[-1])
        cache_bytes = m.kv_cache_tokens * m.kv_bytes_per_token()
        largest = b.largest()

        def forwards() -> None:
            for bucket in largest:
                runner.run_shape(bucket, gen)

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
        _shrink_cache(runner, budget)
        report.kv_cache_tokens = m.kv_cache_tokens
        report.detail = (
            f"activation peak {peak / 2**20:.0f} MiB at {largest[0]}, {largest[1]}; "
            f"KV cache {m.kv_cache_tokens} tokens ({m.cache_rows} sequences)"
        )

    return timed(monitor, report, run)


def _shrink_cache(runner: GenerateRunner, budget: int) -> None:
    """Reallocate the KV cache to the rows ``budget`` bytes hold (whole batch buckets)."""
    m, b = runner.model, runner.buckets
    seq_len = m.limits.max_seq_len
    fits = max(budget, 0) // (m.kv_bytes_per_token() * seq_len)
    try:
        rows = b.rows_for(min(b.batch[-1], fits) * seq_len)
    except ValueError:
        m.free_cache()
        raise ResourceExhausted(
            f"KV cache: {budget} bytes available hold {fits} sequences of {seq_len} tokens, "
            "fewer than 2; free memory, raise --kv-cache-memory-fraction or lower "
            "--max-new-tokens"
        ) from None
    if rows < m.cache_rows:
        m.allocate_cache(rows)


def edges(buckets: list[Bucket], largest: bool = True) -> list[Bucket]:
    """The smallest and (``largest``) the largest bucket of each phase: every dynamic
    dimension of a package at both ends of its range."""
    out: list[Bucket] = []
    for phase in Phase:
        mine = [b for b in buckets if b.phase is phase]
        if mine:
            size = lambda b: (b.batch_size, b.seq_len, b.context_len)  # noqa: E731
            ends = (max(mine, key=size), min(mine, key=size)) if largest else (min(mine, key=size),)
            out += dict.fromkeys(ends)
    return out


def compile_buckets(
    name: str,
    mode: CompilationMode,
    buckets: tuple[Bucket, ...],
    compiled: set[Bucket],
    run_bucket: Callable[[Bucket, torch.Generator], object],
    monitor: CompileMonitor,
    after: Callable[[], None] | None = None,
    artifacts: str = "",
    graphs: list[AotiGraph] | None = None,
) -> StepReport:
    """A dummy forward at every bucket not compiled yet, largest first; then ``after`` (a
    request through the whole request path, so its eager steps are not first run by a
    client).

    With AOTInductor ``graphs`` nothing compiles per shape: the edges of each package's
    ranges are run (building a package at its first call) and every bucket counts as
    compiled; the smallest is checked against eager (the proof Describe reports). Packages
    loaded from kept artifacts were run at both ends by the start that built them: one call
    each, at the smallest, with its proof (the largest Embed bucket alone cost a restart
    0.9 s of its 4.7 s after listening). A graph that fell back to torch.compile has every
    bucket run as above.
    """
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
    graphs = graphs or []

    def run_all(these: list[Bucket]) -> None:
        for bucket in sorted(
            these, key=lambda b: (phases.index(b.phase), -b.batch_size, -b.seq_len)
        ):
            run_bucket(bucket, gen)
            compiled.add(bucket)
            report.buckets.append(bucket)

    def run() -> None:
        rest = todo
        kept = bool(graphs) and all(g.source == "loaded" for g in graphs)
        if graphs:
            for g in graphs:
                g.check_eager = True
            try:
                run_all(edges(list(buckets), largest=not kept))
            finally:
                for g in graphs:
                    g.check_eager = False
            if all(g.source != "fallback" for g in graphs):
                compiled.update(buckets)
                rest = []
        run_all([b for b in rest if b not in compiled])
        if after is not None:
            after()
        report.detail = f"{len(report.buckets)} of {len(buckets)} buckets run"
        if graphs and not rest:
            ends = "its smallest shapes" if kept else "each range's edges"
            report.detail += f" (AOTInductor packages: {ends}, checked against eager)"
        if artifacts == "loaded":  # the proof: its compile events are what was missing
            report.detail += ", graphs from kept artifacts"

    return timed(monitor, report, run)


def _warm_params(path: SamplerPath, row: int, filters: bool = True) -> GenerateParams:
    random = path is not SamplerPath.GREEDY and not (path is SamplerPath.LOGPROBS and row == 0)
    return GenerateParams(
        prompt="warmup",
        messages=(),
        temperature=0.8 if random else 0.0,
        top_k=40 if row % 2 and filters else 0,
        top_p=0.9 if filters else 1.0,
        seed=WARMUP_SEED + row if path in (SamplerPath.SEEDED, SamplerPath.LOGPROBS) else None,
        logprobs=MAX_LOGPROBS if path is SamplerPath.LOGPROBS else 0,
    )


def warm_sampler(
    runner: GenerateRunner,
    sampler: Sampler,
    paths: list[SamplerPath],
    mode: LogprobsMode,
    monitor: CompileMonitor,
) -> StepReport:
    """Sample from random logits on each path, at every batch bucket."""
    m = runner.model
    if m.mode is CompilationMode.NONE:
        return StepReport.skip(m.name, StepKind.SAMPLER, NOTHING_COMPILES)
    report = StepReport(m.name, StepKind.SAMPLER)
    batches = runner.buckets.sampler_batches
    gen = torch.Generator().manual_seed(WARMUP_SEED)
    vocab = m.lm.shape.vocab_size

    def run() -> None:
        for path in paths:
            # A batch that limits top-k/top-p sorts the vocabulary; one that does not only
            # scales it: two graphs on every path that samples.
            for filters in (True, False) if path is not SamplerPath.GREEDY else (True,):
                for batch in batches:
                    params = [_warm_params(path, row, filters) for row in range(batch)]
                    gens = {
                        i: g for i, p in enumerate(params) if (g := request_generator(p, m.device))
                    }
                    md = sampling_metadata(list(params), gens, m.device, mode)
                    sampler(random_logits(batch, vocab, gen, m.device), md)
            report.sampler_paths.append(path)
        report.detail = f"{len(paths)} paths (with and without top-k/top-p) x batch {list(batches)}"

    return timed(monitor, report, run)
