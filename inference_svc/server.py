"""The gRPC servicers: thin. Decode the request (wire), call the engine, encode the reply.

One table (STATUS_OF) maps domain errors to status codes; anything else is a
real fault: INTERNAL, with a log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from inference_svc import __version__, wire
from inference_svc.engine.core import Engine
from inference_svc.engine.runtime import ModelRuntime
from inference_svc.engine.types import GenChunk, GenerateParams
from inference_svc.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    ServiceError,
    Unavailable,
)
from inference_svc.metrics import Metrics

log = logging.getLogger(__name__)
R = TypeVar("R")

STATUS_OF: dict[type[ServiceError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def code_of(exc: BaseException) -> grpc.StatusCode:
    for kind, code in STATUS_OF.items():
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


async def abort_for(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Answer the call with the status code of ``exc`` (INTERNAL for faults)."""
    code = code_of(exc)
    if code is not grpc.StatusCode.INTERNAL:
        await context.abort(code, str(exc))
    log.exception("internal error", exc_info=exc)
    await context.abort(code, f"internal error: {type(exc).__name__}: {exc}")


class Servicer:
    def __init__(self, engine: Engine, metrics: Metrics) -> None:
        self.engine = engine
        self.metrics = metrics


@contextlib.asynccontextmanager
async def answering(
    metrics: Metrics, rpc: str, context: grpc.aio.ServicerContext
) -> AsyncIterator[None]:
    """Map errors to status codes, and count and time the call under its final code."""
    start, code = time.perf_counter(), "OK"
    metrics.begin_call(rpc)
    try:
        yield
    except asyncio.CancelledError:
        code = "CANCELLED"
        raise
    except grpc.aio.AbortError:  # the call was already answered with its status
        code = context.code().name if context.code() else "UNKNOWN"
        raise
    except Exception as exc:
        code = code_of(exc).name
        await abort_for(context, exc)
    finally:
        metrics.observe_call(rpc, code, time.perf_counter() - start)


def unary(fn: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
    """Decode, answer, map errors to status codes, and count and time the call."""

    @functools.wraps(fn)
    async def wrapper(self: Servicer, request: Any, context: grpc.aio.ServicerContext) -> R:
        async with answering(self.metrics, fn.__name__, context):
            return await fn(self, wire.decoded(request), context)
        raise AssertionError("unreachable: answering() aborts or re-raises")

    return wrapper


class InferenceServicer(Servicer):
    @unary
    async def Embed(self, request: Any, context: Any) -> Any:
        runtime = self.engine.serving("Embed")
        result = await anext(runtime.serve(wire.embed_params(request, runtime.limits)))
        self.metrics.observe_tokens(runtime.name, result.prompt_tokens, 0)
        return wire.embed_response(result, runtime.display_name)

    @unary
    async def Generate(self, request: Any, context: Any) -> Any:
        runtime = self.engine.serving("Generate")
        params = wire.generate_params(request, runtime.limits)
        chunks = [chunk async for chunk in self._timed(runtime, params)]
        return wire.generate_response(chunks, runtime.display_name)

    async def GenerateStream(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        async with answering(self.metrics, "GenerateStream", context):
            runtime = self.engine.serving("Generate")
            params = wire.generate_params(wire.decoded(request), runtime.limits)
            async for chunk in self._timed(runtime, params):
                yield wire.generate_chunk(chunk)

    async def _timed(
        self, runtime: ModelRuntime, params: GenerateParams
    ) -> AsyncIterator[GenChunk]:
        """The runtime's chunks, timed: time to first token, gaps between tokens, tokens."""
        last = time.perf_counter()
        first = True
        async for chunk in runtime.serve(params):
            if chunk.token_ids:
                now = time.perf_counter()
                (self.metrics.ttft if first else self.metrics.itl).observe(now - last)
                first, last = False, now
            if chunk.finish is not None:
                m = self.metrics
                m.observe_tokens(runtime.name, chunk.prompt_tokens, chunk.completion_tokens)
            yield chunk

    @unary
    async def Info(self, request: Any, context: Any) -> Any:
        return wire.info_response(self.engine, __version__)


class AdminServicer(Servicer):
    @unary
    async def Describe(self, request: Any, context: Any) -> Any:
        return wire.describe_response(self.engine, __version__)

    @unary
    async def Warmup(self, request: Any, context: Any) -> Any:
        report = await self.engine.warmup(wire.warmup_step(request))
        return wire.warmup_response(report)

    @unary
    async def Reseed(self, request: Any, context: Any) -> Any:
        seed = self.engine.reseed(wire.reseed_value(request), request.rewarm)
        return wire.reseed_response(seed)

    @unary
    async def MarkServing(self, request: Any, context: Any) -> Any:
        await self.engine.mark_serving(request.rewarm)
        return wire.mark_serving_response(self.engine.boot_id)
