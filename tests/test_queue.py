"""A full queue answers RESOURCE_EXHAUSTED; what was accepted still completes."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from inference_api.stubs.inference.v1 import inference_pb2 as pb
from tests.conftest import tiny_args
from tests.rpc import serving

pytestmark = pytest.mark.rpc


async def test_full_queue_is_resource_exhausted(tiny_embed_dir, tiny_lm_dir):
    args = tiny_args(tiny_embed_dir, tiny_lm_dir, "--max-queue", "1", "--gen-max-batch", "2")
    async with serving(args, warm=True) as (_service, c):
        req = pb.GenerateRequest(prompt="one two three", sampling=pb.SamplingParams(max_tokens=16))
        results = await asyncio.gather(
            *(c.inference.Generate(req) for _ in range(8)), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        done = [r for r in results if isinstance(r, pb.GenerateResponse)]
        assert errors and done
        assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in errors)
        assert "already queued; retry later" in errors[0].details()
        assert all(r.usage.completion_tokens > 0 for r in done)
