"""The public server's connection age and its drain (docs/scale-out.md), on real servers with
the tiny models. A client's TCP connections are counted by a byte-for-byte relay between
the client and the service: a connection past --max-connection-age gets GOAWAY, the client
opens a new one for its next call, and no call fails; a stream open across the age ends
whole within the grace, and is cut when the grace is shorter than it; a stopping service
lets an open stream finish while a new call fails at once with UNAVAILABLE."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest

from inference_api.stubs.inference.v1 import inference_pb2 as pb
from inference_api.stubs.inference.v1 import inference_pb2_grpc
from inference_svc.app import public_options
from inference_svc.config import parse_config
from tests.conftest import tiny_args
from tests.rpc import serving

pytestmark = pytest.mark.rpc

EMBED = pb.EmbedRequest(inputs=["scale out"])


def long_stream(tokens: int) -> pb.GenerateRequest:
    """A stream of exactly `tokens` tokens: no stop string the tiny model will write."""
    sampling = pb.SamplingParams(max_tokens=tokens, stop=["\u2603"])
    return pb.GenerateRequest(prompt="hello", sampling=sampling)


class Relay:
    """A TCP relay on 127.0.0.1 to a port: counts the connections clients open through it."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.connections = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Relay:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for pipe in list(self._pipes):
            pipe.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        pipes = [
            asyncio.create_task(self._pipe(reader, up_writer)),
            asyncio.create_task(self._pipe(up_reader, writer)),
        ]
        self._pipes.update(pipes)
        await asyncio.gather(*pipes, return_exceptions=True)
        self._pipes.difference_update(pipes)

    @staticmethod
    async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            dst.close()  # one side closed: close the other, as a direct connection would


@asynccontextmanager
async def relayed(args: list[str]) -> AsyncIterator[tuple[Relay, inference_pb2_grpc.InferenceStub]]:
    """A warm service, a relay to its public port and a plain client channel through it."""
    async with (
        serving(args, warm=True) as (service, _),
        Relay(service.port) as relay,
        grpc.aio.insecure_channel(f"127.0.0.1:{relay.port}") as channel,
    ):
        yield relay, inference_pb2_grpc.InferenceStub(channel)


def test_the_age_flags_become_the_public_servers_channel_arguments() -> None:
    on = dict(public_options(parse_config(["--max-connection-age", "2.5"], {})))
    assert on["grpc.max_connection_age_ms"] == 2500
    assert on["grpc.max_connection_age_grace_ms"] == 600_000  # the default grace
    off = dict(public_options(parse_config(["--max-connection-age", "0"], {})))
    assert "grpc.max_connection_age_ms" not in off
    assert "grpc.max_connection_age_grace_ms" not in off


@pytest.mark.parametrize(("age", "new_connections"), [("0.5", True), ("0", False)])
async def test_a_connection_past_its_age_is_replaced_and_no_call_fails(
    tiny_embed_dir, tiny_lm_dir, age: str, new_connections: bool
) -> None:
    args = tiny_args(tiny_embed_dir, tiny_lm_dir, "--max-connection-age", age)
    async with relayed(args) as (relay, stub):
        calls = 0
        start = time.monotonic()
        while time.monotonic() - start < 2.0:  # 4 ages of 0.5 s (grpc's jitter: +-10%)
            reply = await stub.Embed(EMBED, timeout=10)  # raises if any call fails
            assert len(reply.embeddings) == 1
            calls += 1
            await asyncio.sleep(0.02)
        print(f"age {age}: {calls} calls over {relay.connections} connections")
        if new_connections:
            assert relay.connections >= 3
        else:
            assert relay.connections == 1


@pytest.mark.parametrize(("grace", "whole"), [("30", True), ("0.1", False)])
async def test_a_stream_open_across_the_age_ends_whole_within_the_grace(
    tiny_embed_dir, tiny_lm_dir, grace: str, whole: bool
) -> None:
    """Age 0.2 s: the stream (384 tokens: 0.6 s at the tiny model's best, seconds on a busy
    machine) outlives its connection's age. With a 30 s grace it ends whole while the next
    call goes over a new connection; with 0.1 s the server closes the connection under it."""
    tokens = 384 if whole else 512  # cut at 0.32 s at most; 512 tokens take 0.8 s or more
    age = ("--max-connection-age", "0.2", "--max-connection-age-grace", grace)
    args = tiny_args(tiny_embed_dir, tiny_lm_dir, "--max-new-tokens", str(tokens), *age)
    async with relayed(args) as (relay, stub):
        await stub.Embed(EMBED, timeout=10)  # the connection (and its age) starts here
        start = time.monotonic()
        stream = stub.GenerateStream(long_stream(tokens), timeout=60)
        chunks = []
        if not whole:
            with pytest.raises(grpc.aio.AioRpcError) as cut:
                chunks = [chunk async for chunk in stream]
            assert cut.value.code() == grpc.StatusCode.UNAVAILABLE, cut.value
            assert time.monotonic() - start < 5
            return
        probed = False
        async for chunk in stream:
            chunks.append(chunk)
            if not probed and time.monotonic() - start > 0.25:
                await stub.Embed(EMBED, timeout=10)  # past the age: on a new connection
                assert relay.connections == 2
                probed = True
        print(f"{tokens} tokens in {time.monotonic() - start:.2f} s, connection age 0.2 s")
        assert probed, "the stream did not outlive its connection's age"
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert chunks[-1].usage.completion_tokens == tokens
        assert sum(len(c.token_ids) for c in chunks) == tokens


async def test_a_stopping_service_finishes_open_streams_and_refuses_new_calls(
    tiny_embed_dir, tiny_lm_dir
) -> None:
    """stop(grace) sends GOAWAY: the open stream ends whole, a new call on the same channel
    fails at once with UNAVAILABLE (it does not wait for the drain), and the stop returns
    when the stream has ended, long before the grace."""
    args = tiny_args(tiny_embed_dir, tiny_lm_dir, "--max-new-tokens", "512")
    async with serving(args, warm=True) as (service, c):
        stream = c.inference.GenerateStream(long_stream(512), timeout=60)
        chunks = [await stream.read()]
        stopping = asyncio.create_task(service.stop(30))
        await asyncio.sleep(0.1)  # the GOAWAY is sent
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await c.inference.Embed(EMBED, timeout=20)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        assert time.monotonic() - started < 5
        assert not stopping.done(), "the stop did not wait for the open stream"
        while (chunk := await stream.read()) != grpc.aio.EOF:
            chunks.append(chunk)
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert sum(len(chunk.token_ids) for chunk in chunks) == 512
        await asyncio.wait_for(stopping, 10)
