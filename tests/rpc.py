"""Clients of a running service, the warmup a sidecar would run, and `serving(args)`: an
in-process service on port 0 for the rpc tier of tests (see tests/README.md)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inference_api.stubs.inference.v1 import admin_pb2 as apb
from inference_api.stubs.inference.v1 import admin_pb2_grpc, inference_pb2_grpc

if TYPE_CHECKING:
    from inference_svc.app import Service

WARMUP_KINDS = (
    apb.WARMUP_STEP_KIND_PROFILE,
    apb.WARMUP_STEP_KIND_COMPILE,
    apb.WARMUP_STEP_KIND_SAMPLER,
)


@dataclass
class Clients:
    channel: grpc.aio.Channel
    admin_channel: grpc.aio.Channel
    inference: inference_pb2_grpc.InferenceStub
    admin: admin_pb2_grpc.WarmupAdminStub
    health: health_pb2_grpc.HealthStub

    @classmethod
    def connect(cls, port: int, admin_port: int) -> Clients:
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        ach = grpc.aio.insecure_channel(f"127.0.0.1:{admin_port}")
        return cls(
            ch,
            ach,
            inference_pb2_grpc.InferenceStub(ch),
            admin_pb2_grpc.WarmupAdminStub(ach),
            health_pb2_grpc.HealthStub(ch),
        )

    async def status(self, name: str) -> int:
        reply = await self.health.Check(health_pb2.HealthCheckRequest(service=name))
        return reply.status

    async def run_required_steps(self) -> list[apb.WarmupResponse]:
        described = await self.admin.Describe(apb.DescribeRequest())
        reports = []
        for step in described.required_steps:
            if step.step in WARMUP_KINDS:
                req = apb.WarmupRequest(model=step.model, step=step.step)
                reports.append(await self.admin.Warmup(req))
        return reports

    async def warm_and_serve(self) -> list[apb.WarmupResponse]:
        reports = await self.run_required_steps()
        await self.admin.Reseed(apb.ReseedRequest())
        await self.admin.MarkServing(apb.MarkServingRequest())
        return reports

    async def close(self) -> None:
        await self.channel.close()
        await self.admin_channel.close()


@asynccontextmanager
async def serving(
    args: Sequence[str], *, loaded: bool = False, warm: bool = False, kinds: tuple = ()
) -> AsyncIterator[tuple[Service, Clients]]:
    """``async with serving(args, warm=True) as (service, clients):`` runs
    ``Service(parse_config(args))`` in this process (pass ``--port 0 --admin-port 0``:
    tests/conftest.py's ``tiny_args`` does). ``loaded`` waits until the models are loaded;
    ``warm`` also runs the warmup a sidecar would and marks the service SERVING. On the way
    out, whatever happened, the channels are closed and the service stopped."""
    from inference_svc.app import Service  # here: the unit tier never imports the service
    from inference_svc.config import parse_config

    config = parse_config(list(args))
    service = Service(config, kinds) if kinds else Service(config)  # kinds: model kinds to load
    await service.start()
    clients = Clients.connect(service.port, service.admin_port)
    try:
        if loaded or warm:
            await service.loaded()
        if warm:
            await clients.warm_and_serve()
        yield service, clients
    finally:
        await clients.close()
        await service.stop(0)
