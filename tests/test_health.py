"""Health names, their transitions (Check and Watch), the gate before SERVING, reflection."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from inference_api.stubs.inference.v1 import admin_pb2 as apb
from inference_api.stubs.inference.v1 import inference_pb2 as pb
from tests.conftest import tiny_args
from tests.rpc import serving

pytestmark = pytest.mark.rpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _code_of(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


async def test_health_gate_from_start_to_serving(tiny_embed_dir, tiny_lm_dir):
    async with serving(tiny_args(tiny_embed_dir, tiny_lm_dir)) as (service, c):
        assert await c.status("liveness") == SERVING
        assert await c.status("") == NOT_SERVING
        assert await c.status("inference.v1.Inference") == NOT_SERVING
        watch = c.health.Watch(health_pb2.HealthCheckRequest(service="inference.v1.Inference"))
        assert (await watch.read()).status == NOT_SERVING

        for call in (
            c.inference.Embed(pb.EmbedRequest(inputs=["hi"])),
            c.inference.Generate(pb.GenerateRequest(prompt="hi")),
        ):
            err = await _code_of(call)
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert "warming up" in err.details()
        stream = c.inference.GenerateStream(pb.GenerateRequest(prompt="hi"))
        err = await _code_of(stream.read())
        assert err.code() == grpc.StatusCode.UNAVAILABLE

        await service.loaded()
        described = await c.admin.Describe(apb.DescribeRequest())
        assert described.models_loaded and len(described.boot_id) == 32
        err = await _code_of(c.admin.MarkServing(apb.MarkServingRequest()))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "PROFILE generative" in err.details()

        # Reseed *before* the last warmup step: refused, and it says why.
        await c.admin.Reseed(apb.ReseedRequest())
        await c.run_required_steps()
        err = await _code_of(c.admin.MarkServing(apb.MarkServingRequest()))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "Reseed" in err.details()
        assert await c.status("inference.v1.Inference") == NOT_SERVING

        await c.admin.Reseed(apb.ReseedRequest())
        reply = await c.admin.MarkServing(apb.MarkServingRequest())
        assert reply.serving and reply.boot_id == described.boot_id
        assert (await watch.read()).status == SERVING
        assert await c.status("") == SERVING
        assert await c.status("liveness") == SERVING
        info = await c.inference.Info(pb.InfoRequest())
        assert info.serving and info.late_compile_events == 0
        err = await _code_of(c.health.Check(health_pb2.HealthCheckRequest(service="nope")))
        assert err.code() == grpc.StatusCode.NOT_FOUND
        watch.cancel()

        await service.stop(1)
        err = await _code_of(c.health.Check(health_pb2.HealthCheckRequest(service="")))
        assert err.code() == grpc.StatusCode.UNAVAILABLE


async def test_admin_port_is_loopback_and_reflection_lists_services(tiny_embed_dir, tiny_lm_dir):
    async with serving(tiny_args(tiny_embed_dir, tiny_lm_dir)) as (service, c):
        assert service.config.admin_host == "127.0.0.1"
        stub = reflection_pb2_grpc.ServerReflectionStub(c.channel)
        replies = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = set()
        async for reply in replies:
            names |= {s.name for s in reply.list_services_response.service}
        assert {"inference.v1.Inference", "grpc.health.v1.Health"} <= names
        assert "inference.v1.WarmupAdmin" not in names  # admin lives on its own port only
