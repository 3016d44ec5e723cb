"""The Generate scheduler alone: no torch, no gRPC, no model. Rows, chunks, sampling and
decode plans as a continuous-batching engine must produce them."""

from __future__ import annotations

import pytest

from inference_svc.engine.scheduler import DecodePlan, Scheduler, Sequence
from inference_svc.engine.types import FinishReason, GenerateParams

pytestmark = pytest.mark.unit
EOS = 0


def seq(prompt: int, max_tokens: int = 8) -> Sequence:
    params = GenerateParams(prompt="p", messages=(), max_tokens=max_tokens)
    return Sequence(list(range(1, prompt + 1)), params, lambda chunk: None)


def sched(rows: int = 4, chunk: int = 16) -> Scheduler:
    s = Scheduler(chunk, frozenset({EOS}))
    s.set_rows(rows)
    return s


def admitted(s: Scheduler, *seqs: Sequence) -> Scheduler:
    """``seqs`` queued in this order, then admitted as far as rows allow."""
    for x in seqs:
        s.add(x)
    s.admit()
    return s


def prefill_all(s: Scheduler) -> None:
    while (c := s.next_chunk()) is not None:
        s.prefilled(c)


def test_admission_is_fifo_into_the_lowest_free_rows() -> None:
    a, b, c = seq(3), seq(3), seq(3)
    s = admitted(sched(rows=2), a, b, c)
    assert (a.row, b.row) == (0, 1) and list(s.waiting) == [c]
    a.cancelled.set()
    s.reap()
    s.admit()
    assert c.row == 0 and s.running == [b, c]


def test_a_long_prompt_prefills_one_chunk_per_iteration_oldest_first() -> None:
    long, short = seq(40), seq(5)
    s = admitted(sched(chunk=16), long, short)
    widths = []
    while (c := s.next_chunk()) is not None:
        assert c.seq is long or not long.prefilling  # the oldest prefilling request first
        widths.append((c.start, len(c.ids), c.last))
        s.prefilled(c)
    assert widths == [(0, 16, False), (16, 16, False), (32, 8, True), (0, 5, True)]
    assert s.ready() == [long, short]


def test_sampling_finishes_rows_on_eos_and_length_and_plans_the_rest() -> None:
    a, b, c = seq(3), seq(3, max_tokens=1), seq(3)
    s = admitted(sched(), a, b, c)
    prefill_all(s)
    plan = s.sampled([(a, 42), (b, 43), (c, EOS)])
    assert b.finish is FinishReason.LENGTH and c.finish is FinishReason.EOS
    assert plan == DecodePlan({a.row: 42}, {a.row: 3})
    assert s.running == [a] and not a.ready
    s.decoded(plan)
    assert a.filled == 4 and a.ready and s.ready() == [a]


def test_padding_rows_get_their_next_slot_and_freed_rows_are_reused() -> None:
    a, b = seq(3), seq(20)
    s = admitted(sched(rows=4), a, b)
    s.prefilled(s.next_chunk())  # a's whole prompt
    s.prefilled(s.next_chunk())  # b's first chunk
    plan = s.sampled([(a, 7)])
    assert plan is not None and plan.positions == {0: 3, 1: 16} and plan.top_row == 0
    a.stopped = True  # the output stage found a stop string
    assert s.reap() == [a]
    late = seq(2)
    admitted(s, late)
    assert late.row == 0


def test_a_stop_takes_everything_out() -> None:
    a, b = seq(3), seq(3)
    s = admitted(sched(rows=1), a, b)
    assert s.abort(waiting_too=True) == [a, b] and not s.running and not s.waiting


def test_the_cache_is_never_resized_under_running_requests() -> None:
    s = sched(rows=2)
    s.add(seq(3))
    s.admit()
    s.set_rows(2)  # the same size: nothing happens
    with pytest.raises(AssertionError):
        s.set_rows(4)
