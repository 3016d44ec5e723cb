"""Embed load as clients make it: N concurrent gRPC clients, each one short text per call
(closed loop), and the same texts in process through sentence-transformers at batch 32.
Shared by bench/compiled.py; run alone against a running service, or without --target
on a service of its own (packaged models, or --embed-model DIR):

    python bench/embed_load.py --target 127.0.0.1:50051 --clients 32
    python bench/embed_load.py --quick --embed-model DIR   # smoke run: 1 and 4 clients, 1 s
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

from inference_api.stubs.inference.v1 import inference_pb2 as pb
from inference_api.stubs.inference.v1 import inference_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import add_quick_flags, model_args
from harness.procs import running_service

WORDS = [
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "while",
    "a",
    "model",
    "serves",
    "many",
    "small",
    "requests",
]


def text(i: int) -> str:
    """A short sentence (10-14 tokens), different per call."""
    return f"request {i}: " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(6 + i % 4))


async def clients(target: str, n: int, seconds: float) -> dict:
    """``n`` clients, one text per Embed call each, for ``seconds``: texts/s and latency."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        await stub.Embed(pb.EmbedRequest(inputs=["not measured"]))
        latencies: list[float] = []
        stop = time.perf_counter() + seconds

        async def client(c: int) -> None:
            i = c
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                await stub.Embed(pb.EmbedRequest(inputs=[text(i)]))
                latencies.append(time.perf_counter() - t0)
                i += n

        start = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(n)))
        wall = time.perf_counter() - start
    ordered = sorted(latencies)
    return {
        "clients": n,
        "texts_s": len(latencies) / wall,
        "p50_ms": 1e3 * statistics.median(ordered),
        "p99_ms": 1e3 * ordered[int(0.99 * (len(ordered) - 1))],
    }


def sentence_transformers_batch(batch: int = 32, seconds: float = 10.0) -> float:
    """Texts/s of sentence-transformers in this process at ``batch`` on the same texts."""
    import torch
    from sentence_transformers import SentenceTransformer

    from inference_svc.models.loading import offline, resolve_embed_dir

    offline()
    torch.set_num_threads(torch.get_num_threads())
    model = SentenceTransformer(str(resolve_embed_dir("default")), device="cpu")
    texts = [text(i) for i in range(batch)]
    model.encode(texts, batch_size=batch)
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        model.encode(texts, batch_size=batch)
        done += batch
    return done / (time.perf_counter() - start)


def run(target: str, counts: list[int], seconds: float) -> None:
    """The load of each client count in turn, one table row each."""
    print("| clients | texts/s | p50 (ms) | p99 (ms) |\n|---:|---:|---:|---:|")
    for n in counts:
        r = asyncio.run(clients(target, n, seconds))
        print(f"| {n} | {r['texts_s']:.1f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", help="a running service (default: start one, --lm-model none)")
    p.add_argument("--clients", default="32", help="client counts, e.g. 1,32")
    p.add_argument("--seconds", type=float, default=15.0)
    add_quick_flags(p)
    a = p.parse_args(argv)
    if a.quick:
        a.clients, a.seconds = "1,4", 1.0
    counts = [int(n) for n in a.clients.split(",")]
    if a.target:
        run(a.target, counts, a.seconds)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        args = [*model_args(a), "--lm-model", "none"]
        with running_service(args, Path(tmp)) as svc:
            run(svc.target, counts, a.seconds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
