"""A stream cut by a proxy ends UNAVAILABLE, as one cut by its replica does.

A GenerateStream open on a replica that dies (killed, out of memory, its node gone) ends
differently depending on what stood between the client and the replica:

- nothing (client-side balancing): the client sees the connection close and gRPC ends the
  call ``UNAVAILABLE`` ("Socket closed", "Connection reset by peer");
- an L7 proxy such as Envoy: the proxy had already sent the response headers, so it cannot
  answer with a status of its own; it resets the client's HTTP/2 stream (RST_STREAM), and gRPC
  maps every reset but REFUSED_STREAM to ``INTERNAL`` ("Received RST_STREAM with error code
  2"; gRPC's PROTOCOL-HTTP2.md, "Errors").

``INTERNAL`` says "a bug in the service", which is not what happened: the replica went away.
The interceptors here give such a call ``UNAVAILABLE`` with details that say what happened
and keep gRPC's own message after it. A status the server itself sent (a real ``INTERNAL``,
with the service's own details) is left as it is. Nothing is retried: a stream that had begun
may have delivered half its tokens, and inference_api.channel never retries Generate.

    channel = intercept(grpc.insecure_channel(target, options=channel_options()))
    channel = grpc.aio.insecure_channel(target, options=..., interceptors=aio_interceptors())
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc
import grpc.aio

# The message gRPC core gives a call whose HTTP/2 stream the peer reset.
RESET_DETAILS = "Received RST_STREAM with error code"
CUT_DETAILS = "the stream was reset by a proxy between client and service (its replica went away)"


def is_proxy_reset(code: grpc.StatusCode | None, details: str | None) -> bool:
    """A status gRPC made up for a stream the peer reset, not one the service sent."""
    return code == grpc.StatusCode.INTERNAL and RESET_DETAILS in (details or "")


def cut_details(details: str | None) -> str:
    return f"{CUT_DETAILS}: {details}"


def seen(code: grpc.StatusCode, details: str) -> tuple[grpc.StatusCode, str]:
    """A call's (code, details) as a client of the service sees them: a proxy's reset as
    UNAVAILABLE, anything else as it is."""
    if is_proxy_reset(code, details):
        return grpc.StatusCode.UNAVAILABLE, cut_details(details)
    return code, details


# --- grpc.aio ----------------------------------------------------------------------------


def _aio_error(err: grpc.aio.AioRpcError) -> grpc.aio.AioRpcError:
    code, details = seen(err.code(), err.details())
    if code == err.code():  # not a proxy's reset: the error as it came
        return err
    return grpc.aio.AioRpcError(
        code,
        err.initial_metadata(),
        err.trailing_metadata(),
        details=details,
        debug_error_string=err.debug_error_string(),
    )


class _AioStream(grpc.aio.UnaryStreamCall):
    """The call a stub returns, its status and its iteration seen through ``_aio_error``."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self._call = call

    def cancel(self) -> bool:
        return self._call.cancel()

    def cancelled(self) -> bool:
        return self._call.cancelled()

    def done(self) -> bool:
        return self._call.done()

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        self._call.add_done_callback(lambda _: callback(self))

    def time_remaining(self) -> float | None:
        return self._call.time_remaining()

    async def initial_metadata(self) -> Any:
        return await self._call.initial_metadata()

    async def trailing_metadata(self) -> Any:
        return await self._call.trailing_metadata()

    async def code(self) -> grpc.StatusCode:
        return seen(await self._call.code(), await self._call.details())[0]

    async def details(self) -> str:
        return seen(await self._call.code(), await self._call.details())[1]

    async def debug_error_string(self) -> str:
        return await self._call.debug_error_string()

    async def wait_for_connection(self) -> None:
        await self._call.wait_for_connection()

    async def read(self) -> Any:
        try:
            return await self._call.read()
        except grpc.aio.AioRpcError as err:
            raise _aio_error(err) from None

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[Any]:
        try:
            async for response in self._call:
                yield response
        except grpc.aio.AioRpcError as err:
            raise _aio_error(err) from None


class AioResetAsUnavailable(grpc.aio.UnaryStreamClientInterceptor):
    """For ``grpc.aio`` channels: server streams cut by a proxy end UNAVAILABLE."""

    async def intercept_unary_stream(
        self, continuation: Callable[..., Any], client_call_details: Any, request: Any
    ) -> grpc.aio.UnaryStreamCall:
        return _AioStream(await continuation(client_call_details, request))


def aio_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """The interceptors a ``grpc.aio`` client of the service gives its channel."""
    return [AioResetAsUnavailable()]


# --- synchronous grpc ---------------------------------------------------------------------


class _SyncStream(grpc.RpcError, grpc.Call):
    """A synchronous stream (the stub's response iterator and Call), its status seen through
    ``seen``. Like grpc's own call object, it is also the error its iteration raises: grpc
    raises the call itself when a stream fails, and a proxy's reset is raised as this
    wrapper, whose code() and details() say UNAVAILABLE."""

    def __init__(self, call: Any) -> None:
        super().__init__()
        self._call = call

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._call)
        except grpc.RpcError as err:
            if is_proxy_reset(err.code(), err.details()):
                raise self from None
            raise

    def __str__(self) -> str:
        return f"<stream ended {self.code()}: {self.details()}>"

    def code(self) -> grpc.StatusCode:
        return seen(self._call.code(), self._call.details())[0]

    def details(self) -> str:
        return seen(self._call.code(), self._call.details())[1]

    def initial_metadata(self) -> Any:
        return self._call.initial_metadata()

    def trailing_metadata(self) -> Any:
        return self._call.trailing_metadata()

    def is_active(self) -> bool:
        return self._call.is_active()

    def time_remaining(self) -> float | None:
        return self._call.time_remaining()

    def cancel(self) -> bool:
        return self._call.cancel()

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return self._call.add_callback(callback)

    def __getattr__(self, name: str) -> Any:  # the rest of a rendezvous: result(), done()...
        return getattr(self._call, name)


class ResetAsUnavailable(grpc.UnaryStreamClientInterceptor):
    """For synchronous channels: server streams cut by a proxy end UNAVAILABLE."""

    def intercept_unary_stream(
        self, continuation: Callable[..., Any], client_call_details: Any, request: Any
    ) -> Any:
        return _SyncStream(continuation(client_call_details, request))


def intercept(channel: grpc.Channel) -> grpc.Channel:
    """``channel`` with the interceptors a synchronous client of the service uses."""
    return grpc.intercept_channel(channel, ResetAsUnavailable())
