"""A GenerateStream reset mid-way by a proxy (RST_STREAM after a chunk, what Envoy sends when
the replica behind the stream dies) ends UNAVAILABLE for clients that use inference_api's
channel helpers, synchronous (inference-cli) and asyncio; a status the peer itself sent
(trailers with INTERNAL) is left as it is; without the interceptors gRPC says INTERNAL.

The peer is harness/h2_peer.py: raw HTTP/2 frames on loopback, no service needed."""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio
import pytest

from harness.h2_peer import RST_STREAM, H2Peer
from inference_api.channel import channel_options
from inference_api.resets import CUT_DETAILS, aio_interceptors, intercept
from inference_api.stubs.inference.v1 import inference_pb2 as pb
from inference_api.stubs.inference.v1 import inference_pb2_grpc

pytestmark = pytest.mark.rpc

CHUNK = pb.GenerateChunk(text="Once", token_ids=[7])
REQUEST = pb.GenerateRequest(prompt="hi")


def read_sync(target: str, wrapped: bool) -> tuple[list[pb.GenerateChunk], grpc.RpcError]:
    channel = grpc.insecure_channel(target, options=channel_options())
    with intercept(channel) if wrapped else channel as ch:
        stream = inference_pb2_grpc.InferenceStub(ch).GenerateStream(REQUEST, timeout=10)
        chunks = []
        with pytest.raises(grpc.RpcError) as caught:
            for chunk in stream:
                chunks.append(chunk)
        assert (stream.code(), stream.details()) == (caught.value.code(), caught.value.details())
        return chunks, caught.value


Status = tuple[grpc.StatusCode, str]


def read_aio(target: str, wrapped: bool) -> tuple[list[pb.GenerateChunk], Status]:
    async def main() -> tuple[list[pb.GenerateChunk], Status]:
        interceptors = aio_interceptors() if wrapped else None
        async with grpc.aio.insecure_channel(target, interceptors=interceptors) as ch:
            stream = inference_pb2_grpc.InferenceStub(ch).GenerateStream(REQUEST, timeout=10)
            chunks = []
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for chunk in stream:
                    chunks.append(chunk)
            status = (await stream.code(), await stream.details())
            assert status == (caught.value.code(), caught.value.details())
            return chunks, status

    return asyncio.run(main())


def test_a_stream_reset_by_a_proxy_ends_unavailable_sync() -> None:
    with H2Peer(CHUNK.SerializeToString(), end="reset") as peer:
        chunks, err = read_sync(peer.target, wrapped=True)
        raw_chunks, raw = read_sync(peer.target, wrapped=False)
    assert peer.frames_sent.count(RST_STREAM) == 2
    assert chunks == raw_chunks == [CHUNK]  # what came before the reset is delivered
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert err.details().startswith(CUT_DETAILS) and "RST_STREAM" in err.details()
    assert raw.code() == grpc.StatusCode.INTERNAL  # what gRPC itself says of a reset


def test_a_stream_reset_by_a_proxy_ends_unavailable_aio() -> None:
    with H2Peer(CHUNK.SerializeToString(), end="reset") as peer:
        chunks, (code, details) = read_aio(peer.target, wrapped=True)
        raw_chunks, (raw_code, _) = read_aio(peer.target, wrapped=False)
    assert chunks == raw_chunks == [CHUNK]
    assert code == grpc.StatusCode.UNAVAILABLE and details.startswith(CUT_DETAILS)
    assert raw_code == grpc.StatusCode.INTERNAL


@pytest.mark.parametrize("client", ["sync", "aio"])
def test_an_internal_status_sent_by_the_peer_is_left_alone(client: str) -> None:
    with H2Peer(CHUNK.SerializeToString(), end=(13, "boom")) as peer:
        if client == "sync":
            chunks, err = read_sync(peer.target, wrapped=True)
            code, details = err.code(), err.details()
        else:
            chunks, (code, details) = read_aio(peer.target, wrapped=True)
    assert chunks == [CHUNK]
    assert (code, details) == (grpc.StatusCode.INTERNAL, "boom")
