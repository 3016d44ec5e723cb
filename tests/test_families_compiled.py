"""The families compiled. torch.compile, in process: the runner warmed by the service's own
warmup plan (PROFILE at the largest shapes, then COMPILE over every bucket) gives
transformers' logits within 1e-4 and its 64 greedy tokens (tests/test_families.py's check)
with 0 compiles after the warmup, for one family per code path of the shared decoder.
AOTInductor, the whole service with --compile-backend aoti: both graphs exported, eager's
tokens, 0 late compiles, and its runner gives transformers' logits; a restart loads the
kept packages and compiles nothing."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from inference_api.plan import CompilationMode, LogprobsMode
from inference_svc.compile_monitor import CompileMonitor
from inference_svc.engine import warmup
from inference_svc.engine.buckets import GenBuckets
from inference_svc.engine.runner import GenerateRunner
from inference_svc.models.compile import ModelContext
from inference_svc.models.generative import load_generative
from inference_svc.sampling import Sampler
from tests.test_families import LIMITS, build, equals_transformers
from tests.test_families import tokenizer as tokenizer  # the fixture

pytestmark = pytest.mark.rpc
DEFAULT = CompilationMode.DEFAULT
# The decoder's code paths, one family each: partial rotary and longrope tables, fused
# projections split (phi3-longrope); q/k norms (qwen3); a second rope table for the local
# layers, (1 + w) q/k norms, sandwich norms, a GELU gate, a window on every other layer
# (gemma3_text); capped scores by explicit attention math, a capped final logit (gemma2); a
# window on every layer (mistral-window); biases on q/k/v/o and the MLP (llama-biases).
# The llama3/yarn/dynamic ropes differ only in their inv_freq table, a buffer.
TORCH_COMPILE = ["phi3-longrope", "qwen3", "gemma3_text", "gemma2", "mistral-window",
                 "llama-biases"]  # fmt: skip
# One layer where a family's layers are all alike (the compile's time grows with the layers);
# two where a local layer and a global one differ (Gemma)
LAYERS = {"gemma3_text": 2}


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Every family compiles its own graphs: none of an earlier model is reused (nor counts
    against Dynamo's recompile limit)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def warmed(directory: Path) -> GenerateRunner:
    """The runner compiled as the service builds it, warmed by its PROFILE and COMPILE steps,
    its monitor then counting any compile as late (as after SERVING)."""
    monitor = CompileMonitor()
    ctx = ModelContext("lm", DEFAULT, monitor, torch.device("cpu"), torch.float32)
    with torch.inference_mode():  # loaded, warmed and run as on the service's compute thread
        model = load_generative(ctx, directory, LIMITS)
    buckets = GenBuckets.plan(LIMITS, DEFAULT)
    runner = GenerateRunner(model, Sampler("lm", DEFAULT, monitor), LogprobsMode.RAW, buckets)
    compiled: set = set()
    with torch.inference_mode():
        warmup.profile(runner, 0.5, compiled, monitor)
        report = warmup.compile_buckets("lm", DEFAULT, runner.buckets.all(), compiled,
                                        runner.run_shape, monitor)  # fmt: skip
    assert runner.buckets.rows == 2 and set(runner.buckets.all()) <= compiled, report
    assert monitor.total >= 2  # prefill and decode compiled (no eager fallback unnoticed)
    monitor.mark_serving()
    return runner


@pytest.mark.parametrize("family", TORCH_COMPILE)
def test_torch_compile_gives_transformers_logits_with_no_late_compile(
    family, tokenizer, tmp_path, fresh_dynamo
) -> None:
    directory = build(tmp_path, family, tokenizer, num_hidden_layers=LAYERS.get(family, 1))
    runner = warmed(directory)
    try:
        equals_transformers(runner, directory)
        assert runner.model.monitor.late == 0
    finally:
        runner.model.monitor.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", ["gemma2", "phi3-longrope"])
async def test_aoti_serves_eagers_tokens_and_transformers_logits(family, tokenizer, tmp_path):
    """The service with --compile-backend aoti: both graphs exported (no fallback), the
    packages within 1e-4 of eager where warmup checks them, 0 late compiles under random
    arrivals, eager's greedy and seeded tokens, and its runner gives transformers' logits.
    A restart loads the family's kept packages: 0 compile events, eager's tokens again."""
    from inference_api.stubs.inference.v1 import inference_pb2 as pb
    from tests.rpc import serving
    from tests.test_aoti import AOTI, _proof_diffs, described
    from tests.test_compiled_tiny import random_arrivals_compile_nothing

    directory = build(tmp_path / family, family, tokenizer, num_hidden_layers=LAYERS.get(family, 1))
    args = ["--port", "0", "--admin-port", "0", "--embed-model", "none", "--lm-model",
            str(directory), "--compile-cache-dir", str(tmp_path / "kept"),
            "--gen-max-batch", str(LIMITS.max_batch),
            "--max-input-tokens", str(LIMITS.max_input_tokens),
            "--max-new-tokens", str(LIMITS.max_new_tokens),
            "--prefill-chunk-tokens", str(LIMITS.prefill_chunk)]  # fmt: skip
    reqs = [
        pb.GenerateRequest(prompt="the quick brown fox", sampling=pb.SamplingParams(max_tokens=16)),
        pb.GenerateRequest(
            prompt=" ".join("abcdefghijklmnopqrstuvwxyz"),  # two chunks
            sampling=pb.SamplingParams(temperature=0.9, seed=3, max_tokens=16),
        ),
    ]
    tokens = {}
    for backend in ("eager", "aoti"):
        mode = AOTI if backend == "aoti" else ()
        async with serving([*args, *mode], warm=True) as (service, c):
            tokens[backend] = [list((await c.inference.Generate(r)).token_ids) for r in reqs]
            if backend == "eager":
                continue
            m = (await described(c))["generative"]
            assert m.backend == "aoti", m.backend  # exported, no fallback to torch.compile
            assert max(_proof_diffs(m.proof)) < 1e-4, m.proof
            await random_arrivals_compile_nothing(service, c, seed=5, count=12)
            runner = service.engine.runtimes["generative"].runner  # on its compute thread:
            parity = functools.partial(equals_transformers, runner, directory)
            await asyncio.wrap_future(service.engine.compute.run(parity))
            assert (await c.inference.Info(pb.InfoRequest())).late_compile_events == 0
    assert tokens["aoti"] == tokens["eager"]

    async with serving([*args, *AOTI], loaded=True) as (service, c):  # a restart
        reports = await c.warm_and_serve()
        assert [r.compile_events for r in reports] == [0] * len(reports), reports
        m = (await described(c))["generative"]
        assert m.backend == "aoti" and m.artifacts == "loaded", m
        assert max(_proof_diffs(m.proof)) < 1e-4, m.proof
        restarted = [list((await c.inference.Generate(r)).token_ids) for r in reqs]
    assert restarted == tokens["eager"]
