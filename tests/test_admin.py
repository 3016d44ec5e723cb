"""The admin surface on a real service (tiny models, mode NONE): Describe says what the
service itself planned, with every skip and its reason; Warmup refuses what it cannot
take with INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2

from inference_api import convert
from inference_api.plan import StepKind
from inference_api.stubs.inference.v1 import admin_pb2 as apb
from inference_svc import __version__
from inference_svc.engine.runtime import ModelRuntime
from tests.conftest import tiny_args
from tests.rpc import serving

pytestmark = pytest.mark.rpc


async def test_describe_carries_the_services_plan_skips_and_version(tiny_embed_dir, tiny_lm_dir):
    async with serving(tiny_args(tiny_embed_dir, tiny_lm_dir), loaded=True) as (service, c):
        assert all(isinstance(r, ModelRuntime) for r in service.engine.runtimes.values())
        described = await c.admin.Describe(apb.DescribeRequest())
        assert described.version == __version__
        required = [(s.kind, s.model) for s in convert.steps_from_pb(described.required_steps)]
        assert required == [
            (StepKind.PROFILE, "generative"),
            (StepKind.RESEED, ""),
            (StepKind.MARK_SERVING, ""),
        ]
        skipped = {
            (s.kind, s.model): s.reason for s in convert.steps_from_pb(described.skipped_steps)
        }
        assert skipped[(StepKind.COMPILE, "embedding")] == "compilation mode NONE"
        assert skipped[(StepKind.COMPILE, "generative")] == "compilation mode NONE"
        assert skipped[(StepKind.SAMPLER, "embedding")] == "embedding model: no sampler"
        assert skipped[(StepKind.PROFILE, "embedding")] == "no KV cache to size"
        assert not described.required_steps[0].done

        await c.run_required_steps()
        described = await c.admin.Describe(apb.DescribeRequest())
        assert described.required_steps[0].done
        lm = next(m for m in described.models if m.name == "generative")
        assert lm.kv_cache_tokens > 0 and lm.kv_cache_sizing == apb.KV_CACHE_SIZING_AUTOMATIC


BAD_WARMUPS = [
    (apb.WarmupRequest(model="generative", step=apb.WARMUP_STEP_KIND_RESEED), "their own calls"),
    (apb.WarmupRequest(model="generative", step=apb.WARMUP_STEP_KIND_UNSPECIFIED), "step: got"),
    (apb.WarmupRequest(model="generative", step=42), "step: got unknown value 42"),
    (
        apb.WarmupRequest(model="generative", step=apb.WARMUP_STEP_KIND_SAMPLER, sampler_paths=[9]),
        "sampler_paths: sampler path: got unknown value 9",
    ),
    (
        apb.WarmupRequest(model="reranker", step=apb.WARMUP_STEP_KIND_COMPILE),
        "'reranker' is not loaded (loaded models: embedding, generative)",
    ),
]


async def test_warmup_refuses_what_it_cannot_take(tiny_embed_dir, tiny_lm_dir):
    async with serving(tiny_args(tiny_embed_dir, tiny_lm_dir), loaded=True) as (_, c):
        for request, message in BAD_WARMUPS:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await c.admin.Warmup(request)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, message
            assert message in info.value.details()


async def test_a_serving_service_refuses_a_stray_reseed_or_mark(tiny_embed_dir, tiny_lm_dir):
    async with serving(tiny_args(tiny_embed_dir, tiny_lm_dir), loaded=True) as (_, c):
        await c.warm_and_serve()
        for call in (
            c.admin.Reseed(apb.ReseedRequest(seed=9)),
            c.admin.MarkServing(apb.MarkServingRequest()),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "the service is SERVING" in info.value.details()
            assert "rewarm=true" in info.value.details()
        assert (await c.admin.Reseed(apb.ReseedRequest(seed=9, rewarm=True))).seed == 9
        assert (await c.admin.MarkServing(apb.MarkServingRequest(rewarm=True))).serving
        assert await c.status("inference.v1.Inference") == health_pb2.HealthCheckResponse.SERVING
