"""Closed-loop gRPC clients through one address (a balancer), every call recorded: which rpc,
when it started and ended, its status, whether a stream had begun, and which replica answered
(read from a reply header the balancer adds, when it adds one).

    load = Load("127.0.0.1:8080", clients=32)   # client i runs KINDS[i % 4], in a thread
    Load(dns_target, options=channel_options())  # or balanced by the client itself
    load.start(); ...; load.stop()
    load.failed(t0, "Embed")                    # calls started since t0 that failed
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from harness.replicas import UPSTREAM_HEADER
from inference_api.resets import aio_interceptors
from inference_api.stubs.inference.v1 import inference_pb2 as pb
from inference_api.stubs.inference.v1 import inference_pb2_grpc

KINDS = ("Embed", "Embed", "Generate", "GenerateStream")
EMBED = pb.EmbedRequest(inputs=["spread me over the replicas"])
# No stop string a tiny model writes: every stream is exactly max_tokens long.
STREAM = pb.GenerateRequest(
    prompt="hello", sampling=pb.SamplingParams(max_tokens=12, stop=["\u2603"])
)
GENERATE = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=4))


@dataclass
class Call:
    rpc: str
    start: float
    end: float | None = None
    code: grpc.StatusCode | None = None
    began: bool = False  # a stream: its first chunk came
    began_at: float = 0.0
    upstream: str = ""  # the replica that answered (the loopback config's reply header)
    details: str = ""  # a failed call's message


class Load(threading.Thread):
    """``clients`` closed-loop clients on one channel, in a thread of their own."""

    def __init__(
        self, target: str, clients: int = 32, options: Sequence[tuple[str, Any]] = ()
    ) -> None:
        """``options``: the channel's arguments (client-side balancing needs
        inference_api.channel's)."""
        super().__init__(daemon=True)
        self.target, self.clients, self.options = target, clients, list(options)
        self.calls: list[Call] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        async with grpc.aio.insecure_channel(
            self.target, options=self.options, interceptors=aio_interceptors()
        ) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            await asyncio.gather(*(self._client(stub, KINDS[i % 4]) for i in range(self.clients)))

    async def _client(self, stub: inference_pb2_grpc.InferenceStub, rpc: str) -> None:
        while not self.stopped.is_set():
            call = Call(rpc, time.monotonic())
            self.calls.append(call)
            try:
                if rpc == "GenerateStream":
                    stream = stub.GenerateStream(STREAM, timeout=30)
                    async for _ in stream:
                        if not call.began:
                            call.upstream = upstream(await stream.initial_metadata())
                            call.began, call.began_at = True, time.monotonic()
                else:
                    method, request = (
                        (stub.Embed, EMBED) if rpc == "Embed" else (stub.Generate, GENERATE)
                    )
                    unary = method(request, timeout=30)
                    await unary
                    call.upstream = upstream(await unary.initial_metadata())
                call.code = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as err:
                call.code, call.details = err.code(), err.details() or ""
            call.end = time.monotonic()

    def since(self, t0: float, rpc: str | None = None) -> list[Call]:
        """Calls started at or after ``t0`` (of one rpc), ended or not."""
        return [c for c in list(self.calls) if c.start >= t0 and rpc in (None, c.rpc)]

    def failed(self, t0: float, rpc: str) -> list[Call]:
        return [
            c for c in self.since(t0, rpc) if c.end is not None and c.code != grpc.StatusCode.OK
        ]

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=60)


def upstream(metadata: Sequence[tuple[str, str]] | None) -> str:
    return dict(metadata or ()).get(UPSTREAM_HEADER, "")
