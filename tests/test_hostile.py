"""Hostile and careless clients against a real service (tiny models): one client's give-up
never costs another its answer, undecodable bytes and huge values get INVALID_ARGUMENT
naming what is wrong (quoted short), and tokenizing never runs on the event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio

from inference_api.stubs.inference.v1 import inference_pb2 as pb
from inference_svc.app import Service
from inference_svc.limits import MAX_TEXT_CHARS
from tests.conftest import tiny_args
from tests.rpc import Clients, serving

pytestmark = pytest.mark.rpc


@pytest_asyncio.fixture(scope="module")
async def served(tiny_embed_dir, tiny_lm_dir) -> AsyncIterator[tuple[Service, Clients]]:
    async with serving(tiny_args(tiny_embed_dir, tiny_lm_dir), warm=True) as served:
        yield served


async def rpc_error(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


async def test_a_cancelled_embed_never_costs_the_others_their_answer(served) -> None:
    service, c = served
    worker = service.engine.runtimes["embedding"].inbox
    for cancelled in range(4):  # the cancelled call at each place in the batch
        hold = threading.Event()
        blocker = worker.call(hold.wait)  # the model thread is busy: the calls queue up
        calls = [c.inference.Embed(pb.EmbedRequest(inputs=[f"text {i}"])) for i in range(4)]
        await asyncio.sleep(0.3)
        calls[cancelled].cancel()
        await asyncio.sleep(0.2)  # the cancel reaches the server while the job is queued
        hold.set()
        blocker.result(timeout=10)
        others = [call for i, call in enumerate(calls) if i != cancelled]
        replies = await asyncio.gather(*others)
        assert all(len(r.embeddings) == 1 for r in replies)
        with pytest.raises(asyncio.CancelledError):
            await calls[cancelled]


async def test_a_cancelled_stream_never_costs_the_others_their_answer(served) -> None:
    _, c = served
    req = pb.GenerateRequest(prompt="one two", sampling=pb.SamplingParams(max_tokens=8))
    stream = c.inference.GenerateStream(req)
    others = [c.inference.Generate(req) for _ in range(2)]
    await stream.read()
    stream.cancel()
    replies = await asyncio.gather(*others)
    assert all(r.usage.completion_tokens > 0 for r in replies)


UNDECODABLE = [
    (b"\x0a\x05ab", "truncated"),
    (b"\x0a\x02\xff\xfe", "invalid UTF-8 in a string field"),
    (b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", "garbage"),
]


@pytest.mark.parametrize("method", ["Embed", "Generate", "GenerateStream"])
async def test_undecodable_bytes_are_invalid_argument_naming_the_message(served, method) -> None:
    _, c = served
    path = f"/inference.v1.Inference/{method}"
    make = c.channel.unary_stream if method == "GenerateStream" else c.channel.unary_unary
    call = make(path, request_serializer=None, response_deserializer=None)
    expected = "EmbedRequest" if method == "Embed" else "GenerateRequest"
    for data, why in UNDECODABLE:
        if method == "GenerateStream":
            err = await rpc_error(call(data).read())
        else:
            err = await rpc_error(call(data))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, why
        assert f"not a valid inference.v1.{expected}" in err.details(), why
    # ...and the service goes on answering.
    reply = await c.inference.Embed(pb.EmbedRequest(inputs=["still here"]))
    assert len(reply.embeddings) == 1


async def test_a_huge_value_is_quoted_short(served) -> None:
    _, c = served
    role = "x" * 2**20
    req = pb.GenerateRequest(messages=[pb.ChatMessage(role=role, content="hi")])
    err = await rpc_error(c.inference.Generate(req))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "messages[0].role" in err.details() and f"({2**20} characters)" in err.details()
    assert len(err.details()) < 300


async def test_texts_past_the_limit_are_refused_before_tokenizing(served) -> None:
    _, c = served
    inputs = ["word " * (MAX_TEXT_CHARS // 5 + 1)] * 3
    err = await rpc_error(c.inference.Embed(pb.EmbedRequest(inputs=inputs)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"inputs[0]: {len(inputs[0])} characters; the limit is {MAX_TEXT_CHARS}" in (
        err.details()
    )
    err = await rpc_error(c.inference.Generate(pb.GenerateRequest(prompt=inputs[0])))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt:" in err.details()


async def test_a_request_past_the_size_limit_is_resource_exhausted(served) -> None:
    _, c = served
    inputs = ["x" * 2**20] * 5  # 5 MiB, past the default 4 MiB
    err = await rpc_error(c.inference.Embed(pb.EmbedRequest(inputs=inputs)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_tokenizing_runs_on_the_text_thread(served, monkeypatch) -> None:
    service, c = served
    seen: list[str] = []
    for runtime in service.engine.runtimes.values():
        prepare = runtime._prepare

        def spy(params, prepare=prepare):
            seen.append(threading.current_thread().name)
            return prepare(params)

        monkeypatch.setattr(runtime, "_prepare", spy)
    await c.inference.Embed(pb.EmbedRequest(inputs=["a text"]))
    await c.inference.Generate(pb.GenerateRequest(prompt="hi", sampling={"max_tokens": 2}))
    assert [name.rsplit("_", 1)[0] for name in seen] == ["text-embedding", "text-generative"]
