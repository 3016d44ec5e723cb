"""The one value that owns a model's shapes: every shape padding can produce is one that
COMPILE runs and Describe lists, at every edge, before and after the cache is sized."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inference_api.plan import Bucket, CompilationMode, Phase
from inference_svc.engine.buckets import EmbedBuckets, GenBuckets, powers_of_two
from inference_svc.limits import GenLimits

pytestmark = pytest.mark.unit
LIMITS = GenLimits(max_batch=16, max_input_tokens=100, max_new_tokens=60, prefill_chunk=64)


def test_the_lists() -> None:
    b = GenBuckets.plan(LIMITS, CompilationMode.DEFAULT)
    assert b.batch == (2, 4, 8, 16) and b.chunk == (16, 32, 48, 64)
    assert b.context == (32, 64, 128, 160) and powers_of_two(160, 32) == b.context
    # eager and AOTInductor packages: a step runs the rows it has, unpadded
    assert GenBuckets.plan(LIMITS, CompilationMode.NONE).batch == tuple(range(1, 17))
    packages = GenBuckets.plan(LIMITS, CompilationMode.DEFAULT, aoti=True)
    assert packages.batch_for(9) == 9 and packages.sampler_batch(9) == 9
    # their eager sampler compiles nothing per size: SAMPLER warms powers of two
    assert packages.sampler_batches == (1, 2, 4, 8, 16)
    assert b.sampler_batches == (2, 4, 8, 16)  # torch.compile's: every batch it runs at
    assert b.largest() == (Bucket(Phase.DECODE, 16, 1, 160), b.prefill()[-1])


def test_cache_rows_are_whole_batch_buckets() -> None:
    b = GenBuckets.plan(LIMITS, CompilationMode.DEFAULT)
    assert b.rows_for(16 * 160) == 16 and b.rows_for(13 * 160) == 8
    with pytest.raises(ValueError, match="give at least 320"):
        b.rows_for(319)
    sized = b.with_rows(8)
    assert sized.decode_batch == (2, 4, 8) and sized.batch_for(5) == 8
    assert max(x.batch_size for x in sized.decode()) == 8
    eager = GenBuckets.plan(LIMITS, CompilationMode.NONE)
    assert eager.rows_for(13 * 160) == 13 and eager.with_rows(13).batch_for(13) == 13


@settings(max_examples=300, deadline=None)
@given(
    rows=st.sampled_from([0, 2, 4, 8, 13, 16]),
    mode=st.sampled_from([CompilationMode.DEFAULT, CompilationMode.NONE]),
    prompt=st.integers(1, LIMITS.max_input_tokens),
    data=st.data(),
)
def test_every_padded_shape_is_a_declared_one(rows: int, mode, prompt: int, data) -> None:
    b = GenBuckets.plan(LIMITS, mode)
    b = b.with_rows(b.rows_for(rows * LIMITS.max_seq_len) if rows else 0)
    declared = set(b.all())
    chunk = b.chunk[-1]
    for start in range(0, prompt, chunk):  # the chunks the scheduler cuts a prompt into
        assert b.chunk_shape(start, min(chunk, prompt - start)) in declared
    busy = data.draw(st.integers(1, b.rows or b.batch[-1]))
    top = data.draw(st.integers(0, LIMITS.max_seq_len - 1))
    assert b.decode_shape(busy, top) in declared


def test_embed_shapes() -> None:
    e = EmbedBuckets.plan(32, 256, CompilationMode.DEFAULT)
    assert e.shape(1, 1) == Bucket(Phase.EMBED, 2, 16)
    assert e.shape(3, 17) == Bucket(Phase.EMBED, 4, 32)
    assert {e.shape(r, n) for r in range(1, 33) for n in range(1, 257)} == set(e.all())
