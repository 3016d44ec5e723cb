"""Adding a kind of model is one module and one registry entry: a kind that exists only in
this test (a hashing "embedder" that answers Embed) is loaded, described, warmed, marked
SERVING and called over gRPC, with no change to the engine, ``wire`` or the servicers."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from inference_api.plan import (
    Bucket,
    CompilationMode,
    ModelKind,
    ModelProfile,
    Phase,
    Step,
    StepKind,
)
from inference_api.stubs.inference.v1 import admin_pb2 as apb
from inference_api.stubs.inference.v1 import inference_pb2 as pb
from inference_svc.engine import generate_runtime
from inference_svc.engine.batcher import Batcher
from inference_svc.engine.inbox import Inbox
from inference_svc.engine.runtime import LoadEnv, ModelKindEntry, RuntimeBase, StepReport
from inference_svc.engine.types import EmbedParams, EmbedResult, RuntimeInfo
from inference_svc.limits import EmbedLimits
from tests.rpc import serving

pytestmark = pytest.mark.rpc
DIMS = 4


@dataclass
class Job:
    params: EmbedParams
    future: Future[EmbedResult] = field(default_factory=Future)


def hash_vector(text: str) -> list[float]:
    digest = hashlib.sha256(text.encode()).digest()
    return [v / 2**32 for v in struct.unpack("<4I", digest[:16])]


class HashRuntime(RuntimeBase):
    """Answers Embed with a hash of each text, batched on the compute thread."""

    kind = ModelKind.EMBEDDING
    rpc = "Embed"

    def __init__(self, env: LoadEnv) -> None:
        inbox: Inbox[Job] = Inbox("hash", 8, env.compute)
        super().__init__("hash", "sha256-embedder", inbox, env.monitor)
        self.mode = env.config.compilation_mode
        self.limits = EmbedLimits(max_batch=8, max_input_tokens=64, dimensions=DIMS)
        self.batches: list[int] = []
        self.batcher = Batcher(inbox, self._run, self._fail, capacity=8)

    def _run(self, jobs: list[Job]) -> None:
        self.batches.append(len(jobs))
        for job in jobs:
            vectors = [hash_vector(t) for t in job.params.inputs]
            job.future.set_result(EmbedResult(vectors, len(job.params.inputs)))

    @staticmethod
    def _fail(job: Job, exc: BaseException) -> None:
        job.future.set_exception(exc)

    async def serve(self, params: EmbedParams) -> AsyncIterator[EmbedResult]:
        import asyncio

        job = Job(params)
        self.inbox.submit(job)
        yield await asyncio.wrap_future(job.future)

    @property
    def kv_cache_tokens(self) -> int:
        return 0

    def buckets(self) -> tuple[Bucket, ...]:
        return (Bucket(Phase.EMBED, 8, 64),)

    def profile(self) -> ModelProfile:
        return ModelProfile(self.name, self.kind, False, False, self.mode, buckets=self.buckets())

    async def warm(self, step: Step) -> StepReport:
        if self.mode is CompilationMode.NONE or step.kind is not StepKind.COMPILE:
            return StepReport.skip(self.name, step.kind, "a hash compiles nothing")
        self._compiled.update(self.buckets())
        return StepReport(self.name, step.kind, buckets=list(self.buckets()), detail="hashed")

    def info(self) -> RuntimeInfo:
        return RuntimeInfo(
            "sha256-embedder", self.kind, DIMS, 64, 8, 0, False, 0, "none", "cpu", self.mode, 0
        )


HASH_KIND = ModelKindEntry(
    "hash", "embed_model", "Embed", lambda spec: Path("."), lambda env, d: HashRuntime(env)
)


async def test_a_kind_that_only_the_tests_know_is_loaded_warmed_and_served() -> None:
    args = ["--port", "0", "--admin-port", "0", "--lm-model", "none"]
    kinds = (HASH_KIND, generate_runtime.KIND)
    async with serving(args, loaded=True, kinds=kinds) as (service, c):
        described = await c.admin.Describe(apb.DescribeRequest())
        assert [m.name for m in described.models] == ["hash"]
        await c.warm_and_serve()
        reply = await c.inference.Embed(pb.EmbedRequest(inputs=["a", "b"], normalize=False))
        got = [list(e.values) for e in reply.embeddings]  # float32 on the wire
        for vector, text in zip(got, ["a", "b"], strict=True):
            assert vector == pytest.approx(hash_vector(text), rel=1e-6)
        assert reply.model == "sha256-embedder"
        assert service.engine.runtimes["hash"].batches == [1]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.inference.Generate(pb.GenerateRequest(prompt="hi"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "start with --lm-model" in err.value.details()


async def test_a_compiled_mode_plans_its_steps_and_marking_requires_them() -> None:
    args = ["--port", "0", "--admin-port", "0", "--lm-model", "none",
            "--compilation-mode", "default"]  # fmt: skip
    async with serving(args, loaded=True, kinds=(HASH_KIND,)) as (_, c):
        described = await c.admin.Describe(apb.DescribeRequest())
        steps = [(s.model, s.step) for s in described.required_steps]
        assert ("hash", apb.WARMUP_STEP_KIND_COMPILE) in steps
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.admin.MarkServing(apb.MarkServingRequest())
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        reports = await c.warm_and_serve()
        assert [r.detail for r in reports if r.step == apb.WARMUP_STEP_KIND_COMPILE] == ["hashed"]
