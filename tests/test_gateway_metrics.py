"""What a gateway's endpoint picker reads from /metrics (docs/scale-out.md, "Metrics for
gateways"): requests queued, requests running and the KV cache's use, 0 to 1, read from a
real service's /metrics (tiny models) with a KV cache of two rows while streams run."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from inference_api.stubs.inference.v1 import inference_pb2 as pb
from tests.conftest import tiny_args
from tests.rpc import serving
from tests.test_metrics import scrape, value

pytestmark = pytest.mark.rpc

LM = {"model": "generative"}
LONG = pb.GenerateRequest(
    prompt="hello", sampling=pb.SamplingParams(max_tokens=256, stop=["\u2603"])
)


async def picked(port: int) -> tuple[float, float, float]:
    """(queued, running, KV-cache use) of the generative model, as the picker reads them."""
    s = await scrape(port)
    return (
        value(s, "inference_queue_depth", **LM),
        value(s, "inference_rows_in_use", **LM),
        value(s, "inference_kv_cache_usage_ratio", **LM),
    )


async def test_queued_running_and_kv_cache_use_follow_the_streams(tiny_embed_dir, tiny_lm_dir):
    # A row holds 32 + 256 = 288 tokens: a cache of 576 tokens has two rows.
    args = tiny_args(tiny_embed_dir, tiny_lm_dir, "--metrics-port", "0",
                     "--metrics-host", "127.0.0.1", "--max-new-tokens", "256",
                     "--kv-cache-tokens", "576")  # fmt: skip
    async with serving(args, warm=True) as (service, c):
        port = service.metrics_port
        samples = await scrape(port)
        assert value(samples, "inference_kv_cache_tokens", **LM) == 576
        assert ("inference_kv_cache_usage_ratio", (("model", "embedding"),)) not in samples
        assert await picked(port) == (0, 0, 0)

        first = c.inference.GenerateStream(LONG, timeout=60)
        await first.read()  # running: it holds one row of two
        assert await picked(port) == (0, 1, 0.5)

        second = c.inference.GenerateStream(LONG, timeout=60)
        await second.read()
        third = c.inference.GenerateStream(LONG, timeout=60)  # no row left: it waits
        deadline = time.monotonic() + 5
        while (now := await picked(port)) != (1, 2, 1.0) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert now == (1, 2, 1.0)

        for call in (first, second, third):
            call.cancel()
        deadline = time.monotonic() + 10
        while (now := await picked(port)) != (0, 0, 0) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert now == (0, 0, 0)
        assert await third.code() == grpc.StatusCode.CANCELLED
