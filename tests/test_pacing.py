"""The prefill chunk's pacing (engine/pacing.py): the widest chunk on an idle service, a
chunk no costlier than two decode steps while rows decode, from measured times; and whatever
limits it sets, every chunk the scheduler cuts is a shape COMPILE warmed and Describe lists."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inference_api.plan import CompilationMode
from inference_svc.engine.buckets import GenBuckets
from inference_svc.engine.pacing import ChunkPacer
from inference_svc.engine.scheduler import Scheduler, Sequence
from inference_svc.engine.types import GenerateParams
from inference_svc.limits import GenLimits

pytestmark = pytest.mark.unit
WIDTHS = (16, 32, 48, 64)


def test_the_widest_chunk_until_rows_decode_or_before_anything_was_measured() -> None:
    p = ChunkPacer(WIDTHS)
    assert p.limit(0) == 64 and p.limit(4) == 64
    p.observe(0, 4, 0.010)  # a plain iteration, 4 rows decoding: 10 ms
    assert p.limit(4) == 64  # no chunk measured yet
    p.observe(64, 4, 0.060)  # a 64-token chunk beside that step: 50 ms of its own
    assert p.cost(64) == pytest.approx(0.050)
    assert p.cost(16) == pytest.approx(0.0125)  # not measured: scaled by tokens
    assert p.limit(4) == 16 and p.limit(0) == 64
    assert p.limit(2) == 64  # no plain iteration measured at 2 rows or fewer


def test_the_limit_follows_the_measured_costs() -> None:
    p = ChunkPacer(WIDTHS)
    p.observe(0, 8, 0.010)
    p.observe(48, 8, 0.028)  # a chunk padded to 48 tokens: 18 ms of its own
    assert p.limit(8) == 48  # 64 would cost 24 ms: more than two steps
    for _ in range(20):  # the 48-wide chunk turns out dearer: narrower
        p.observe(48, 8, 0.035)
    assert p.limit(8) == 32  # ~25 ms * 32 / 48 = ~17 ms
    p.observe(32, 0, 0.030)  # alone (no step beside it): its whole time is its own
    assert p.cost(32) == pytest.approx(0.030) and p.limit(8) == 16


def test_the_budget_is_a_step_at_as_many_rows() -> None:
    p = ChunkPacer(WIDTHS)
    p.observe(0, 1, 0.005)
    p.observe(0, 8, 0.020)
    p.observe(64, 8, 0.060)  # 40 ms of its own, against the 8-row step
    assert p.cost(64) == pytest.approx(0.040)
    assert p.limit(2) == 16 and p.limit(4) == 16  # the 1-row step, the nearest fewer: 10 ms
    assert p.limit(8) == 64 and p.limit(16) == 64


def test_a_burst_of_prompts_takes_the_widest_chunk() -> None:
    p = ChunkPacer(WIDTHS)
    p.observe(0, 4, 0.010)
    p.observe(64, 4, 0.060)
    assert p.limit(4, prompts=1) == 16  # one joiner: the four running streams come first
    assert p.limit(4, prompts=4) == 64  # as many waiting as running: get them going
    assert p.limit(1, prompts=1) == 64


def test_never_narrower_than_the_narrowest_bucket() -> None:
    p = ChunkPacer(WIDTHS)
    p.observe(0, 2, 0.001)
    p.observe(16, 2, 0.100)
    assert p.limit(2) == 16


def test_only_multiples_of_16_below_an_odd_limit() -> None:
    p = ChunkPacer((16, 32, 40))
    assert p.paced == (16, 32)
    p.observe(0, 3, 0.010)
    p.observe(40, 3, 0.030)
    assert p.limit(3) == 32 and p.limit(0) == 40


def _seq(n: int) -> Sequence:
    params = GenerateParams(prompt="p", messages=(), max_tokens=1)
    return Sequence(list(range(1, n + 1)), params, lambda chunk: None)


@settings(max_examples=400, deadline=None)
@given(
    chunk=st.integers(16, 130),
    max_input=st.integers(2, 300),
    max_new=st.integers(1, 100),
    data=st.data(),
)
def test_every_paced_chunk_is_a_declared_shape(
    chunk: int, max_input: int, max_new: int, data
) -> None:
    limits = GenLimits(max_batch=4, max_input_tokens=max_input, max_new_tokens=max_new,
                       prefill_chunk=chunk)  # fmt: skip
    b = GenBuckets.plan(limits, CompilationMode.DEFAULT)
    declared = set(b.prefill())
    pacer = ChunkPacer(b.chunk)
    s = Scheduler(b.chunk[-1], frozenset())
    s.set_rows(2)
    s.add(_seq(data.draw(st.integers(1, max_input))))
    s.admit()
    choices = st.sampled_from((*pacer.paced, b.chunk[-1], None))
    while (c := s.next_chunk(data.draw(choices))) is not None:
        assert b.chunk_shape(c.start, len(c.ids)) in declared, (c.start, len(c.ids))
        s.prefilled(c)
