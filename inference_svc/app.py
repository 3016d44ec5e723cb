"""The service process: public and admin gRPC servers around one engine.

Public port: Inference, grpc.health.v1 and reflection. Admin port (loopback by
default): WarmupAdmin. Health starts NOT_SERVING for "" and
inference.v1.Inference (the stock servicer would start "" SERVING: a trap), and
SERVING for "liveness" as soon as the process listens. Models load in the
background after the ports listen, so liveness answers during the load.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from inference_api.names import (
    ADMIN_SERVICE,
    GATED_HEALTH_NAMES,
    HEALTH_LIVENESS,
    INFERENCE_SERVICE,
)
from inference_svc import __version__
from inference_svc.auth import AdminTokenInterceptor
from inference_svc.config import ServiceConfig
from inference_svc.engine.core import Engine
from inference_svc.engine.registry import KINDS
from inference_svc.engine.runtime import ModelKindEntry
from inference_svc.metrics import Metrics
from inference_svc.server import AdminServicer, InferenceServicer
from inference_svc.wire import HEALTH_NOT_SERVING as NOT_SERVING
from inference_svc.wire import HEALTH_SERVING as SERVING
from inference_svc.wire import PUBLIC_SERVICES, add_servicer, warm_messages

log = logging.getLogger(__name__)
DRAIN_POLL_S = 0.05  # how often a stopping service looks whether its calls have finished


def public_options(config: ServiceConfig) -> list[tuple[str, int]]:
    """The public server's channel arguments: the request size limit, the connection age."""
    options = [("grpc.max_receive_message_length", config.max_request_bytes)]
    if config.max_connection_age > 0:  # 0: off (grpc's default, connections live forever)
        options += [
            ("grpc.max_connection_age_ms", round(config.max_connection_age * 1000)),
            ("grpc.max_connection_age_grace_ms", round(config.max_connection_age_grace * 1000)),
        ]
    return options


class Service:
    def __init__(self, config: ServiceConfig, kinds: tuple[ModelKindEntry, ...] = KINDS) -> None:
        self.config = config
        self.engine = Engine(config, kinds)
        self.health = health.aio.HealthServicer()
        self.public = grpc.aio.server(options=public_options(config))
        guard = [AdminTokenInterceptor(config.admin_token)] if config.admin_token else []
        self.admin = grpc.aio.server(interceptors=guard)
        self.serving = False  # what health says for the gated names (read by metrics)
        self.metrics = Metrics(self.engine, lambda: self.serving, __version__)
        self.port = 0
        self.admin_port = 0
        self.metrics_port: int | None = None
        self.load_task: asyncio.Task[None] | None = None
        # Set when the engine says this process must be restarted (``serve`` then stops it).
        self.restart_required: asyncio.Event = asyncio.Event()

    async def start(self) -> None:
        """Listen on both ports, then start loading the models in the background."""
        c = self.config
        warm_messages()
        for name in GATED_HEALTH_NAMES:
            await self.health.set(name, NOT_SERVING)
        await self.health.set(HEALTH_LIVENESS, SERVING)
        add_servicer(self.public, INFERENCE_SERVICE, InferenceServicer(self.engine, self.metrics))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.public)
        reflection.enable_server_reflection(
            (*PUBLIC_SERVICES, reflection.SERVICE_NAME), self.public
        )
        add_servicer(self.admin, ADMIN_SERVICE, AdminServicer(self.engine, self.metrics))
        self.port = self._listen_public(f"{c.host}:{c.port}")
        self.admin_port = self.admin.add_insecure_port(f"{c.admin_host}:{c.admin_port}")
        await self.public.start()
        await self.admin.start()
        if c.metrics_port is not None:
            self.metrics_port = self.metrics.serve(c.metrics_host, c.metrics_port)
        loop = asyncio.get_running_loop()
        self.engine.on_health = lambda serving, reason: loop.call_soon_threadsafe(
            lambda: loop.create_task(self._set_health(serving, reason))
        )
        self.engine.on_restart = lambda reason: loop.call_soon_threadsafe(self.restart_required.set)
        log.info(
            "listening: public %s:%d, admin %s:%d (%s; boot %s); health NOT_SERVING until warmed",
            c.host,
            self.port,
            c.admin_host,
            self.admin_port,
            "token required" if c.admin_token else "no token",
            self.engine.boot_id,
        )
        self._write_port_file()
        self.load_task = asyncio.create_task(asyncio.to_thread(self.engine.load))

    def _listen_public(self, address: str) -> int:
        """Plaintext, or TLS when a certificate is configured (mutual with a client CA)."""
        c = self.config
        if not c.tls_cert_file or not c.tls_key_file:
            return self.public.add_insecure_port(address)
        pair = (Path(c.tls_key_file).read_bytes(), Path(c.tls_cert_file).read_bytes())
        client_ca = Path(c.tls_client_ca_file).read_bytes() if c.tls_client_ca_file else None
        creds = grpc.ssl_server_credentials(
            [pair], root_certificates=client_ca, require_client_auth=client_ca is not None
        )
        return self.public.add_secure_port(address, creds)

    async def loaded(self) -> None:
        assert self.load_task is not None, "start() first"
        await self.load_task

    async def _set_health(self, serving: bool, reason: str) -> None:
        self.serving = serving
        for name in GATED_HEALTH_NAMES:
            await self.health.set(name, SERVING if serving else NOT_SERVING)
        log.info("health: %s (%s)", "SERVING" if serving else "NOT_SERVING", reason)

    def _write_port_file(self) -> None:
        if not self.config.port_file:
            return
        path = Path(self.config.port_file)
        tmp = path.with_suffix(".tmp")
        data = {
            "port": self.port,
            "admin_port": self.admin_port,
            "metrics_port": self.metrics_port,
            "pid": os.getpid(),
            "boot_id": self.engine.boot_id,
        }
        tmp.write_text(json.dumps(data))
        tmp.replace(path)

    async def stop(self, grace: float | None = None) -> None:
        """Health NOT_SERVING at once; in-flight calls get ``grace`` seconds."""
        grace = self.config.grace_period if grace is None else grace
        log.info("shutting down: health NOT_SERVING, %.0f s grace for in-flight calls", grace)
        self.serving = False
        await self.health.enter_graceful_shutdown()
        await self.admin.stop(0)
        await self._drain(grace)
        if self.load_task is not None and not self.load_task.done():
            self.load_task.cancel()
        self.engine.close()
        self.metrics.close()

    async def _drain(self, grace: float) -> None:
        """Refuse new calls, let the calls in flight finish (up to ``grace`` s), then close.

        Only the service's own calls are waited for: a health Watch stream (a client
        following the status) never ends by itself and would hold the process for the
        whole grace period; it is cancelled once the last Embed/Generate has answered."""
        if grace <= 0 or self.metrics.calls_in_flight == 0:
            await self.public.stop(0)
            return
        stopping = asyncio.create_task(self.public.stop(grace))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self.metrics.calls_in_flight > 0 and loop.time() < deadline:
            if stopping.done():
                break
            await asyncio.sleep(DRAIN_POLL_S)
        if not stopping.done():
            await self.public.stop(0)
        await stopping
