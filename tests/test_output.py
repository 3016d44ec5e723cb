"""The output stage: streamed text with stop strings held back until known, never leaked,
never lost; decoded incrementally, with a per-token cost flat in the output's length."""

from __future__ import annotations

import time

import pytest

from inference_svc.engine.output import TextState
from inference_svc.engine.types import FinishReason, GenerateParams

pytestmark = pytest.mark.unit

PIECES = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!", 6: " E", 7: "ND", 8: " more"}
EOS = 0


def concat(ids: list[int]) -> str:
    return "".join(PIECES[i] for i in ids)


def run(tokens: list[int], stop: tuple[str, ...] = (), max_tokens: int = 50, decode=concat):
    """Feed tokens as the scheduler would: EOS for the end token, LENGTH for the last one."""
    params = GenerateParams(prompt="p", messages=(), max_tokens=max_tokens, stop=stop)
    state = TextState(params, 3, decode)
    chunks = []
    for n, t in enumerate(tokens, 1):
        finish = FinishReason.EOS if t == EOS else None
        if finish is None and n >= max_tokens:
            finish = FinishReason.LENGTH
        chunks.append(state.push(t, finish))
        if state.done:
            break
    return chunks


def test_stop_string_split_across_tokens_is_held_back_then_cut():
    chunks = run([1, 2, 5, 6, 7, 8], stop=("END",))
    # " E": the space goes out, "E" (a prefix of "END") is held, then cut.
    assert [c.text for c in chunks] == ["Hel", "lo", "!", " ", ""]
    assert chunks[-1].finish is FinishReason.STOP and chunks[-1].completion_tokens == 5
    assert "".join(c.text for c in chunks) == "Hello! "


def test_held_text_is_released_when_it_turns_out_not_to_be_a_stop():
    chunks = run([1, 2, 3, 4, 0], stop=("world!",))
    assert "".join(c.text for c in chunks) == "Hello world"
    assert chunks[-1].finish is FinishReason.EOS and chunks[-1].token_ids == []


def test_length_finish_flushes_everything():
    chunks = run([1, 2, 3], stop=("wor",), max_tokens=2)
    assert "".join(c.text for c in chunks) == "Hello"
    assert chunks[-1].finish is FinishReason.LENGTH and chunks[-1].completion_tokens == 2


def test_a_stop_wins_over_the_length_on_the_same_token():
    chunks = run([1, 2, 3], stop=("wor",), max_tokens=3)
    assert "".join(c.text for c in chunks) == "Hello "
    assert chunks[-1].finish is FinishReason.STOP


def test_a_character_split_over_two_tokens_waits_for_its_second_half():
    """Byte-level tokens: "é" is two bytes, each its own token; the first alone decodes to
    U+FFFD, which is never sent."""
    table = {1: b"caf", 2: b"\xc3", 3: b"\xa9", 4: b"!"}

    def decode(ids: list[int]) -> str:
        return b"".join(table[i] for i in ids).decode("utf-8", errors="replace")

    chunks = run([1, 2, 3, 4], decode=decode)
    assert [c.text for c in chunks] == ["caf", "", "é", "!"]


@pytest.fixture(scope="module")
def smollm_tokenizer():
    from tests.models import packaged_tokenizer

    return packaged_tokenizer()


def test_incremental_text_equals_decoding_the_whole_output(smollm_tokenizer) -> None:
    """On the packaged model's tokenizer, for random ids (split characters, specials and
    all), the chunks join to exactly what decoding every id at once gives."""
    import random

    tok = smollm_tokenizer

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    rng = random.Random(7)
    eos = tok.eos_token_id
    for _ in range(30):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 60))]
        ids = [i for i in ids if i != eos]
        params = GenerateParams(prompt="p", messages=(), max_tokens=len(ids))
        state = TextState(params, 1, decode)
        text = ""
        for n, t in enumerate(ids, 1):
            text += state.push(t, FinishReason.LENGTH if n == len(ids) else None).text
        assert text == decode(ids)


def test_the_cost_of_a_token_does_not_grow_with_the_output(smollm_tokenizer) -> None:
    """512 tokens with four stop strings that never match: the last 64 tokens cost about
    what the first 64 did (the whole-output decode this replaced cost ~8x more at the end)."""
    tok = smollm_tokenizer
    ids = tok("The quick brown fox jumps over the lazy dog. " * 60)["input_ids"][:512]
    params = GenerateParams(
        prompt="p", messages=(), max_tokens=1000, stop=("###", "STOP", "</s>", "\n\nUser:")
    )
    state = TextState(params, 1, lambda x: tok.decode(x, skip_special_tokens=True))
    costs = []
    for t in ids:
        start = time.perf_counter()
        state.push(t, None)
        costs.append(time.perf_counter() - start)
    first, last = sorted(costs[:64])[32], sorted(costs[-64:])[32]  # medians
    print(f"per-token output cost: first 64 {first * 1e6:.1f} us, last 64 {last * 1e6:.1f} us")
    assert last < 3 * first
