"""The WarmupAdmin client, with the sidecar's retry policies (tenacity).

Three policies, all exponential backoff from Config.backoff_initial up to Config.backoff_max,
each retry logged with its cause and wait:
  - waiting for the service: Describe until it answers with models_loaded, bounded by
    Config.connect_timeout seconds;
  - a Warmup step: Config.retries retries, each attempt with Config.step_timeout as deadline;
  - Reseed and MarkServing: Config.retries retries of transient errors only.
Giving up raises WarmupFailed with a reason meant for the log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    stop_before_delay,
    wait_exponential,
)

from inference_api.names import ADMIN_TOKEN_METADATA
from inference_api.stubs.inference.v1 import admin_pb2, admin_pb2_grpc
from warmup_ctl.config import Config

log = logging.getLogger("warmup_ctl")

# Codes worth another try: the service is (re)starting, or a call ran out of time.
TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# Codes that say the request itself is wrong: the same request fails the same way.
NEVER_RETRIED = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
    }
)


# While the service answers "models still loading", Describe is cheap: poll it often, so the
# warmup starts within a fraction of a second of the load (mode NONE costs only the load).
LOADING_POLL_S = 0.25
# ...and log that wait once every this many polls (10 s).
LOADING_LOG_EVERY = 40


class WarmupFailed(Exception):
    """Warmup cannot go on; str() is the reason, worded for the operator."""


class ModelsLoading(Exception):
    """Describe answered, with models_loaded=false."""


def rpc_error(e: BaseException) -> str:
    """'CODE: details' for an RPC error, the message for anything else."""
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details() or 'no details'}"
    return str(e) or type(e).__name__


def _is_code(codes: Collection[grpc.StatusCode], member: bool) -> Callable[[BaseException], bool]:
    def check(e: BaseException) -> bool:
        return isinstance(e, grpc.aio.AioRpcError) and (e.code() in codes) is member

    return check


def _log_retry(what: str, limit: str) -> Callable[[RetryCallState], None]:
    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        wait = state.next_action.sleep if state.next_action else 0.0
        if isinstance(exc, ModelsLoading) and state.attempt_number % LOADING_LOG_EVERY != 1:
            return
        # Models loading is expected at start; anything else is worth a warning.
        level = logging.INFO if isinstance(exc, ModelsLoading) else logging.WARNING
        log.log(
            level,
            "%s: %s; retry %d%s in %.1f s",
            what,
            rpc_error(exc) if exc else "no answer",
            state.attempt_number,
            limit,
            wait,
        )

    return before_sleep


class AdminClient:
    """One channel to the admin port; each method applies its retry policy."""

    def __init__(self, cfg: Config) -> None:
        self._cfg = cfg
        # Keep the channel's own reconnect backoff as short as ours, so that a service that
        # comes back is seen within backoff_max seconds, not grpc's default of two minutes.
        options = [
            ("grpc.initial_reconnect_backoff_ms", int(cfg.backoff_initial * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(cfg.backoff_max * 1000)),
        ]
        self._channel = grpc.aio.insecure_channel(cfg.admin, options=options)
        self._stub = admin_pb2_grpc.WarmupAdminStub(self._channel)
        # The service's admin token, on every call (none when the service needs none).
        token = cfg.admin_token
        self._metadata = ((ADMIN_TOKEN_METADATA, f"Bearer {token}"),) if token else ()

    async def close(self) -> None:
        await self._channel.close()

    def _wait(self) -> wait_exponential:
        return wait_exponential(multiplier=self._cfg.backoff_initial, max=self._cfg.backoff_max)

    def _wait_ready(self) -> Callable[[RetryCallState], float]:
        """Short fixed polls while the models load; exponential backoff otherwise."""
        backoff = self._wait()

        def wait(state: RetryCallState) -> float:
            exc = state.outcome.exception() if state.outcome else None
            return LOADING_POLL_S if isinstance(exc, ModelsLoading) else backoff(state)

        return wait

    async def describe(self) -> admin_pb2.DescribeResponse:
        """One Describe call, no retry (the watch loop polls with it)."""
        return await self._stub.Describe(
            admin_pb2.DescribeRequest(), timeout=self._cfg.rpc_timeout, metadata=self._metadata
        )

    async def wait_ready(self) -> admin_pb2.DescribeResponse:
        """Describe, retried until the admin port answers and the models are loaded."""
        cfg = self._cfg
        retrying = AsyncRetrying(
            stop=stop_before_delay(cfg.connect_timeout),
            wait=self._wait_ready(),
            retry=retry_if_exception(
                lambda e: isinstance(e, ModelsLoading) or _is_code(TRANSIENT, True)(e)
            ),
            before_sleep=_log_retry(f"waiting for the service at {cfg.admin}", ""),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    resp = await self.describe()
                    if not resp.models_loaded:
                        raise ModelsLoading(f"models still loading (boot {resp.boot_id})")
        except (ModelsLoading, grpc.aio.AioRpcError) as e:
            raise WarmupFailed(
                f"the service at {cfg.admin} was not ready within {cfg.connect_timeout:g} s "
                f"({rpc_error(e)}); raise --connect-timeout if model loading takes longer"
            ) from e
        return resp

    async def warmup(self, req: admin_pb2.WarmupRequest, label: str) -> admin_pb2.WarmupResponse:
        """One warmup step, retried with backoff; each attempt has the step deadline."""
        cfg = self._cfg
        retrying = AsyncRetrying(
            stop=stop_after_attempt(cfg.retries + 1),
            wait=self._wait(),
            retry=retry_if_exception(_is_code(NEVER_RETRIED, False)),
            before_sleep=_log_retry(f"{label} failed", f"/{cfg.retries}"),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    resp = await self._stub.Warmup(
                        req, timeout=cfg.step_timeout, metadata=self._metadata
                    )
        except grpc.aio.AioRpcError as e:
            n = retrying.statistics.get("attempt_number", 1)
            hint = ""
            if e.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                hint = f"; the step took over {cfg.step_timeout:g} s (raise --step-timeout)"
            raise WarmupFailed(
                f"{label} failed after {n} attempt{'s' if n != 1 else ''}: {rpc_error(e)}{hint}"
            ) from e
        return resp

    async def _call(
        self,
        what: str,
        method: grpc.aio.UnaryUnaryMultiCallable,
        req: admin_pb2.ReseedRequest | admin_pb2.MarkServingRequest,
    ) -> Any:
        """A short admin call, retried on transient errors only."""
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self._cfg.retries + 1),
            wait=self._wait(),
            retry=retry_if_exception(_is_code(TRANSIENT, True)),
            before_sleep=_log_retry(f"{what} failed", f"/{self._cfg.retries}"),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    result = await method(
                        req, timeout=self._cfg.rpc_timeout, metadata=self._metadata
                    )
        except grpc.aio.AioRpcError as e:
            raise WarmupFailed(f"{what} failed: {rpc_error(e)}") from e
        return result

    async def reseed(self, seed: int) -> admin_pb2.ReseedResponse:
        return await self._call("Reseed", self._stub.Reseed, admin_pb2.ReseedRequest(seed=seed))

    async def mark_serving(self) -> admin_pb2.MarkServingResponse:
        req = admin_pb2.MarkServingRequest()
        return await self._call("MarkServing", self._stub.MarkServing, req)


def public_channel(cfg: Config) -> grpc.aio.Channel:
    """A channel to the public port: TLS when --public-tls-ca is set, else plaintext."""
    if not cfg.public_tls_ca:
        return grpc.aio.insecure_channel(cfg.public)
    key = Path(cfg.public_tls_key).read_bytes() if cfg.public_tls_key else None
    cert = Path(cfg.public_tls_cert).read_bytes() if cfg.public_tls_cert else None
    creds = grpc.ssl_channel_credentials(Path(cfg.public_tls_ca).read_bytes(), key, cert)
    return grpc.aio.secure_channel(cfg.public, creds)


async def public_health(cfg: Config) -> str:
    """The overall grpc.health.v1 status at the public address, or why it is not known."""
    try:
        channel = public_channel(cfg)
    except OSError as e:
        return f"unknown (TLS files: {e})"
    timeout = cfg.rpc_timeout
    async with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            return f"unknown ({rpc_error(e)})"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
