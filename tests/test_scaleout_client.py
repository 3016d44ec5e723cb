"""Client-side balancing over several replicas (inference_api/channel.py, docs/scale-out.md):
three real services with the tiny models on port 0, one channel to all three addresses, and
each service's own counters read from its /metrics. round_robin spreads the calls where the
default (pick_first) sends them all to one; an Embed answered UNAVAILABLE by a replica that
is not warm is retried on another and succeeds, a Generate never is; a stopped replica's
share goes to the others; inference-cli takes the same targets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import grpc
import pytest

from inference_api.channel import RETRY_POLICY, SERVICE_CONFIG, channel_options
from inference_api.stubs.inference.v1 import inference_pb2 as pb
from inference_api.stubs.inference.v1 import inference_pb2_grpc
from inference_cli import cli
from tests.conftest import tiny_args
from tests.rpc import serving
from tests.test_metrics import scrape, value

pytestmark = pytest.mark.rpc

EMBED = pb.EmbedRequest(inputs=["spread me"])
GENERATE = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2))


@dataclass
class Replica:
    service: object
    port: int
    metrics_port: int

    async def count(self, rpc: str, code: str) -> int:
        samples = await scrape(self.metrics_port)
        return int(value(samples, "inference_requests_total", rpc=rpc, code=code))


@asynccontextmanager
async def replicas(embed_dir, lm_dir, warm: Sequence[bool]) -> AsyncIterator[list[Replica]]:
    """One in-process service per entry of `warm`: warmed and SERVING, or loaded only (it
    answers UNAVAILABLE, as a restarted replica does until its sidecar has warmed it)."""
    metrics = ("--metrics-port", "0", "--metrics-host", "127.0.0.1")
    async with AsyncExitStack() as stack:
        out = []
        for w in warm:
            args = tiny_args(embed_dir, lm_dir, *metrics)
            service, _ = await stack.enter_async_context(serving(args, loaded=True, warm=w))
            out.append(Replica(service, service.port, service.metrics_port))
        yield out


def target(reps: Sequence[Replica]) -> str:
    return "ipv4:" + ",".join(f"127.0.0.1:{r.port}" for r in reps)


async def counts(reps: Sequence[Replica], rpc: str, code: str = "OK") -> list[int]:
    return [await r.count(rpc, code) for r in reps]


def test_the_service_config_retries_only_what_has_no_side_effects() -> None:
    retried, plain = SERVICE_CONFIG["methodConfig"]
    assert {n["method"] for n in retried["name"]} == {"Embed", "Info", "Check"}
    assert retried["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE", "CANCELLED"]
    assert {n["method"] for n in plain["name"]} == {"Generate", "GenerateStream"}
    assert "retryPolicy" not in plain
    assert SERVICE_CONFIG["loadBalancingConfig"] == [{"round_robin": {}}]


async def test_round_robin_spreads_calls_over_every_replica(tiny_embed_dir, tiny_lm_dir):
    async with replicas(tiny_embed_dir, tiny_lm_dir, [True, True, True]) as reps:
        async with grpc.aio.insecure_channel(target(reps)) as default:
            stub = inference_pb2_grpc.InferenceStub(default)
            for _ in range(12):
                await stub.Embed(EMBED, timeout=10)
        before = await counts(reps, "Embed")
        assert sorted(before) == [0, 0, 12], before  # the default, pick_first: one replica

        async with grpc.aio.insecure_channel(target(reps), options=channel_options()) as ch:
            stub = inference_pb2_grpc.InferenceStub(ch)
            for _ in range(30):
                await stub.Embed(EMBED, timeout=10)
            for _ in range(9):
                await stub.Generate(GENERATE, timeout=30)
        embeds = [n - b for n, b in zip(await counts(reps, "Embed"), before, strict=True)]
        generates = await counts(reps, "Generate")
        print("per replica: Embed", embeds, "Generate", generates)
        assert sum(embeds) == 30 and min(embeds) >= 5, embeds
        assert sum(generates) == 9 and min(generates) >= 1, generates


async def failures(calls: Sequence[Awaitable[object]]) -> list[grpc.StatusCode]:
    """The status codes of the calls that failed, each call awaited in turn."""
    codes = []
    for call in calls:
        try:
            await call
        except grpc.aio.AioRpcError as err:
            codes.append(err.code())
    return codes


async def stream_all(stub: inference_pb2_grpc.InferenceStub) -> None:
    _ = [chunk async for chunk in stub.GenerateStream(GENERATE, timeout=30)]


async def test_embed_is_retried_past_a_cold_replica_and_generate_never_is(
    tiny_embed_dir, tiny_lm_dir
):
    """Replica 2 is loaded but not warm: it answers UNAVAILABLE. Every Embed still succeeds
    (the retry goes to the next replica); each Generate and GenerateStream sent to it fails
    once, and its own counters show each was sent once. Then replica 0 stops: replica 1
    answers every Embed (those first sent to replica 2 after one retry)."""
    async with (
        replicas(tiny_embed_dir, tiny_lm_dir, [True, True, False]) as reps,
        grpc.aio.insecure_channel(target(reps), options=channel_options()) as channel,
    ):
        stub = inference_pb2_grpc.InferenceStub(channel)
        for _ in range(30):
            reply = await stub.Embed(EMBED, timeout=10)  # raises if one is not retried
            assert len(reply.embeddings) == 1
        embed_ok = await counts(reps, "Embed")
        assert embed_ok[2] == 0 and sum(embed_ok) == 30, embed_ok
        refused = await reps[2].count("Embed", "UNAVAILABLE")
        assert refused >= 5, refused  # a third of the first attempts went to the cold one

        failed = await failures([stub.Generate(GENERATE, timeout=30) for _ in range(9)])
        assert failed and set(failed) == {grpc.StatusCode.UNAVAILABLE}
        assert await reps[2].count("Generate", "UNAVAILABLE") == len(failed)  # no retry
        assert sum(await counts(reps, "Generate")) == 9 - len(failed)
        failed = await failures([stream_all(stub) for _ in range(9)])
        assert failed and set(failed) == {grpc.StatusCode.UNAVAILABLE}
        assert await reps[2].count("GenerateStream", "UNAVAILABLE") == len(failed)
        assert sum(await counts(reps, "GenerateStream")) == 9 - len(failed)

        await reps[0].service.stop(0)
        before = await counts(reps[1:], "Embed")
        for _ in range(10):
            await stub.Embed(EMBED, timeout=10)
        after = await counts(reps[1:], "Embed")
        assert after[0] - before[0] == 10 and after[1] == 0, (before, after)


async def test_the_cli_spreads_over_a_target_and_retries_embed_not_generate(
    tiny_embed_dir, tiny_lm_dir, capsys
):
    """inference-cli with an ipv4: list (one replica cold) or a dns:/// name (localhost: ::1,
    where nothing listens, and 127.0.0.1) exits 0; against the cold replica alone an Embed
    is sent maxAttempts times before it fails, a Generate once."""
    async with replicas(tiny_embed_dir, tiny_lm_dir, [True, False]) as (warm, cold):
        targets = [target([warm, cold])] * 6 + [f"dns:///localhost:{warm.port}"] * 2
        for addr in targets:
            code = await asyncio.to_thread(cli.main, ["embed", "--addr", addr, "x"])
            assert code == cli.EXIT_OK, (addr, capsys.readouterr().err)
        assert await warm.count("Embed", "OK") == len(targets)

        before = await cold.count("Embed", "UNAVAILABLE")
        only_cold = f"127.0.0.1:{cold.port}"
        code = await asyncio.to_thread(cli.main, ["embed", "--addr", only_cold, "x"])
        assert code == cli.EXIT_RPC
        assert "UNAVAILABLE" in capsys.readouterr().err
        want = before + RETRY_POLICY["maxAttempts"]
        assert await settled(cold, "Embed", "UNAVAILABLE", want) == want
        code = await asyncio.to_thread(cli.main, ["generate", "--addr", only_cold, "x"])
        assert code == cli.EXIT_RPC
        assert await settled(cold, "Generate", "UNAVAILABLE", 1) == 1


async def settled(rep: Replica, rpc: str, code: str, want: int) -> int:
    """The replica's count once it reaches ``want`` or has stayed put for a second: a call is
    counted just after its status is sent, so a client can read /metrics before that."""
    n = await rep.count(rpc, code)
    for _ in range(20):
        if n >= want:
            break
        await asyncio.sleep(0.05)
        n = await rep.count(rpc, code)
    await asyncio.sleep(0.2)  # and no attempt more than that
    return await rep.count(rpc, code)
