"""Accuracy of each numerics option on the real models against float32 (bench/accuracy.py
has the method and prints the figures docs/numerics.md quotes). Eager: the compiled graphs run the
same kernels' numerics, and the slow end-to-end test checks compiled == eager tokens."""

from __future__ import annotations

import pytest

from bench.accuracy import (
    PROMPTS,
    embed_cosines,
    lm_agreement,
    load_embed,
    load_lm,
)
from inference_api.plan import CompilationMode

pytestmark = [pytest.mark.rpc, pytest.mark.slow]  # minutes: the real LM three times, eager

NONE = CompilationMode.NONE


@pytest.fixture(scope="module")
def reference_lm():
    return load_lm("float32", "same", NONE)


# int4 on the native kernel with a float16 KV cache: the fastest configuration's numerics on
# an AVX512-VNNI CPU (--lm-weights auto --kv-cache-dtype auto); each alone agrees as well
@pytest.mark.parametrize("weights", ["bfloat16", "int4", "int4:native+kv16"])
def test_lm_weight_options_keep_top1_agreement(reference_lm, weights: str) -> None:
    option = load_lm("float32", weights, NONE)
    assert lm_agreement(reference_lm, option, PROMPTS, 32) >= 0.98


def test_float32_agrees_with_itself(reference_lm) -> None:
    """The measure itself: the reference teacher-forced along its own greedy tokens."""
    assert lm_agreement(reference_lm, reference_lm, PROMPTS[:3], 16) == 1.0


def test_bfloat16_embeddings_keep_cosine() -> None:
    cosines = embed_cosines(load_embed("float32", NONE), load_embed("bfloat16", NONE))
    assert min(cosines) >= 0.999
