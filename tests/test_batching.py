"""Continuous batching on the tiny LM: requests join and leave a running batch between
two decode steps; tokens do not depend on who else is in the batch or when a request
joined; a cancelled stream frees its row; requests only ever run shapes Describe lists."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from inference_api.convert import bucket_from_pb
from inference_api.plan import Bucket
from inference_api.stubs.inference.v1 import admin_pb2 as apb
from inference_api.stubs.inference.v1 import inference_pb2 as pb
from tests.conftest import tiny_args
from tests.rpc import serving

pytestmark = pytest.mark.rpc

ROWS = 8


def request(words: int, seed: int | None = None, tokens: int = 24, **kw) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=tokens, **kw)
    if seed is not None:
        sampling.temperature = sampling.temperature or 0.9
        sampling.seed = seed
    return pb.GenerateRequest(prompt=" ".join(["word"] * words), sampling=sampling)


async def tokens_of(c, req: pb.GenerateRequest) -> list[int]:
    return [t async for chunk in c.inference.GenerateStream(req) for t in chunk.token_ids]


async def until_tokens(stream, n: int) -> list[int]:
    """Read a running stream until it has sent ``n`` tokens."""
    got: list[int] = []
    while len(got) < n:
        got.extend((await stream.read()).token_ids)
    return got


@pytest.fixture(scope="module")
async def svc(tiny_embed_dir, tiny_lm_dir):
    args = tiny_args(tiny_embed_dir, tiny_lm_dir, "--max-new-tokens", "48",
                     "--gen-max-batch", str(ROWS), "--prefill-chunk-tokens", "16")  # fmt: skip
    async with serving(args, warm=True) as served:
        yield served


def background(i: int) -> pb.GenerateRequest:
    """Unseeded random and greedy rows of several prompt lengths (one prefills in chunks)."""
    kinds = [{"temperature": 0.8, "top_k": 20}, {}, {"temperature": 1.0, "logprobs": 2}]
    return request(3 + 7 * i, tokens=40, **kinds[i % len(kinds)])


@pytest.mark.parametrize("join_after", [0, 1, 5, 17])
async def test_seeded_and_greedy_tokens_do_not_depend_on_when_they_join(svc, join_after):
    _service, c = svc
    seeded, greedy = request(6, seed=42), request(9)
    alone = [await tokens_of(c, seeded), await tokens_of(c, greedy)]
    streams = [c.inference.GenerateStream(background(i)) for i in range(3)]
    await asyncio.gather(*(until_tokens(s, join_after) for s in streams))
    joined = await asyncio.gather(tokens_of(c, seeded), tokens_of(c, greedy))
    assert joined == alone
    for s in streams:
        s.cancel()


async def test_unseeded_tokens_do_not_depend_on_greedy_neighbours_or_free_rows(svc):
    """An unseeded request draws from the global generator; greedy rows, padding rows and
    free rows draw nothing, so after the same Reseed it gets the same tokens beside three
    running greedy streams (in row 3 of a 4-row step) as alone (row 0 of a 1-row step)."""
    _service, c = svc
    unseeded = request(5, tokens=12, temperature=0.9, top_k=50)
    await c.admin.Reseed(apb.ReseedRequest(seed=77, rewarm=True))
    alone = await tokens_of(c, unseeded)
    await c.admin.Reseed(apb.ReseedRequest(seed=77, rewarm=True))
    streams = [c.inference.GenerateStream(request(3 + i, tokens=40)) for i in range(3)]
    await asyncio.gather(*(until_tokens(s, 2) for s in streams))
    beside = await tokens_of(c, unseeded)
    for s in streams:
        s.cancel()
    assert beside == alone


async def test_a_full_batch_gives_each_row_its_own_tokens(svc):
    _service, c = svc
    reqs = [request(2 + 3 * i, seed=100 + i) for i in range(ROWS)]
    alone = [await tokens_of(c, r) for r in reqs]
    together = await asyncio.gather(*(tokens_of(c, r) for r in reqs))
    assert together == alone
    assert len({tuple(t) for t in alone}) == ROWS  # the seeds do differ


async def test_a_request_joins_a_running_batch_and_leaves_first(svc):
    """A short request sent while a long one decodes gets its answer before the long one
    ends: it does not wait for the running batch."""
    _service, c = svc
    long = c.inference.GenerateStream(request(4, tokens=48))
    await until_tokens(long, 2)
    short = await c.inference.Generate(request(5, tokens=2))
    assert short.usage.completion_tokens == 2
    rest = []
    while (chunk := await long.read()) is not grpc.aio.EOF:
        rest.extend(chunk.token_ids)
    assert len(rest) > 10, "the long stream ended before the short one: nothing overlapped"


async def test_cancelled_streams_free_their_rows(svc):
    service, c = svc
    worker = service.engine.runtimes["generative"].inbox
    streams = [c.inference.GenerateStream(request(4, tokens=48)) for _ in range(ROWS)]
    await asyncio.gather(*(until_tokens(s, 1) for s in streams))
    assert worker.rows_in_use == ROWS
    for s in streams:
        s.cancel()
    for _ in range(200):
        if worker.rows_in_use == 0 and worker.depth() == 0:
            break
        await asyncio.sleep(0.02)
    assert worker.rows_in_use == 0 and worker.depth() == 0
    replies = await asyncio.gather(
        *(c.inference.Generate(request(3, tokens=4)) for _ in range(ROWS))
    )
    assert all(r.usage.completion_tokens == 4 for r in replies)


async def test_expired_deadline_frees_the_row(svc):
    service, c = svc
    worker = service.engine.runtimes["generative"].inbox
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await c.inference.Generate(request(4, tokens=48), timeout=0.05)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    for _ in range(200):
        if worker.rows_in_use == 0:
            break
        await asyncio.sleep(0.02)
    assert worker.rows_in_use == 0


async def mixed_arrivals(
    c, rng: random.Random, n: int, max_words: int, max_tokens: int = 40
) -> None:
    """Random prompt lengths, sampler paths and arrival times; some streams cancelled."""

    async def one(i: int) -> None:
        await asyncio.sleep(rng.random() * 0.5)
        kind = rng.choice([{}, {"temperature": 0.7}, {"temperature": 0.9, "logprobs": 3},
                           {"temperature": 0.8, "top_p": 0.9}])  # fmt: skip
        seed = rng.choice([None, i])
        req = request(
            rng.randint(1, max_words), seed=seed, tokens=rng.randint(1, max_tokens), **kind
        )
        if rng.random() < 0.2:
            stream = c.inference.GenerateStream(req)
            await stream.read()
            stream.cancel()
        else:
            await c.inference.Generate(req)

    await asyncio.gather(*(one(i) for i in range(n)))


async def shapes_ran_and_listed(service, c) -> tuple[set[Bucket], set[Bucket]]:
    """The shapes requests ran on the generative model, and the buckets Describe lists."""
    described = await c.admin.Describe(apb.DescribeRequest())
    profile = next(m for m in described.models if m.name == "generative")
    ran = service.engine.runtimes["generative"].runner.request_shapes
    return set(ran), {bucket_from_pb(b) for b in profile.buckets}


async def test_requests_only_run_shapes_describe_lists(svc):
    service, c = svc
    await mixed_arrivals(c, random.Random(3), 40, max_words=30)
    ran, listed = await shapes_ran_and_listed(service, c)
    assert ran and ran <= listed, sorted(map(str, ran - listed))
