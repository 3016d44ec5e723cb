"""Load and soak: many concurrent clients on a real service, bounded in time, loopback only.

    .venv/bin/python bench/load.py                     # 64 clients, 120 s, mode none
    .venv/bin/python bench/load.py --clients 16 --seconds 60
    .venv/bin/python bench/load.py --quick --embed-model DIR --lm-model DIR   # smoke run

Starts inference-svc (packaged models) and warmup-ctl --once, then drives a mix from
--clients concurrent clients until --seconds pass: Embed (40 %), Generate (30 %),
GenerateStream (20 %, a third of them cancelled after the first chunk) and health checks
(10 %), each call with a deadline. Prints per RPC: calls, status codes, p50 / p99 latency;
the service's RSS in the first and the last 20 % of the run and its growth; and, after the
callers stop, the queue depth and rows in use from /metrics (both must return to 0).
Asserts nothing: read the table.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inference_api.stubs.inference.v1 import inference_pb2 as pb
from inference_api.stubs.inference.v1 import inference_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import add_quick_flags, model_args
from harness.procs import running_service

TEXTS = ["The quick brown fox", "jumps over the lazy dog", "A KV cache holds keys and values"]
CHAT = pb.GenerateRequest(
    messages=[pb.ChatMessage(role="user", content="Name a colour.")],
    sampling=pb.SamplingParams(max_tokens=16),
)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def gauge(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(
        float(ln.rsplit(" ", 1)[1])
        for ln in text.splitlines()
        if ln.startswith((name + "{", name + " "))
    )


class Load:
    def __init__(self, channel: grpc.aio.Channel, seed: int) -> None:
        self.stub = inference_pb2_grpc.InferenceStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)
        self.rng = random.Random(seed)
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.codes: dict[str, Counter[str]] = defaultdict(Counter)

    async def one(self) -> None:
        r = self.rng.random()
        start = time.perf_counter()
        try:
            if r < 0.4:
                rpc = "Embed"
                await self.stub.Embed(pb.EmbedRequest(inputs=self.rng.sample(TEXTS, 2)), timeout=60)
            elif r < 0.7:
                rpc = "Generate"
                await self.stub.Generate(CHAT, timeout=120)
            elif r < 0.9:
                rpc = "GenerateStream"
                call = self.stub.GenerateStream(CHAT, timeout=120)
                cancel = self.rng.random() < 1 / 3
                async for _chunk in call:
                    if cancel:
                        call.cancel()
                        break
                if cancel:
                    rpc = "GenerateStream (cancelled)"
            else:
                rpc = "Health"
                req = health_pb2.HealthCheckRequest(service="inference.v1.Inference")
                await self.health.Check(req, timeout=10)
            self.codes[rpc]["OK"] += 1
        except grpc.aio.AioRpcError as e:
            self.codes[rpc][e.code().name] += 1
        self.latency[rpc].append(time.perf_counter() - start)

    async def client(self, until: float) -> None:
        while time.monotonic() < until:
            await self.one()


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


async def drive(args: argparse.Namespace, ports: dict, pid: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{ports['port']}") as channel:
        load = Load(channel, seed=7)
        start = time.monotonic()
        until = start + args.seconds
        samples: list[tuple[float, int]] = []

        async def sample_rss() -> None:
            while time.monotonic() < until:
                samples.append((time.monotonic() - start, rss_kib(pid)))
                await asyncio.sleep(1)

        await asyncio.gather(sample_rss(), *(load.client(until) for _ in range(args.clients)))
    await asyncio.sleep(2)
    print(f"\n{args.clients} clients, {args.seconds} s, mode {args.mode}\n")
    print("| rpc | calls | codes | p50 | p99 |\n|---|---:|---|---:|---:|")
    for rpc in sorted(load.latency):
        lat = load.latency[rpc]
        codes = ", ".join(f"{k} {v}" for k, v in load.codes[rpc].most_common())
        print(f"| {rpc} | {len(lat)} | {codes} | {pct(lat, 0.5) * 1000:.0f} ms | "
              f"{pct(lat, 0.99) * 1000:.0f} ms |")  # fmt: skip
    fifth = args.seconds / 5
    first = [r for t, r in samples if t <= fifth]
    last = [r for t, r in samples if t >= args.seconds - fifth]
    if first and last:
        a, b = sum(first) / len(first), sum(last) / len(last)
        print(f"\nservice RSS: first 20 % {a / 1024:.0f} MiB, last 20 % {b / 1024:.0f} MiB, "
              f"growth {100 * (b - a) / a:+.1f} %")  # fmt: skip
    port = ports["metrics_port"]
    print(f"after the run: queue depth {gauge(port, 'inference_queue_depth'):.0f}, "
          f"rows in use {gauge(port, 'inference_rows_in_use'):.0f}, late compiles "
          f"{gauge(port, 'inference_late_compile_events_total'):.0f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--mode", default="none", help="the service's --compilation-mode")
    add_quick_flags(p)
    args = p.parse_args(argv)
    if args.quick:
        args.clients, args.seconds = 4, 3.0
    tmp = args.results or Path(tempfile.mkdtemp(prefix="load-"))  # the service's log
    args_svc = [
        *model_args(args),
        "--metrics-port",
        "0",
        "--metrics-host",
        "127.0.0.1",
        "--compilation-mode",
        args.mode,
    ]
    with running_service(args_svc, tmp) as svc:
        ports = {"port": svc.port, "metrics_port": svc.metrics_port}
        asyncio.run(drive(args, ports, svc.pid))
        log = svc.log
    print(f"service log: {log}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
