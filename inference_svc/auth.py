"""The admin port's shared token: when one is set, every admin call must carry it.

The token is compared in constant time; a call without it, or with another, is answered
UNAUTHENTICATED before any admin method runs. Loopback binding stays the first fence;
the token is the second, for pods where other processes share the network namespace.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from inference_api.names import ADMIN_TOKEN_METADATA

log = logging.getLogger(__name__)


async def _deny(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(
        grpc.StatusCode.UNAUTHENTICATED,
        f"admin calls need the shared token: metadata '{ADMIN_TOKEN_METADATA}: Bearer <token>'",
    )


class AdminTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()
        self._deny = grpc.unary_unary_rpc_method_handler(_deny)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        given = dict(details.invocation_metadata or ()).get(ADMIN_TOKEN_METADATA, "")
        if hmac.compare_digest(str(given).encode(), self._expected):
            return await continuation(details)
        log.warning("admin call %s refused: no valid token", details.method)
        return self._deny
