"""Prometheus metrics of a real running service (tiny models): scraped over HTTP, with the
names and labels an operator's dashboards and alerts use, moving with traffic."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inference_api.stubs.inference.v1 import inference_pb2 as pb
from inference_svc import __version__
from tests.conftest import tiny_args
from tests.rpc import serving

pytestmark = pytest.mark.rpc


async def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample on /metrics: (name, sorted labels) -> value."""
    url = f"http://127.0.0.1:{port}/metrics"

    def get() -> str:
        with urllib.request.urlopen(url, timeout=10) as reply:
            assert reply.status == 200
            return reply.read().decode()

    text = await asyncio.to_thread(get)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_metrics_follow_warmup_and_traffic(tiny_embed_dir, tiny_lm_dir):
    args = tiny_args(
        tiny_embed_dir, tiny_lm_dir, "--metrics-port", "0", "--metrics-host", "127.0.0.1"
    )
    async with serving(args) as (service, c):
        assert service.metrics_port
        await service.loaded()
        before = await scrape(service.metrics_port)
        assert value(before, "inference_health_serving") == 0
        boot = {"boot_id": service.engine.boot_id, "version": __version__}
        assert value(before, "inference_build_info", **boot) == 1
        assert value(before, "inference_model_load_seconds", model="generative") > 0

        await c.warm_and_serve()
        await c.inference.Embed(pb.EmbedRequest(inputs=["one", "two"]))
        req = pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(max_tokens=4))
        reply = await c.inference.Generate(req)
        chunks = [chunk async for chunk in c.inference.GenerateStream(req)]
        with pytest.raises(grpc.aio.AioRpcError) as bad_unary:
            await c.inference.Generate(pb.GenerateRequest())
        assert bad_unary.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as bad_stream:
            _ = [chunk async for chunk in c.inference.GenerateStream(pb.GenerateRequest())]
        assert bad_stream.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        after = await scrape(service.metrics_port)
        assert value(after, "inference_health_serving") == 1
        assert value(after, "inference_requests_total", rpc="Embed", code="OK") == 1
        assert value(after, "inference_requests_total", rpc="Generate", code="OK") == 1
        assert value(after, "inference_requests_total", rpc="GenerateStream", code="OK") == 1
        bad = value(after, "inference_requests_total", rpc="Generate", code="INVALID_ARGUMENT")
        assert bad == 1
        bad = value(
            after, "inference_requests_total", rpc="GenerateStream", code="INVALID_ARGUMENT"
        )
        assert bad == 1
        assert value(after, "inference_requests_total", rpc="MarkServing", code="OK") == 1
        assert value(after, "inference_request_duration_seconds_count", rpc="Embed") == 1
        completion = reply.usage.completion_tokens + chunks[-1].usage.completion_tokens
        generated = value(
            after, "inference_tokens_total", model="generative", direction="completion"
        )
        assert generated == completion
        assert value(after, "inference_tokens_total", model="embedding", direction="prompt") > 0
        assert value(after, "inference_time_to_first_token_seconds_count") == 2
        assert value(after, "inference_inter_token_latency_seconds_count") == completion - 2
        assert value(after, "inference_batches_total", model="embedding", rows="2") >= 1
        prefill = {dict(labels)["tokens"]: n for (name, labels), n in after.items()
                   if name == "inference_prefill_chunks_total"}  # fmt: skip
        assert prefill and sum(prefill.values()) >= 2 and set(prefill) <= {"16", "32"}, prefill
        assert value(after, "inference_queue_depth", model="generative") == 0
        assert value(after, "inference_warmup_step_seconds", model="generative", step="profile") > 0
        assert value(after, "inference_kv_cache_tokens", model="generative") > 0
        assert value(after, "inference_compile_events_total", when="after_serving") == 0
        assert value(after, "inference_late_compile_events_total", model="embedding") == 0
        assert ("inference_late_compile_events_total", (("model", "generative"),)) in after


async def test_metrics_are_off_by_default(tiny_embed_dir, tiny_lm_dir):
    async with serving(tiny_args(tiny_embed_dir, tiny_lm_dir)) as (service, _c):
        assert service.metrics_port is None
