"""The embedding runtime: Embed requests tokenized, batched into padded buckets, pooled;
and the warmup of an embedding model (COMPILE only: it has no KV cache and no sampler)."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from inference_api.plan import Bucket, ModelKind, ModelProfile, Step, StepKind
from inference_svc.compile_monitor import CompileMonitor
from inference_svc.engine import warmup
from inference_svc.engine.runtime import RuntimeBase, StepReport
from inference_svc.engine.types import EmbedParams, EmbedResult, RuntimeInfo
from inference_svc.engine.worker import ModelWorker
from inference_svc.errors import InvalidArgument
from inference_svc.limits import EmbedLimits
from inference_svc.models.compile import bucket_for
from inference_svc.models.embedding import EmbeddingModel

WARM_PARAMS = EmbedParams(("warm up the request path",), True, False, 0)


@dataclass
class EmbedJob:
    ids: list[list[int]]
    params: EmbedParams
    future: Future[EmbedResult] = field(default_factory=Future)


class EmbedWorker(ModelWorker[EmbedJob]):
    def __init__(self, model: EmbeddingModel, max_queue: int, batch_wait_s: float = 0.0) -> None:
        self.model = model
        super().__init__(model.name, max_queue, batch_wait_s)

    def prepare(self, params: EmbedParams) -> EmbedJob:
        """Tokenize and check the limits; raises InvalidArgument."""
        m = self.model
        ids = m.tokenize(list(params.inputs))
        for i, row in enumerate(ids):
            if len(row) <= m.max_input_tokens:
                continue
            if not params.truncate:
                raise InvalidArgument(
                    f"inputs[{i}]: {len(row)} tokens; the limit is {m.max_input_tokens} "
                    "(set truncate=true to cut longer inputs)"
                )
            ids[i] = m.truncate(row)
        return EmbedJob(ids, params)

    def warm_request(self) -> None:
        """One request through the whole path (tokenize, batch, forward, normalise),
        run on this thread by the warmup: nothing of it is left for a client to run first."""
        job = self.prepare(WARM_PARAMS)
        self.run_batch([job])
        job.future.result()

    def batch_size_of(self, job: EmbedJob) -> int:
        return len(job.ids)

    def capacity(self) -> int:
        return self.model.max_batch

    def fail(self, job: EmbedJob, exc: BaseException) -> None:
        if not job.future.done():
            job.future.set_exception(exc)

    def run_batch(self, jobs: list[EmbedJob]) -> None:
        # A job whose caller gave up (cancelled, deadline) is dropped here; the others are
        # marked running, so no later cancel can race with their result.
        jobs = [job for job in jobs if job.future.set_running_or_notify_cancel()]
        if not jobs:
            return
        m = self.model
        rows = [r for job in jobs for r in job.ids]
        batch = bucket_for(len(rows), m.batch_buckets)
        length = bucket_for(max(2, *(len(r) for r in rows)), m.length_buckets)
        ids = torch.full((batch, length), m.pad_id, dtype=torch.long)
        mask = torch.zeros(batch, length, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        mask[len(rows) :, 0] = 1  # pad rows: one visible token, never read back
        pooled = m.forward(ids, mask)
        start = 0
        for job in jobs:
            vecs = pooled[start : start + len(job.ids)]
            start += len(job.ids)
            if job.params.dimensions:
                vecs = vecs[:, : job.params.dimensions]
            if job.params.normalize:
                vecs = F.normalize(vecs, p=2, dim=-1)
            tokens = sum(len(r) for r in job.ids)
            job.future.set_result(EmbedResult(vecs.tolist(), tokens))


class EmbeddingRuntime(RuntimeBase):
    """An embedding model behind its worker thread (implements ModelRuntime)."""

    kind = ModelKind.EMBEDDING

    def __init__(
        self,
        model: EmbeddingModel,
        display_name: str,
        max_queue: int,
        monitor: CompileMonitor,
        batch_wait_s: float = 0.0,
    ) -> None:
        self.worker: EmbedWorker = EmbedWorker(model, max_queue, batch_wait_s)
        super().__init__(model.name, display_name, self.worker, monitor)
        self.model = model
        self.limits = EmbedLimits(model.max_batch, model.max_input_tokens, model.dimensions)

    @property
    def kv_cache_tokens(self) -> int:
        return 0

    def buckets(self) -> tuple[Bucket, ...]:
        return warmup.embed_buckets(self.model)

    async def touch(self) -> None:
        """A request's whole path: tokenized on the text thread, run on the compute thread."""
        job = await self.on_text_thread(self.worker.prepare, WARM_PARAMS)
        await asyncio.wrap_future(self.worker.call(lambda: self.worker.run_batch([job])))
        job.future.result()

    def profile(self) -> ModelProfile:
        m = self.model
        return ModelProfile(
            self.name, self.kind, False, False, m.mode, buckets=self.buckets(),
            numerics=m.numerics, artifacts=self.artifacts,
        )  # fmt: skip

    async def warm(self, step: Step) -> StepReport:
        if step.kind is not StepKind.COMPILE:
            why = "no KV cache" if step.kind is StepKind.PROFILE else "no sampler"
            return StepReport.skip(self.name, step.kind, f"embedding model: {why}: nothing to warm")
        m = self.model

        def compile_all() -> StepReport:
            return warmup.compile_buckets(
                self.name,
                m.mode,
                self.buckets(),
                self._compiled,
                lambda b, gen: m.dummy_run(b.batch_size, b.seq_len, gen),
                self.monitor,
                after=self.worker.warm_request,
                artifacts=self.artifacts,
            )

        return await asyncio.wrap_future(self.worker.call(compile_all))

    async def embed(self, params: EmbedParams) -> EmbedResult:
        job = await self.on_text_thread(self.worker.prepare, params)
        self.worker.submit(job)
        return await asyncio.wrap_future(job.future)

    def info(self) -> RuntimeInfo:
        m = self.model
        return RuntimeInfo(
            name=self.display_name,
            kind=self.kind,
            dimensions=m.dimensions,
            max_input_tokens=m.max_input_tokens,
            max_batch_size=m.max_batch,
            max_new_tokens=0,
            has_kv_cache=False,
            vocab_size=m.vocab_size,
            dtype=m.numerics,
            device=str(m.device),
            compilation_mode=m.mode,
            late_compile_events=self.monitor.late_by_model[self.name],
        )
