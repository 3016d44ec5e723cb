"""GGUF for the families beside Llama: a tiny model of each family, built from its
transformers config (tests/test_families.py), written as a GGUF file the way llama.cpp names
and stores it (float32 tensors, the packaged SmolLM2's tokenizer cut to its first 2048
tokens), loads through transformers' GGUF reader into the service's decoder and gives the
logits of the same model read from its Hugging Face directory. A GGUF architecture the
decoder does not serve is refused at load, by name, from the file's header."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from inference_svc.compile_monitor import Origin
from inference_svc.models.loading import gguf_file, resolve_lm_dir
from tests.test_families import build, ours, prefill, transformers_next
from tests.test_families import tokenizer as tokenizer  # the fixture

pytestmark = pytest.mark.rpc
# The GGUF files' vocabulary: SmolLM2's first tokens and the merges among them (its ids follow
# its merges): converting 49152 tokens costs seconds each time the file is read (three times)
VOCAB = 2048
# What the GGUF reader maps into each family's config (transformers/integrations/ggml.py);
# the rest of the HF config is left at its defaults so that both sides build one model.
GGUF_FAMILIES = {
    "qwen2": ("qwen2", {}),
    # Gemma 3's GGUF carries no query_pre_attn_scalar, layer pattern or local rope base: the
    # defaults (256; 5 local layers in 6; 10000), so both layers here are local ones
    "gemma3_text": ("gemma3", {"query_pre_attn_scalar": 256, "sliding_window_pattern": 6,
                               "rope_local_base_freq": 10000.0, "rope_scaling": None}),
    "phi3": ("phi3", {"pad_token_id": 2}),  # fused qkv and gate/up, as Phi-3's GGUF keeps them
}  # fmt: skip


def write_gguf(hf_dir: Path, out: Path, arch: str) -> Path:
    """``hf_dir``'s model as ``out``/model.gguf, named and laid out as llama.cpp writes it
    (Gemma's norms stored as 1 + weight), with the packaged GGUF's tokenizer."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(hf_dir))
    names = gguf.get_tensor_name_map(
        next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), config.num_hidden_layers
    )
    out.mkdir(parents=True)
    writer = gguf.GGUFWriter(str(out / "model.gguf"), arch)
    writer.add_uint32(f"{arch}.context_length", config.max_position_embeddings)
    writer.add_uint32(f"{arch}.block_count", config.num_hidden_layers)
    writer.add_uint32(f"{arch}.feed_forward_length", config.intermediate_size)
    writer.add_uint32(f"{arch}.embedding_length", config.hidden_size)
    writer.add_uint32(f"{arch}.attention.head_count", config.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", config.num_key_value_heads)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    rope = config.rope_parameters
    rope = rope.get("full_attention", rope)
    writer.add_float32(f"{arch}.rope.freq_base", rope["rope_theta"])
    writer.add_uint32(f"{arch}.vocab_size", config.vocab_size)
    if arch == "gemma3":
        writer.add_uint32(f"{arch}.attention.key_length", config.head_dim)
        writer.add_uint32(f"{arch}.attention.value_length", config.head_dim)
        writer.add_uint32(f"{arch}.attention.sliding_window", config.sliding_window)
    _copy_tokenizer(writer)
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        if arch == "gemma3" and name.endswith("norm.weight"):
            tensor = tensor + 1  # llama.cpp's convert_hf_to_gguf does this for Gemma
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert target is not None, name
        writer.add_tensor(target, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _copy_tokenizer(writer: object) -> None:
    """The packaged SmolLM2 GGUF's tokenizer fields, its vocabulary cut to VOCAB tokens."""
    for key, (kind, value) in _tokenizer_fields().items():
        if kind == "array":
            writer.add_array(key, value)
        elif kind == "str":
            writer.add_string(key, value)
        elif kind == "bool":
            writer.add_bool(key, value)
        else:
            writer.add_uint32(key, value)


@functools.cache
def _tokenizer_fields() -> dict[str, tuple[str, object]]:
    import gguf

    packaged = resolve_lm_dir("default")
    reader = gguf.GGUFReader(str(packaged / gguf_file(packaged)))
    kinds = {gguf.GGUFValueType.ARRAY: "array", gguf.GGUFValueType.STRING: "str",
             gguf.GGUFValueType.BOOL: "bool"}  # fmt: skip
    fields = {
        key: (kinds.get(f.types[0], "uint32"), f.contents())
        for key, f in reader.fields.items()
        if key.startswith("tokenizer.")
    }
    tokens = fields["tokenizer.ggml.tokens"][1][:VOCAB]
    kept = set(tokens)
    merges = [
        m for m in fields["tokenizer.ggml.merges"][1]
        if m.replace(" ", "", 1) in kept and all(p in kept for p in m.split(" "))
    ]  # fmt: skip
    fields["tokenizer.ggml.tokens"] = ("array", tokens)
    fields["tokenizer.ggml.token_type"] = ("array", fields["tokenizer.ggml.token_type"][1][:VOCAB])
    fields["tokenizer.ggml.merges"] = ("array", merges)
    return fields


@pytest.mark.parametrize("family", sorted(GGUF_FAMILIES))
def test_a_gguf_file_gives_the_hf_directorys_logits(family, tokenizer, tmp_path) -> None:
    arch, options = GGUF_FAMILIES[family]
    hf_dir = build(tmp_path / "hf", family, tokenizer, vocab_size=VOCAB, **options)
    gguf_dir = write_gguf(hf_dir, tmp_path / "gguf", arch)
    ref_next = transformers_next(hf_dir)
    runner = ours(gguf_dir)
    prompt = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        got = prefill(runner, 0, prompt)
        assert (got - ref_next(prompt)).abs().max() <= 1e-4
        ids = list(prompt)
        for step in range(4):
            ids.append(int(got.argmax()))
            got = runner.pad_decode([ids[-1]], [len(ids) - 1], Origin.WARMUP)[0]
            assert (got - ref_next(ids)).abs().max() <= 1e-4, f"decode step {step}"
    # the tokenizer converted from the file: SmolLM2's ids for text its first tokens spell
    text = "The time is now, and we are all in it: one more for you."  # ids < VOCAB
    assert runner.model.encode(text, []) == tokenizer(text)["input_ids"]
    assert runner.model.detokenize(runner.model.encode(text, [])) == text


@pytest.mark.parametrize("arch", ["deepseek2", "falcon"])
def test_a_gguf_architecture_not_served_is_refused_by_name(arch, tmp_path) -> None:
    """DeepSeek-V2 (transformers cannot read its GGUF) and Falcon (it can; the decoder does
    not serve it): refused from the file's header, naming the architecture."""
    import gguf

    tmp_path.mkdir(exist_ok=True)
    writer = gguf.GGUFWriter(str(tmp_path / "model.gguf"), arch)
    writer.add_tensor("token_embd.weight", torch.zeros(VOCAB, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=rf"GGUF architecture '{arch}' .* not supported"):
        ours(tmp_path)
