"""Loading a causal LM leaves no process-wide state behind that compiled code guards on."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

from inference_svc.models.loading import _read_cached, _write_cached, load_causal_lm_parts

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


def test_replicas_converting_into_one_cache_at_once_all_load_and_leave_one_copy(
    tiny_lm_dir: Path, tmp_path: Path
) -> None:
    # Replicas sharing a cache volume (compose's scale profile) start together and each
    # converts the model; each container's server can have the same process id. Threads of
    # one process stand in for them: same pid, same moment.
    config, state, tokenizer = load_causal_lm_parts(tiny_lm_dir, None)
    for round_ in range(5):
        cached = tmp_path / f"round{round_}" / "model-0123"
        barrier = threading.Barrier(3)

        def write(cached: Path, barrier: threading.Barrier) -> None:
            barrier.wait()
            _write_cached(cached, config, state, tokenizer)

        with ThreadPoolExecutor(3) as pool:
            for done in [pool.submit(write, cached, barrier) for _ in range(3)]:
                done.result()  # none raised
        assert (cached / "complete").exists()
        assert sorted(p.name for p in cached.parent.iterdir()) == ["model-0123"]  # no tmp left
        _, read, _ = _read_cached(cached)
        assert read.keys() <= state.keys() and all(torch.equal(read[k], state[k]) for k in read)


def test_a_conversion_that_fails_to_cache_leaves_no_partial_copy(
    tiny_lm_dir: Path, tmp_path: Path
) -> None:
    config, state, _ = load_causal_lm_parts(tiny_lm_dir, None)

    class Full:  # a tokenizer whose files do not fit on the volume
        def save_pretrained(self, path: str) -> None:
            raise OSError(28, "No space left on device")

    cached = tmp_path / "model-0123"
    with pytest.raises(OSError, match="No space"):
        _write_cached(cached, config, state, Full())
    assert list(tmp_path.iterdir()) == []  # neither the cache nor a temporary copy


def mapped(path: Path) -> bool:
    """Whether this process maps ``path`` (a file read with mmap and still referenced)."""
    return str(path) in Path("/proc/self/maps").read_text()


def test_a_loaded_lm_keeps_no_page_of_its_file_mapped(tiny_lm_dir: Path, tmp_path: Path) -> None:
    # A state read from safetensors is views of the file's mapping: one weight left there
    # (the embedding, once the linears are fused or quantised) kept the whole file resident.
    import gc

    from inference_svc.models.llama import LlamaLM, LlamaShape
    from inference_svc.models.loading import own_memory

    config, state, tokenizer = load_causal_lm_parts(tiny_lm_dir, None)
    cached = tmp_path / "model-0123"
    _write_cached(cached, config, state, tokenizer)
    config, state, _ = _read_cached(cached)
    shape = LlamaShape.from_hf(config)
    lm, _ = LlamaLM.from_state(shape, state)
    want = {k: v.clone() for k, v in lm.state_dict().items()}
    del state
    gc.collect()
    assert mapped(cached / "model.safetensors"), "the read state is not a mapping: test void"
    lm.fuse()
    own_memory(lm)
    gc.collect()
    assert not mapped(cached / "model.safetensors")
    assert all(torch.equal(v, lm.state_dict()[k]) for k, v in want.items() if k in lm.state_dict())
    if shape.tie_embeddings:
        assert lm.lm_head.weight is lm.model.embed_tokens.weight
