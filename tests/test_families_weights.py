"""--lm-weights on every family: the conversion reaches each family's own linear layers
(Phi-3's fused projections split into the shared decoder's, Gemma's, Qwen 3's, biased ones)
and the runner then gives what transformers gives with its linears converted the same way:
its logits over prefill chunks and batched decode steps, and its 64 greedy tokens
(tests/test_families.py's check)."""

from __future__ import annotations

import pytest
from torch import nn

from inference_svc.models.weights import BFloat16Linear, Int4Linear
from tests.test_families import build, equals_transformers, ours
from tests.test_families import tokenizer as tokenizer  # the fixture

pytestmark = pytest.mark.rpc
# int4 for one family per layer shape: fused projections split at load (phi3), q/k norms
# (qwen3), Gemma's layer (gemma2: capped scores; gemma3_text: local and global layers),
# biases on every projection (llama-biases: none fits int4, all go to bfloat16). bfloat16
# converts every linear alike; phi3's split projections are where it could go wrong.
CASES = [(f, "int4") for f in ("phi3", "qwen3", "gemma2", "gemma3_text", "llama-biases")]
CASES += [("phi3", "bfloat16")]


@pytest.mark.parametrize(("family", "weights"), CASES)
def test_each_weight_format_reaches_every_familys_linears(
    family: str, weights: str, tokenizer, tmp_path
) -> None:
    directory = build(tmp_path, family, tokenizer)
    runner = ours(directory, weights)
    layers = list(runner.model.lm.modules())
    assert not [m for m in layers if type(m) is nn.Linear], "a linear layer left in float32"
    int4 = [m for m in layers if isinstance(m, Int4Linear)]
    bf16 = [m for m in layers if isinstance(m, BFloat16Linear)]
    if weights == "int4":  # every projection without a bias (q/k/v fused, gate/up fused: 4
        # a layer); the head stays in bfloat16
        assert len(int4) == (0 if family == "llama-biases" else 4 * 2), (len(int4), len(bf16))
    else:
        assert not int4 and bf16
    equals_transformers(runner, directory, weights, atol=1e-4)
