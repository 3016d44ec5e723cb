"""The generative runtime: Generate requests through the batching worker, and the warmup
of a causal LM (PROFILE sizes its KV cache, COMPILE its prefill and decode buckets,
SAMPLER every sampler path)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from inference_api.plan import (
    Bucket,
    CompilationMode,
    LogprobsMode,
    ModelKind,
    ModelProfile,
    Phase,
    SamplerPath,
    Step,
    StepKind,
    plan,
)
from inference_svc.compile_monitor import CompileMonitor
from inference_svc.engine import warmup
from inference_svc.engine.generation import GenerateWorker, GenJob
from inference_svc.engine.runtime import RuntimeBase, StepReport
from inference_svc.engine.types import GenChunk, GenerateParams, RuntimeInfo
from inference_svc.errors import FailedPrecondition
from inference_svc.limits import GenLimits
from inference_svc.models.generative import GenerativeModel
from inference_svc.sampling import Sampler


@dataclass(frozen=True)
class KvCachePolicy:
    explicit: bool  # the operator gave --kv-cache-tokens: no PROFILE run sizes it
    memory_fraction: float  # share of free memory PROFILE may give the cache


class GenerativeRuntime(RuntimeBase):
    """A causal LM behind its worker thread (implements ModelRuntime)."""

    kind = ModelKind.GENERATIVE

    def __init__(
        self,
        model: GenerativeModel,
        display_name: str,
        logprobs_mode: LogprobsMode,
        kv_cache: KvCachePolicy,
        max_queue: int,
        monitor: CompileMonitor,
    ) -> None:
        self.sampler = Sampler(model.name, model.mode, monitor)
        self.worker: GenerateWorker = GenerateWorker(model, self.sampler, logprobs_mode, max_queue)
        super().__init__(model.name, display_name, self.worker, monitor)
        self.model = model
        self.logprobs_mode = logprobs_mode
        self.kv_cache = kv_cache

    @property
    def limits(self) -> GenLimits:
        return self.model.limits

    @property
    def kv_cache_tokens(self) -> int:
        return self.model.kv_cache_tokens

    def loaded_from_artifacts(self) -> None:
        super().loaded_from_artifacts()
        self.model.mark_dynamic = False  # see GenerativeModel.__init__

    def buckets(self) -> tuple[Bucket, ...]:
        return warmup.generative_buckets(self.model)

    def profile(self) -> ModelProfile:
        return ModelProfile(
            self.name,
            self.kind,
            True,
            self.kv_cache.explicit,
            self.model.mode,
            self.logprobs_mode,
            self.buckets(),
            self.model.numerics,
            self.artifacts,
        )

    async def warm(self, step: Step) -> StepReport:
        run = self._step(step)
        return await asyncio.wrap_future(self.worker.call(run))

    def _step(self, step: Step) -> Callable[[], StepReport]:
        m, mon = self.model, self.monitor
        match step.kind:
            case StepKind.PROFILE:
                fraction = self.kv_cache.memory_fraction
                loaded = self.artifacts == "loaded"
                return lambda: warmup.profile(m, fraction, self._compiled, mon, loaded)
            case StepKind.COMPILE:
                return self._compile
            case StepKind.SAMPLER:
                paths = list(step.sampler_paths or self._planned_paths())
                return lambda: warmup.warm_sampler(m, self.sampler, paths, self.logprobs_mode, mon)
        raise FailedPrecondition(f"{step.kind.name} is not a warmup step of {self.name}")

    def _compile(self) -> StepReport:
        m = self.model
        if not m.cache_rows and m.mode is not CompilationMode.NONE:
            raise FailedPrecondition(
                f"COMPILE {self.name}: the KV cache is not sized yet; run PROFILE first"
            )

        def run_bucket(b: Bucket, gen: torch.Generator) -> object:
            if b.phase is Phase.PREFILL:
                return m.dummy_prefill(b.seq_len, b.context_len, gen)
            return m.dummy_decode(b.batch_size, b.context_len, gen)

        return warmup.compile_buckets(
            self.name, m.mode, self.buckets(), self._compiled, run_bucket, self.monitor,
            artifacts=self.artifacts,
        )  # fmt: skip

    def _planned_paths(self) -> tuple[SamplerPath, ...]:
        for s in plan([self.profile()]).steps:
            if s.kind is StepKind.SAMPLER:
                return s.sampler_paths
        return ()

    async def generate(self, params: GenerateParams) -> AsyncIterator[GenChunk]:
        """The chunks of one request, as its rows decode; the row is freed when the
        caller stops iterating (a cancelled or finished call)."""
        ids = await self.on_text_thread(self.worker.prepare, params)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[GenChunk | BaseException] = asyncio.Queue()
        job = GenJob(ids, params, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        self.worker.submit(job)
        try:
            while True:
                event = await events.get()
                if isinstance(event, BaseException):
                    raise event
                yield event
                if event.finish is not None:
                    return
        finally:
            job.cancelled.set()

    def info(self) -> RuntimeInfo:
        m = self.model
        return RuntimeInfo(
            name=self.display_name,
            kind=self.kind,
            dimensions=m.lm.shape.hidden_size,
            max_input_tokens=m.limits.max_input_tokens,
            max_batch_size=max(m.cache_rows, 0) or m.limits.max_batch,
            max_new_tokens=m.limits.max_new_tokens,
            has_kv_cache=True,
            vocab_size=m.lm.shape.vocab_size,
            dtype=m.numerics,
            device=str(m.device),
            compilation_mode=m.mode,
            late_compile_events=self.monitor.late_by_model[self.name],
        )
