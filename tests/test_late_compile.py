"""The compile monitor: a compile after SERVING is counted, logged with its cause,
shown in Info, and under --on-late-compile fail turns health NOT_SERVING."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from grpc_health.v1 import health_pb2

from inference_api.stubs.inference.v1 import inference_pb2 as pb
from tests.conftest import TORCH_COMPILE, tiny_args
from tests.rpc import serving

pytestmark = pytest.mark.rpc


@pytest.mark.parametrize("policy", ["warn", "fail"])
async def test_late_compile_is_counted_and_handled(tiny_embed_dir, tiny_lm_dir, policy, caplog):
    args = tiny_args(
        tiny_embed_dir, tiny_lm_dir, "--compilation-mode", "default", "--lm-model", "none",
        "--on-late-compile", policy, *TORCH_COMPILE,
    )  # fmt: skip
    async with serving(args, warm=True) as (_service, c):
        await c.inference.Embed(pb.EmbedRequest(inputs=["warm", "path"]))
        assert (await c.inference.Info(pb.InfoRequest())).late_compile_events == 0
        # Drop every compiled graph: the next request has to compile again, late.
        torch._dynamo.reset()
        with caplog.at_level(logging.WARNING, logger="inference_svc.compile_monitor"):
            await c.inference.Embed(pb.EmbedRequest(inputs=["now cold again"]))
        info = await c.inference.Info(pb.InfoRequest())
        assert info.late_compile_events >= 1
        assert info.models[0].late_compile_events == info.late_compile_events
        assert "late compile after SERVING: model=embedding site=embed/request" in caplog.text
        await asyncio.sleep(0.2)  # the health change is scheduled on the loop
        status = await c.status("inference.v1.Inference")
        if policy == "fail":
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert not info.serving
        else:
            assert status == health_pb2.HealthCheckResponse.SERVING
            assert info.serving
