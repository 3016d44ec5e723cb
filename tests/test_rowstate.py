"""Streaming text with stop strings: held back until known, never leaked, never lost."""

from __future__ import annotations

from inference_svc.engine.rowstate import RowState
from inference_svc.engine.types import FinishReason, GenerateParams

PIECES = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!", 6: " E", 7: "ND", 8: " more"}
EOS = 0


def run(tokens: list[int], stop: tuple[str, ...] = (), max_tokens: int = 50):
    params = GenerateParams(prompt="p", messages=(), max_tokens=max_tokens, stop=stop)
    state = RowState(params, 3, frozenset({EOS}), lambda ids: "".join(PIECES[i] for i in ids))
    chunks = []
    for t in tokens:
        chunks.append(state.push(t, None))
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
