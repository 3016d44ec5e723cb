"""Tiny models for fast tests: real architectures and real tokenizers, random weights
from fixed seeds, written to a directory like any local Hugging Face model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from inference_svc.models.loading import (
    load_hf_causal_lm,
    offline,
    resolve_embed_dir,
    resolve_lm_dir,
)


def build_tiny_lm(directory: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    offline()
    _hf, tokenizer = load_hf_causal_lm(resolve_lm_dir("default"), torch.float32)
    del _hf
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
