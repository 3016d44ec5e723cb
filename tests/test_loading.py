"""Loading a causal LM leaves no process-wide state behind that compiled code guards on."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

from inference_svc.models.loading import load_causal_lm_parts

pytestmark = pytest.mark.unit


def test_converting_a_causal_lm_leaves_transformers_output_registry_as_it_was(
    tiny_lm_dir: Path,
) -> None:
    # The embedding encoder reads this dict in its forward, so Dynamo guards on it: a
    # start that built the transformers LM to convert it and a start that read the
    # cached conversion must see the same dict, or artifacts kept by one fail in the other.
    saved = dict(_CAN_RECORD_REGISTRY)
    try:
        dict.clear(_CAN_RECORD_REGISTRY)
        dict.__setitem__(_CAN_RECORD_REGISTRY, "sentinel", {})
        config, state, tokenizer = load_causal_lm_parts(tiny_lm_dir, None)
        assert dict(_CAN_RECORD_REGISTRY) == {"sentinel": {}}
        assert state and config.num_hidden_layers == 2 and len(tokenizer) > 0
    finally:
        dict.clear(_CAN_RECORD_REGISTRY)
        dict.update(_CAN_RECORD_REGISTRY, saved)
