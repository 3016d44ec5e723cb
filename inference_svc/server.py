"""The gRPC servicers: thin. Decode the request (wire), call the engine, encode the reply.

One table (STATUS_OF) maps domain errors to status codes; anything else is a
real fault: INTERNAL, with a log line.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from inference_api.stubs.inference.v1 import admin_pb2_grpc, inference_pb2_grpc
from inference_svc import __version__, wire
from inference_svc.engine.core import Engine
from inference_svc.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    ServiceError,
    Unavailable,
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


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @unary
    async def Embed(self, request: Any, context: Any) -> Any:
        runtime = self.engine.embedder()
        result = await runtime.embed(wire.embed_params(request, runtime.limits))
        return wire.embed_response(result, runtime.display_name)

    @unary
    async def Generate(self, request: Any, context: Any) -> Any:
        runtime = self.engine.generator()
        params = wire.generate_params(request, runtime.limits)
        chunks = [chunk async for chunk in runtime.generate(params)]
        return wire.generate_response(chunks, runtime.display_name)

    async def GenerateStream(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        try:
            runtime = self.engine.generator()
            params = wire.generate_params(request, runtime.limits)
            async for chunk in runtime.generate(params):
                yield wire.generate_chunk(chunk)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_for(context, exc)

    @unary
    async def Info(self, request: Any, context: Any) -> Any:
        return wire.info_response(self.engine, __version__)


class AdminServicer(admin_pb2_grpc.WarmupAdminServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @unary
    async def Describe(self, request: Any, context: Any) -> Any:
        return wire.describe_response(self.engine, __version__)

    @unary
    async def Warmup(self, request: Any, context: Any) -> Any:
        report = await self.engine.warmup(wire.warmup_step(request))
        return wire.warmup_response(report)

    @unary
    async def Reseed(self, request: Any, context: Any) -> Any:
        return wire.reseed_response(self.engine.reseed(wire.reseed_value(request)))

    @unary
    async def MarkServing(self, request: Any, context: Any) -> Any:
        self.engine.mark_serving()
        return wire.mark_serving_response(self.engine.boot_id)
