"""Tiny models for fast tests: real architectures and real tokenizers, random weights
from fixed seeds, written to a directory like any local Hugging Face model."""

from __future__ import annotations

import copy
import functools
import json
import shutil
from pathlib import Path

import torch

from inference_svc.config import ServiceConfig
from inference_svc.models.loading import (
    load_causal_lm_parts,
    offline,
    resolve_embed_dir,
    resolve_lm_dir,
)


@functools.cache
def packaged_lm_parts() -> tuple[object, dict[str, torch.Tensor], object]:
    """(config, float32 state dict, tokenizer) of the packaged SmolLM2, read through the
    service's own converted-model cache (the default --model-cache-dir, which the suite's
    services share): transformers' GGUF reader dequantizes the whole file and converts its
    tokenizer (~16 s on 2 cores, ~5 s the tokenizer alone) once per machine, not once per
    fixture and test worker (~0.6 s from the cache)."""
    offline()
    cache = Path(ServiceConfig().model_cache_dir).expanduser()
    return load_causal_lm_parts(resolve_lm_dir("default"), cache)


def packaged_tokenizer():
    """The packaged SmolLM2's tokenizer: a copy of its own (a test may change it)."""
    return copy.deepcopy(packaged_lm_parts()[2])


def packaged_reference_lm():
    """transformers' own model class on the packaged SmolLM2's weights (as its GGUF loader
    reads them), in eval mode: the reference the service's tokens are checked against."""
    from transformers import AutoModelForCausalLM

    config, state, _tok = packaged_lm_parts()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    assert not unexpected and set(missing) <= tied, (missing, unexpected)
    model.tie_weights()  # the output layer is the embedding (the state holds it once)
    return model.eval()


def build_tiny_lm(directory: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = packaged_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=96,  # head_dim 24: no bucket size (a power of two) equals it
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def build_tiny_embedder(directory: Path) -> Path:
    from transformers import BertConfig, BertModel

    source = resolve_embed_dir("default")
    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    BertModel(config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(source / name, directory / name)
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64}))
    return directory
