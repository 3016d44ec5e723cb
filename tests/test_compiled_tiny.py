"""Compiled mode on tiny models: warmup covers every path, so requests after SERVING
cause zero compile events; compiled results equal eager ones; seeds survive restarts."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
import torch

from inference_api.stubs.inference.v1 import admin_pb2 as apb
from inference_api.stubs.inference.v1 import inference_pb2 as pb
from tests.conftest import TORCH_COMPILE, tiny_args
from tests.rpc import serving
from tests.test_batching import mixed_arrivals, shapes_ran_and_listed

pytestmark = pytest.mark.rpc

TEXTS = ["a b c", "hello there, how are you today?", "x" * 40]


def requests_over_buckets() -> list[pb.GenerateRequest]:
    """Greedy, random, seeded and logprobs requests over several prompt lengths."""
    out = []
    for i, words in enumerate((1, 5, 12, 20)):
        prompt = " ".join(["word"] * words)
        sampling = [
            pb.SamplingParams(max_tokens=6),
            pb.SamplingParams(temperature=0.7, top_k=20, max_tokens=6),
            pb.SamplingParams(temperature=1.0, top_p=0.8, seed=5 + i, max_tokens=6),
            pb.SamplingParams(temperature=0.5, logprobs=2, max_tokens=6),
        ][i]
        out.append(pb.GenerateRequest(prompt=prompt, sampling=sampling))
    return out


async def run_workload(c) -> tuple[list[list[float]], list[list[int]]]:
    vectors = []
    for n in (1, 2, 3):
        reply = await c.inference.Embed(pb.EmbedRequest(inputs=TEXTS[:n]))
        vectors = [list(e.values) for e in reply.embeddings]
    reqs = requests_over_buckets()
    alone = [await c.inference.Generate(r) for r in reqs]
    together = await asyncio.gather(*(c.inference.Generate(r) for r in reqs))
    chunks = [x async for x in c.inference.GenerateStream(reqs[2])]
    assert [t for x in chunks for t in x.token_ids] == list(alone[2].token_ids)
    # Seeded (index 2) and greedy (index 0) rows do not depend on the batch.
    for i in (0, 2):
        assert list(together[i].token_ids) == list(alone[i].token_ids)
    return vectors, [list(r.token_ids) for r in alone[:1] + alone[2:3]]


@pytest.fixture(scope="module")
async def eager_results(tiny_embed_dir, tiny_lm_dir):
    async with serving(tiny_args(tiny_embed_dir, tiny_lm_dir), warm=True) as (_service, c):
        return await run_workload(c)


async def random_arrivals_compile_nothing(service, c, seed: int, count: int) -> None:
    """Random arrivals (prompt lengths 1 to the limit, joins at any step, cancellations)
    after SERVING: 0 late compiles, and only the shapes Describe listed ran."""
    await mixed_arrivals(c, random.Random(seed), count, max_words=30, max_tokens=16)
    info = await c.inference.Info(pb.InfoRequest())
    assert info.late_compile_events == 0, info
    ran, listed = await shapes_ran_and_listed(service, c)
    assert ran <= listed, sorted(map(str, ran - listed))


async def serves_like_eager(service, c, eager_results) -> None:
    """The workload and random arrivals after SERVING: 0 late compiles, only the shapes
    Describe listed, and the eager service's vectors and tokens."""
    vectors, tokens = await run_workload(c)
    await random_arrivals_compile_nothing(service, c, seed=11, count=32)
    eager_vectors, eager_tokens = eager_results
    assert torch.allclose(torch.tensor(vectors), torch.tensor(eager_vectors), atol=1e-4)
    assert tokens == eager_tokens


async def test_compiled_mode_has_no_late_compiles(tiny_embed_dir, tiny_lm_dir, eager_results):
    # Counts compile events: graphs another test compiled in this process would not count.
    torch._dynamo.reset()
    args = tiny_args(tiny_embed_dir, tiny_lm_dir, "--compilation-mode", "default", *TORCH_COMPILE)
    async with serving(args, loaded=True) as (service, c):
        described = await c.admin.Describe(apb.DescribeRequest())
        kinds = [(s.step, s.model) for s in described.required_steps]
        assert (apb.WARMUP_STEP_KIND_COMPILE, "embedding") in kinds  # no KV cache: compiled anyway
        reports = await c.warm_and_serve()
        events = {(r.step, r.model): r.compile_events for r in reports}
        # One graph per function for every bucket: PROFILE compiles prefill and decode at
        # their largest shapes, COMPILE runs the other buckets through those graphs; more
        # would mean a bucket recompiled (a guard on a size).
        assert events[(apb.WARMUP_STEP_KIND_PROFILE, "generative")] == 2
        assert events[(apb.WARMUP_STEP_KIND_COMPILE, "generative")] == 0
        assert events[(apb.WARMUP_STEP_KIND_COMPILE, "embedding")] == 1
        sampler = next(r for r in reports if r.step == apb.WARMUP_STEP_KIND_SAMPLER)
        assert apb.SAMPLER_PATH_SEEDED in sampler.sampler_paths
        # Idempotent: a second COMPILE finds nothing left to do.
        again = await c.admin.Warmup(
            apb.WarmupRequest(model="generative", step=apb.WARMUP_STEP_KIND_COMPILE)
        )
        assert again.skipped and "already compiled" in again.skip_reason

        await serves_like_eager(service, c, eager_results)


async def test_seeded_tokens_survive_a_restart(tiny_embed_dir, tiny_lm_dir, eager_results):
    async with serving(tiny_args(tiny_embed_dir, tiny_lm_dir), warm=True) as (_service, c):
        req = requests_over_buckets()[2]
        reply = await c.inference.Generate(req)
        assert list(reply.token_ids) == eager_results[1][1]


async def test_a_model_kind_not_loaded_is_invalid_argument(tiny_embed_dir, tiny_lm_dir):
    args = [*tiny_args(tiny_embed_dir, tiny_lm_dir), "--lm-model", "none"]
    async with serving(args, warm=True) as (_service, c):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await c.inference.Generate(pb.GenerateRequest(prompt="hi"))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "no model that answers Generate is loaded" in info.value.details()
        reply = await c.inference.Embed(pb.EmbedRequest(inputs=["still embeds"]))
        assert len(reply.embeddings) == 1


async def test_freeze_weights_on_freezes_the_graphs(
    tiny_embed_dir, tiny_lm_dir, eager_results, monkeypatch
):
    """--freeze-weights on: inductor's freezing pass runs for every graph (the weights
    become constants), the warmup still leaves 0 late compiles, and the results are eager's."""
    from torch._inductor import freezing

    frozen = []
    real_freeze = freezing.freeze

    def spy(*args, **kwargs):
        frozen.append(1)
        return real_freeze(*args, **kwargs)

    monkeypatch.setattr(freezing, "freeze", spy)
    # Graphs an earlier service of this test process compiled would be reused: Dynamo's
    # guards do not cover inductor's config (one process serves one configuration).
    torch._dynamo.reset()
    args = tiny_args(
        tiny_embed_dir,
        tiny_lm_dir,
        "--compilation-mode",
        "default",
        "--freeze-weights",
        "on",
        *TORCH_COMPILE,
    )
    async with serving(args, loaded=True) as (service, c):
        reports = await c.warm_and_serve()
        compiled = sum(r.compile_events for r in reports)
        assert compiled >= 3 and len(frozen) >= 3, (compiled, len(frozen))
        await serves_like_eager(service, c, eager_results)


@pytest.mark.slow  # autotunes every linear layer: about 100 s on 2 cores
async def test_max_autotune_frozen_bf16_linears_leaves_no_late_compiles(
    tiny_embed_dir, tiny_lm_dir, eager_results
):
    """The fastest Generate configuration measured (bench/compiled.py), with the default
    backend (AOTInductor packages on a CPU): max-autotune picks among inductor's own GEMM
    templates and oneDNN for every linear layer of the frozen packages. The warmup still
    covers every path (0 late compiles, only Describe's shapes); Embed stays float32, so
    its vectors are eager's; bfloat16 linears change the tokens, so those are not compared."""
    torch._dynamo.reset()  # see test_freeze_weights_on_freezes_the_graphs
    args = tiny_args(tiny_embed_dir, tiny_lm_dir, "--compilation-mode", "max-autotune",
                     "--freeze-weights", "on", "--lm-weights", "bfloat16")  # fmt: skip
    try:
        async with serving(args, loaded=True) as (service, c):
            reports = await c.warm_and_serve()
            assert sum(r.compile_events for r in reports) >= 3
            described = await c.admin.Describe(apb.DescribeRequest())
            assert [m.backend for m in described.models] == ["aoti", "aoti"], described
            vectors, tokens = await run_workload(c)
            await random_arrivals_compile_nothing(service, c, seed=12, count=16)
            assert torch.allclose(torch.tensor(vectors), torch.tensor(eager_results[0]), atol=1e-3)
            assert all(tokens)
    finally:
        torch._dynamo.reset()
