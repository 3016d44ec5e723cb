"""The embedding runtime: Embed requests tokenized, batched into padded buckets, pooled;
and the warmup of an embedding model (COMPILE only: it has no KV cache and no sampler)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch.nn.functional as F

from inference_api.plan import Bucket, ModelKind, ModelProfile, Step, StepKind
from inference_svc.compile_monitor import CompileMonitor
from inference_svc.engine import warmup
from inference_svc.engine.batcher import Batcher
from inference_svc.engine.buckets import EmbedBuckets
from inference_svc.engine.compute import ComputeThread
from inference_svc.engine.inbox import Inbox
from inference_svc.engine.runtime import (
    LoadEnv,
    ModelKindEntry,
    RuntimeBase,
    StepReport,
)
from inference_svc.engine.types import EmbedParams, EmbedResult, RuntimeInfo
from inference_svc.errors import InvalidArgument
from inference_svc.limits import EmbedLimits
from inference_svc.models.embedding import EmbeddingModel, load_embedding
from inference_svc.models.loading import display_name, resolve_embed_dir

WARM_PARAMS = EmbedParams(("warm up the request path",), True, False, 0)


@dataclass
class EmbedJob:
    ids: list[list[int]]
    params: EmbedParams
    skip: int = 0  # each row's first tokens left out of the pooling (an excluded prompt)
    future: Future[EmbedResult] = field(default_factory=Future)


def prepare(m: EmbeddingModel, params: EmbedParams) -> EmbedJob:
    """Tokenize (the prompt the request names, or the model's default, put before each
    input as sentence-transformers does) and check the limits; raises InvalidArgument."""
    prompt = m.st.prompt(params.prompt_name)
    texts = [prompt + text for text in params.inputs]
    ids = m.tokenize(texts)
    for i, row in enumerate(ids):
        if len(row) <= m.max_input_tokens:
            continue
        if not params.truncate:
            counted = f" with the prompt {m.st.prompt_name(params.prompt_name)!r}" if prompt else ""
            raise InvalidArgument(
                f"inputs[{i}]: {len(row)} tokens{counted}; the limit is {m.max_input_tokens} "
                "(set truncate=true to cut longer inputs)"
            )
        ids[i] = m.tokenize([texts[i]], truncate=True)[0]
    return EmbedJob(ids, params, m.prompt_skip.get(prompt, 0))


def run_batch(m: EmbeddingModel, buckets: EmbedBuckets, jobs: list[EmbedJob]) -> None:
    """Pad the jobs' rows to a bucket, run the model, answer each job with its vectors."""
    # A job whose caller gave up (cancelled, deadline) is dropped here; the others are
    # marked running, so no later cancel can race with their result.
    jobs = [job for job in jobs if job.future.set_running_or_notify_cancel()]
    if not jobs:
        return
    rows = [r for job in jobs for r in job.ids]
    skips = [job.skip for job in jobs for _ in job.ids]
    shape = buckets.shape(len(rows), max(len(r) for r in rows))
    ids, mask, pooled = m.batch(rows, skips, shape.batch_size, shape.seq_len)
    vectors = m.forward(ids, mask, pooled=pooled)
    start = 0
    for job in jobs:
        vecs = vectors[start : start + len(job.ids)]
        start += len(job.ids)
        if job.params.dimensions:
            vecs = vecs[:, : job.params.dimensions]
        # The model's own Normalize (modules.json) left whole vectors at unit length.
        if job.params.normalize and (job.params.dimensions or not m.st.normalize):
            vecs = F.normalize(vecs, p=2, dim=-1)
        tokens = sum(len(r) for r in job.ids)
        job.future.set_result(EmbedResult(vecs.tolist(), tokens))


def fail(job: EmbedJob, exc: BaseException) -> None:
    if not job.future.done():
        job.future.set_exception(exc)


class EmbeddingRuntime(RuntimeBase):
    """An embedding model behind its batcher (implements ModelRuntime)."""

    kind = ModelKind.EMBEDDING
    rpc = "Embed"

    def __init__(
        self,
        model: EmbeddingModel,
        display_name: str,
        max_queue: int,
        monitor: CompileMonitor,
        compute: ComputeThread,
        max_batch: int,
        batch_wait_s: float = 0.0,
    ) -> None:
        inbox: Inbox[EmbedJob] = Inbox(model.name, max_queue, compute)
        super().__init__(model.name, display_name, inbox, monitor)
        self.model = model
        self.shapes = EmbedBuckets.plan(
            max_batch, model.max_input_tokens, model.mode, aoti=bool(model.graphs)
        )
        for graph in model.graphs:
            graph.ranges = self.shapes.ranges()
        self._run = functools.partial(run_batch, model, self.shapes)
        self.batcher = Batcher(
            inbox, self._run, fail,
            capacity=max_batch, rows_of=lambda job: len(job.ids), batch_wait_s=batch_wait_s,
        )  # fmt: skip
        self.limits = EmbedLimits(
            max_batch, model.max_input_tokens, model.dimensions, tuple(sorted(model.st.prompts))
        )

    @property
    def kv_cache_tokens(self) -> int:
        return 0

    def buckets(self) -> tuple[Bucket, ...]:
        return self.shapes.all()

    async def touch(self) -> None:
        """A request's whole path: tokenized on the text thread, run on the compute thread."""
        job = await self.on_text_thread(self._prepare, WARM_PARAMS)
        await asyncio.wrap_future(self.inbox.call(lambda: self._run([job])))
        job.future.result()

    def _prepare(self, params: EmbedParams) -> EmbedJob:
        return prepare(self.model, params)

    def _warm_request(self) -> None:
        """One request through the whole path (tokenize, batch, forward, normalise),
        run on this thread by the warmup: nothing of it is left for a client to run first."""
        job = prepare(self.model, WARM_PARAMS)
        self._run([job])
        job.future.result()

    def profile(self) -> ModelProfile:
        m = self.model
        backend, proof = self.backend(m.mode)
        return ModelProfile(
            self.name, self.kind, False, False, m.mode, buckets=self.buckets(),
            numerics=m.numerics, artifacts=self.artifacts, backend=backend, proof=proof,
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
                after=self._warm_request,
                artifacts=self.artifacts,
                graphs=m.graphs,
            )

        return await asyncio.wrap_future(self.inbox.call(compile_all))

    async def serve(self, params: EmbedParams) -> AsyncIterator[EmbedResult]:
        yield await self.embed(params)

    async def embed(self, params: EmbedParams) -> EmbedResult:
        job = await self.on_text_thread(self._prepare, params)
        self.inbox.submit(job)
        return await asyncio.wrap_future(job.future)

    def info(self) -> RuntimeInfo:
        m = self.model
        return self._info(
            m, dimensions=m.dimensions, max_input_tokens=m.max_input_tokens,
            max_batch_size=self.limits.max_batch, max_new_tokens=0, has_kv_cache=False,
            vocab_size=m.vocab_size, prompt_names=tuple(sorted(m.st.prompts)),
            default_prompt_name=m.st.default_prompt_name or "",
        )  # fmt: skip


def load(env: LoadEnv, directory: Path) -> EmbeddingRuntime:
    c = env.config
    model = load_embedding(env.context(NAME, c.embed_dtype), directory, env.embed_dtype_auto)
    model.warm_text()
    return EmbeddingRuntime(
        model, display_name(c.embed_model, directory), c.max_queue, env.monitor, env.compute,
        c.embed_max_batch, batch_wait_s=c.embed_batch_wait_ms / 1000,
    )  # fmt: skip


NAME = "embedding"
KIND = ModelKindEntry(NAME, "embed_model", "Embed", resolve_embed_dir, load)
