"""The gRPC servicers: thin. Decode the request, call the engine, encode the reply.

One table (STATUS_OF) maps domain errors to status codes; anything else is a
real fault: INTERNAL, with a log line.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from inference_svc import __version__
from inference_svc._pb.inference.v1 import admin_pb2, admin_pb2_grpc, inference_pb2_grpc
from inference_svc._pb.inference.v1 import inference_pb2 as pb
from inference_svc.engine.core import EMBED_NAME, LM_NAME, Engine
from inference_svc.engine.types import EmbedParams, GenChunk, GenerateParams
from inference_svc.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    ServiceError,
    Unavailable,
)
from inference_svc.wire import (
    describe_pb,
    info_pb,
    sampler_path_from_pb,
    step_from_pb,
    warmup_report_pb,
)

log = logging.getLogger(__name__)
R = TypeVar("R")

STATUS_OF: dict[type[ServiceError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


async def abort_for(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Answer the call with the status code of ``exc`` (INTERNAL for faults)."""
    for kind, code in STATUS_OF.items():
        if isinstance(exc, kind):
            await context.abort(code, str(exc))
    log.exception("internal error", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


def unary(fn: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> R:
        try:
            return await fn(self, request, context)
        except Exception as exc:
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await abort_for(context, exc)
            raise AssertionError("unreachable") from exc

    return wrapper


def warm_messages() -> None:
    """Build, serialize and parse each message once: protobuf sets a message class up
    lazily on its first use, and that first use should not be a client's request."""
    samples = [
        pb.EmbedResponse(embeddings=[pb.Embedding(values=[0.5, 1.5])], usage=pb.Usage()),
        pb.GenerateResponse(token_ids=[1], logprobs=[pb.TokenLogprob(top=[pb.TopLogprob()])]),
        pb.GenerateChunk(token_ids=[1], logprobs=[pb.TokenLogprob(top=[pb.TopLogprob()])]),
        pb.EmbedRequest(inputs=["x"], normalize=True),
        pb.GenerateRequest(messages=[pb.ChatMessage()], sampling=pb.SamplingParams(seed=1)),
        pb.InfoResponse(models=[pb.ModelInfo()]),
    ]
    for msg in samples:
        type(msg).FromString(msg.SerializeToString())


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @unary
    async def Embed(self, request: pb.EmbedRequest, context: Any) -> pb.EmbedResponse:
        log.debug("Embed: %d inputs", len(request.inputs))
        result = await self.engine.embed_texts(lambda limit: EmbedParams.from_pb(request, limit))
        return pb.EmbedResponse(
            embeddings=[pb.Embedding(values=v) for v in result.vectors],
            usage=pb.Usage(prompt_tokens=result.prompt_tokens, total_tokens=result.prompt_tokens),
            model=self.engine.display_names.get(EMBED_NAME, ""),
        )

    @unary
    async def Generate(self, request: pb.GenerateRequest, context: Any) -> pb.GenerateResponse:
        log.debug("Generate")
        out = pb.GenerateResponse(model=self.engine.display_names.get(LM_NAME, ""))
        async for chunk in self._chunks(request):
            out.text += chunk.text
            out.token_ids.extend(chunk.token_ids)
            out.logprobs.extend(lp.to_pb() for lp in chunk.logprobs)
            if chunk.finish is not None:
                final = chunk.to_pb()
                out.finish_reason = final.finish_reason
                out.usage.CopyFrom(final.usage)
        return out

    async def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateChunk]:
        log.debug("GenerateStream")
        try:
            async for chunk in self._chunks(request):
                yield chunk.to_pb()
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_for(context, exc)

    def _chunks(self, request: pb.GenerateRequest) -> AsyncIterator[GenChunk]:
        return self.engine.generate(lambda limit: GenerateParams.from_pb(request, limit))

    @unary
    async def Info(self, request: pb.InfoRequest, context: Any) -> pb.InfoResponse:
        return info_pb(self.engine, __version__)


class AdminServicer(admin_pb2_grpc.WarmupAdminServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @unary
    async def Describe(
        self, request: admin_pb2.DescribeRequest, context: Any
    ) -> admin_pb2.DescribeResponse:
        return describe_pb(self.engine)

    @unary
    async def Warmup(
        self, request: admin_pb2.WarmupRequest, context: Any
    ) -> admin_pb2.WarmupResponse:
        kind = step_from_pb(request.step)
        paths = [sampler_path_from_pb(p) for p in request.sampler_paths]
        report = await self.engine.warmup(request.model, kind, paths)
        return warmup_report_pb(report)

    @unary
    async def Reseed(
        self, request: admin_pb2.ReseedRequest, context: Any
    ) -> admin_pb2.ReseedResponse:
        seed = request.seed if request.HasField("seed") else None
        return admin_pb2.ReseedResponse(seed=self.engine.reseed(seed))

    @unary
    async def MarkServing(
        self, request: admin_pb2.MarkServingRequest, context: Any
    ) -> admin_pb2.MarkServingResponse:
        self.engine.mark_serving()
        return admin_pb2.MarkServingResponse(serving=True, boot_id=self.engine.boot_id)
