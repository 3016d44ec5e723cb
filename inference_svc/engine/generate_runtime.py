"""The generative runtime: Generate requests through the continuous-batching loop
(scheduler, runner, output stage), and the warmup of a causal LM (PROFILE sizes its KV
cache, COMPILE its prefill and decode buckets, SAMPLER every sampler path)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from inference_api.plan import (
    Bucket,
    CompilationMode,
    LogprobsMode,
    ModelKind,
    ModelProfile,
    SamplerPath,
    Step,
    StepKind,
    plan,
)
from inference_svc.compile_monitor import CompileMonitor
from inference_svc.engine import warmup
from inference_svc.engine.buckets import GenBuckets
from inference_svc.engine.compute import ComputeThread
from inference_svc.engine.generate_loop import GenerateLoop
from inference_svc.engine.inbox import Inbox
from inference_svc.engine.output import OutputStage
from inference_svc.engine.pacing import STALL, ChunkPacer
from inference_svc.engine.runner import GenerateRunner
from inference_svc.engine.runtime import (
    LoadEnv,
    ModelKindEntry,
    RuntimeBase,
    StepReport,
)
from inference_svc.engine.scheduler import Scheduler, Sequence
from inference_svc.engine.types import GenChunk, GenerateParams, RuntimeInfo
from inference_svc.errors import FailedPrecondition, InvalidArgument
from inference_svc.limits import GenLimits
from inference_svc.models.generative import GenerativeModel, load_generative
from inference_svc.models.loading import display_name, resolve_lm_dir
from inference_svc.sampling import Sampler


@dataclass(frozen=True)
class KvCachePolicy:
    tokens: int | None  # --kv-cache-tokens: the operator's size; None: PROFILE sizes it
    memory_fraction: float  # share of free memory PROFILE may give the cache

    @property
    def explicit(self) -> bool:
        return self.tokens is not None


class GenerativeRuntime(RuntimeBase):
    """A causal LM behind its scheduler, runner and output stage (implements ModelRuntime)."""

    kind = ModelKind.GENERATIVE
    rpc = "Generate"

    def __init__(
        self,
        model: GenerativeModel,
        display_name: str,
        logprobs_mode: LogprobsMode,
        kv_cache: KvCachePolicy,
        max_queue: int,
        monitor: CompileMonitor,
        compute: ComputeThread,
        stall_steps: float = STALL,
    ) -> None:
        inbox: Inbox[Sequence] = Inbox(model.name, max_queue, compute)
        super().__init__(model.name, display_name, inbox, monitor)
        # With AOTInductor packages the sampler runs eagerly: torch.compile made it no
        # faster (the same cost within 7 % at batch 2 to 16, every path, on AMX), and
        # without it no Dynamo runs at all: nothing can compile after SERVING.
        aoti = bool(model.graphs)
        self.sampler = Sampler(model.name, CompilationMode.NONE if aoti else model.mode, monitor)
        buckets = GenBuckets.plan(model.limits, model.mode, aoti=aoti)
        model.set_ranges(buckets.ranges())
        if kv_cache.tokens is not None:
            model.allocate_cache(buckets.rows_for(kv_cache.tokens))
        self.runner = GenerateRunner(model, self.sampler, logprobs_mode, buckets)
        self.scheduler = Scheduler(model.limits.prefill_chunk, model.eos_ids)
        output = OutputStage(self._text, model.detokenize, model.token_text)
        pacer = ChunkPacer(buckets.chunk, stall_steps) if stall_steps > 0 else None
        self.loop = GenerateLoop(inbox, self.scheduler, self.runner, output, pacer)
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
        return self.runner.buckets.all()

    def profile(self) -> ModelProfile:
        backend, proof = self.backend(self.model.mode)
        return ModelProfile(
            self.name, self.kind, True, self.kv_cache.explicit, self.model.mode,
            self.logprobs_mode, self.buckets(), self.model.numerics, self.artifacts,
            backend, proof,
        )  # fmt: skip

    async def warm(self, step: Step) -> StepReport:
        run = self._step(step)
        return await asyncio.wrap_future(self.inbox.call(run))

    def _step(self, step: Step) -> Callable[[], StepReport]:
        r, mon = self.runner, self.monitor
        match step.kind:
            case StepKind.PROFILE:
                fraction = self.kv_cache.memory_fraction
                loaded = self.artifacts == "loaded"
                return lambda: warmup.profile(r, fraction, self._compiled, mon, loaded)
            case StepKind.COMPILE:
                return self._compile
            case StepKind.SAMPLER:
                paths = list(step.sampler_paths or self._planned_paths())
                return lambda: warmup.warm_sampler(r, self.sampler, paths, self.logprobs_mode, mon)
        raise FailedPrecondition(f"{step.kind.name} is not a warmup step of {self.name}")

    def _compile(self) -> StepReport:
        m = self.model
        if not m.cache_rows and m.mode is not CompilationMode.NONE:
            raise FailedPrecondition(
                f"COMPILE {self.name}: the KV cache is not sized yet; run PROFILE first"
            )
        return warmup.compile_buckets(
            self.name, m.mode, self.buckets(), self._compiled, self.runner.run_shape, self.monitor,
            artifacts=self.artifacts, graphs=m.graphs,
        )  # fmt: skip

    def _planned_paths(self) -> tuple[SamplerPath, ...]:
        for s in plan([self.profile()]).steps:
            if s.kind is StepKind.SAMPLER:
                return s.sampler_paths
        return ()

    def serve(self, params: GenerateParams) -> AsyncIterator[GenChunk]:
        return self.generate(params)

    async def generate(self, params: GenerateParams) -> AsyncIterator[GenChunk]:
        """The chunks of one request, as its rows decode; the row is freed when the
        caller stops iterating (a cancelled or finished call)."""
        ids = await self.on_text_thread(self._prepare, params)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[GenChunk | BaseException] = asyncio.Queue()
        job = Sequence(ids, params, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        self.inbox.submit(job)
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

    def _prepare(self, params: GenerateParams) -> list[int]:
        """Tokenize the prompt and check its length; raises InvalidArgument."""
        m = self.model
        messages = [{"role": r, "content": c} for r, c in params.messages]
        ids = m.encode(params.prompt, messages)
        if not ids:
            raise InvalidArgument("prompt: no tokens after tokenization")
        if len(ids) > m.limits.max_input_tokens:
            raise InvalidArgument(
                f"prompt: {len(ids)} tokens; the limit is {m.limits.max_input_tokens} "
                "(--max-input-tokens)"
            )
        return ids

    def info(self) -> RuntimeInfo:
        m, shape = self.model, self.model.lm.shape
        return self._info(
            m, dimensions=shape.hidden_size, max_input_tokens=m.limits.max_input_tokens,
            max_batch_size=max(m.cache_rows, 0) or m.limits.max_batch,
            max_new_tokens=m.limits.max_new_tokens, has_kv_cache=True,
            vocab_size=shape.vocab_size,
        )  # fmt: skip


def load(env: LoadEnv, directory: Path) -> GenerativeRuntime:
    c = env.config
    limits = GenLimits(
        c.gen_max_batch, c.max_input_tokens, c.max_new_tokens, c.prefill_chunk_tokens
    )
    cache = Path(c.model_cache_dir).expanduser() if c.model_cache_dir else None
    model = load_generative(
        env.context(NAME), directory, limits, cache, c.lm_weights, env.lm_weights_auto,
        c.decode_attention, c.linear_kernel, c.kv_cache_dtype,
    )  # fmt: skip
    model.warm_text()
    policy = KvCachePolicy(c.kv_cache_tokens, c.kv_cache_memory_fraction)
    return GenerativeRuntime(
        model, display_name(c.lm_model, directory), c.logprobs_mode, policy, c.max_queue,
        env.monitor, env.compute, c.prefill_stall_steps,
    )  # fmt: skip


NAME = "generative"
KIND = ModelKindEntry(NAME, "lm_model", "Generate", resolve_lm_dir, load)
