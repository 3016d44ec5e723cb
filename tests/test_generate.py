"""Generate on the real SmolLM2-135M-Instruct: greedy against transformers, streaming,
seeded reproducibility, logprobs, stop strings, and the errors."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from inference_api.stubs.inference.v1 import inference_pb2 as pb
from tests.models import packaged_reference_lm, packaged_tokenizer

pytestmark = pytest.mark.rpc

CHAT = [pb.ChatMessage(role="user", content="Write one sentence about the sea.")]
PROMPT = "The three primary colours are"


def greedy(max_tokens: int = 24, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def sampled(seed: int | None = None, max_tokens: int = 16) -> pb.SamplingParams:
    params = pb.SamplingParams(temperature=0.9, top_k=50, top_p=0.95, max_tokens=max_tokens)
    if seed is not None:
        params.seed = seed
    return params


@pytest.fixture(scope="module")
def reference():
    return packaged_reference_lm(), packaged_tokenizer()


def reference_greedy(reference, ids: list[int], n: int) -> list[int]:
    model, tokenizer = reference
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    new = out[0, len(ids) :].tolist()
    eos = tokenizer.eos_token_id
    return new[: new.index(eos)] if eos in new else new


async def test_greedy_matches_reference_decoding(real, reference):
    _model, tokenizer = reference
    reply = await real.inference.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=greedy()))
    ids = tokenizer(PROMPT)["input_ids"]
    assert list(reply.token_ids) == reference_greedy(reference, ids, 24)
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens == len(reply.token_ids)
    assert reply.text == tokenizer.decode(list(reply.token_ids), skip_special_tokens=True)


async def test_chat_greedy_matches_reference_and_ends_on_eos(real, reference):
    _model, tokenizer = reference
    req = pb.GenerateRequest(messages=CHAT, sampling=greedy(96))
    reply = await real.inference.Generate(req)
    msgs = [{"role": m.role, "content": m.content} for m in CHAT]
    ids = list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"])
    assert list(reply.token_ids) == reference_greedy(reference, ids, 96)
    assert reply.finish_reason == pb.FINISH_REASON_EOS


async def test_stream_concatenates_to_unary(real):
    for sampling in (greedy(20), sampled(seed=11, max_tokens=20)):
        req = pb.GenerateRequest(messages=CHAT, sampling=sampling)
        unary = await real.inference.Generate(req)
        chunks = [c async for c in real.inference.GenerateStream(req)]
        assert "".join(c.text for c in chunks) == unary.text
        assert [t for c in chunks for t in c.token_ids] == list(unary.token_ids)
        assert chunks[-1].finish_reason == unary.finish_reason != pb.FINISH_REASON_UNSPECIFIED
        assert chunks[-1].usage == unary.usage
        assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])


async def test_seeded_is_reproducible_alone_and_batched_with_unseeded(real):
    req = pb.GenerateRequest(prompt=PROMPT, sampling=sampled(seed=1234))
    alone = await real.inference.Generate(req)
    again = await real.inference.Generate(req)
    others = [pb.GenerateRequest(prompt=p, sampling=sampled()) for p in ("Hello", "Once upon")]
    batched = await asyncio.gather(
        real.inference.Generate(others[0]),
        real.inference.Generate(req),
        real.inference.Generate(others[1]),
    )
    assert list(alone.token_ids) == list(again.token_ids) == list(batched[1].token_ids)
    other_seed = await real.inference.Generate(
        pb.GenerateRequest(prompt=PROMPT, sampling=sampled(seed=99))
    )
    assert list(other_seed.token_ids) != list(alone.token_ids)


async def test_logprobs_and_stop_strings(real):
    req = pb.GenerateRequest(prompt=PROMPT, sampling=greedy(16, logprobs=3))
    reply = await real.inference.Generate(req)
    assert len(reply.logprobs) == len(reply.token_ids)
    for tok, lp in zip(reply.token_ids, reply.logprobs, strict=True):
        assert lp.token_id == tok and len(lp.top) == 3
        assert lp.top[0].token_id == tok  # greedy picks the most likely token
        assert lp.logprob <= 0 and lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob
    stop_at = reply.text.split()[1]
    stopped = await real.inference.Generate(
        pb.GenerateRequest(prompt=PROMPT, sampling=greedy(16, stop=[stop_at]))
    )
    assert stopped.finish_reason == pb.FINISH_REASON_STOP
    assert stopped.text == reply.text[: reply.text.index(stop_at)]
    length = await real.inference.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=greedy(3)))
    assert length.finish_reason == pb.FINISH_REASON_LENGTH and len(length.token_ids) == 3


@pytest.mark.parametrize(
    ("request_kwargs", "needle"),
    [
        ({}, "prompt: empty"),
        ({"prompt": "x", "messages": CHAT}, "give one of them, not both"),
        ({"messages": [pb.ChatMessage(role="robot", content="x")]}, "messages[0].role"),
        ({"prompt": "x", "sampling": pb.SamplingParams(temperature=-0.5)}, "must be >= 0"),
        ({"prompt": "x", "sampling": pb.SamplingParams(top_p=0.0)}, "must be in (0, 1]"),
        ({"prompt": "x", "sampling": pb.SamplingParams(top_p=1.5)}, "must be in (0, 1]"),
        ({"prompt": "x", "sampling": pb.SamplingParams(max_tokens=0)}, "must be at least 1"),
        ({"prompt": "x", "sampling": pb.SamplingParams(max_tokens=-3)}, "must be at least 1"),
        ({"prompt": "x", "sampling": pb.SamplingParams(max_tokens=9999)}, "the limit is 512"),
        ({"prompt": "x", "sampling": pb.SamplingParams(logprobs=50)}, "must be 0 to 20"),
        ({"prompt": "word " * 600}, "tokens; the limit is 512 (--max-input-tokens)"),
    ],
)
async def test_generate_bad_input_is_invalid_argument(real, request_kwargs, needle):
    req = pb.GenerateRequest(**request_kwargs)
    for call in (real.inference.Generate(req), real.inference.GenerateStream(req).read()):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in info.value.details()


async def test_health_answers_while_a_generation_runs(real):
    """Model work runs off the event loop: health checks complete during a long Generate."""
    long = asyncio.ensure_future(
        real.inference.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=greedy(120)))
    )
    await asyncio.sleep(0.5)  # the batch is running on the model's thread
    for _ in range(5):
        assert await real.status("inference.v1.Inference") == 1  # SERVING
    assert not long.done(), "the generation finished before the health checks: too short"
    reply = await long
    assert reply.usage.completion_tokens > 0
