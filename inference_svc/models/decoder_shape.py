"""What a transformers config declares about a decoder: the shape the shared decoder
(models/llama.py) is built from, with each family's differences, and its rotary frequencies.
Anything not supported is refused here, by name, before a weight is read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The architectures Generate serves: Llama's decoder, and what each family changes in it.
SUPPORTED_ARCHITECTURES = (
    "gemma2", "gemma3", "gemma3_text", "llama", "mistral", "phi3", "qwen2", "qwen3",
)  # fmt: skip
# The GGUF architectures (llama.cpp's names) of those families that transformers' GGUF reader
# converts (transformers/integrations/ggml.py; Mistral's GGUF is "llama").
GGUF_ARCHITECTURES = ("gemma2", "gemma3", "llama", "phi3", "qwen2", "qwen3")
# Gemma's layer: (1 + w) norms, scaled embeddings, sandwich norms (Gemma 3 adds q/k norms).
GEMMA = ("gemma2", "gemma3_text")
# Rotary embeddings; a static cache and compiled graphs need frequencies that do not change
# with the sequence length: "dynamic" keeps its own up to max_position_embeddings, "longrope" its
# short factor up to original_max_position_embeddings (the loader refuses a longer max
# sequence, see LlamaShape.check_length).
SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
# The MLP gates: transformers' activation names, and ours.
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# Families whose sliding_window applies (Qwen's only with use_sliding_window).
WINDOWED = ("gemma2", "gemma3_text", "mistral", "phi3", "qwen2", "qwen3")


@dataclass(frozen=True)
class LlamaShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    inv_freq: tuple[float, ...]  # the rotary frequencies, from the config's rope type
    tie_embeddings: bool
    max_positions: int
    rope_scale: float = 1.0  # cos/sin scaling some rope types apply (yarn)
    # A second rope for the layers ``local_rope_layers`` marks (Gemma 3's sliding layers:
    # another base, without the global layers' scaling); None: one rope for all.
    local_inv_freq: tuple[float, ...] | None = None
    local_rope_scale: float = 1.0
    local_rope_layers: tuple[bool, ...] = ()
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # the output projection carries one (Llama's attention_bias)
    mlp_bias: bool = False  # the MLP projections carry one (Llama's mlp_bias)
    qk_norm: bool = False  # an RMSNorm over each head of q and k before rope (Qwen3)
    # Attention limited to the last N positions (Mistral; Qwen with use_sliding_window) on
    # the layers ``sliding_layers`` marks (the config's layer_types; every layer without
    # them). A mask over the static cache: the same graphs, the whole cache kept.
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()
    # The rope type whose frequencies change past some length, and that length (longrope:
    # original_max_position_embeddings; dynamic: max_position_embeddings); None: never.
    rope_limit: tuple[str, int] | None = None
    # Gemma 2: RMSNorm scales by (1 + weight); token embeddings times sqrt(hidden); a norm
    # after attention and around the MLP ("sandwich"); a tanh-approximated GELU gate; the
    # attention scale from query_pre_attn_scalar; tanh soft-capping of the attention scores
    # and of the final logits.
    norm_offset: bool = False
    embed_scale: float | None = None
    sandwich_norms: bool = False
    activation: str = "silu"  # or "gelu_tanh"
    attn_scale: float | None = None  # None: 1 / sqrt(head_dim)
    attn_softcap: float | None = None
    final_softcap: float | None = None

    @classmethod
    def from_hf(cls, config: object) -> LlamaShape:
        """Read a transformers config of a supported architecture; ValueError names what is
        not supported (before any weight is read into the model)."""
        c = _text_config(config)
        family = getattr(c, "model_type", "llama")
        if family not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"model type {family!r} is not supported for Generate "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        window = getattr(c, "sliding_window", None)
        if family.startswith("qwen") and not getattr(c, "use_sliding_window", False):
            window = None  # Qwen configs carry a window that applies only when turned on
        if family not in WINDOWED:
            window = None
        sliding = _sliding_layers(c, window)
        if getattr(c, "use_bidirectional_attention", False):
            raise ValueError(
                f"use_bidirectional_attention ({family}: an embedding model's attention) is not "
                "supported for Generate"
            )
        per_type = _per_layer_type_rope(c)
        inv_freq, scale = _rope_frequencies(c, "full_attention" if per_type else None)
        types = tuple(getattr(c, "layer_types", None) or ())
        local = tuple(t == "sliding_attention" for t in types) if per_type else ()
        local_freq, local_scale = (
            _rope_frequencies(c, "sliding_attention") if any(local) else (None, 1.0)
        )
        heads = c.num_attention_heads
        attention_bias = bool(getattr(c, "attention_bias", False))
        gemma = family in GEMMA
        act = getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ValueError(
                f"activation {act!r} is not supported (supported: {list(ACTIVATIONS)})"
            )
        scalar = getattr(c, "query_pre_attn_scalar", None) if gemma else None
        return cls(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_layers=c.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            rms_eps=c.rms_norm_eps,
            inv_freq=inv_freq,
            tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            max_positions=c.max_position_embeddings,
            rope_scale=scale,
            local_inv_freq=local_freq,
            local_rope_scale=local_scale,
            local_rope_layers=local if any(local) else (),
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(c, "mlp_bias", False)),
            qk_norm=family in ("qwen3", "gemma3_text"),
            sliding_window=window if any(sliding) else None,
            sliding_layers=sliding if any(sliding) else (),
            rope_limit=_rope_limit(c),
            norm_offset=gemma,
            embed_scale=float(c.hidden_size) ** 0.5 if gemma else None,
            sandwich_norms=gemma,
            activation=ACTIVATIONS[act],
            attn_scale=float(scalar) ** -0.5 if scalar else None,
            attn_softcap=getattr(c, "attn_logit_softcapping", None) if gemma else None,
            final_softcap=getattr(c, "final_logit_softcapping", None) if gemma else None,
        )

    def check_length(self, max_seq_len: int) -> None:
        """ValueError if sequences of ``max_seq_len`` (max input + max new tokens) go past
        the model's positions or past the length where its rope changes frequencies."""
        if self.rope_limit is not None and max_seq_len > self.rope_limit[1]:
            kind, limit = self.rope_limit
            field, change = _PAST_LIMIT[kind]
            raise ValueError(
                f"rope type {kind!r} keeps fixed frequencies up to {limit} positions ({field}); "
                f"max input + max new tokens = {max_seq_len} would {change} mid-sequence (not "
                "supported with a static cache): lower --max-input-tokens/--max-new-tokens"
            )
        if max_seq_len > self.max_positions:
            raise ValueError(
                f"max input + max new tokens = {max_seq_len} exceeds the model's "
                f"{self.max_positions} positions"
            )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize


def _sliding_layers(config: object, window: int | None) -> tuple[bool, ...]:
    """Which layers attend to the last ``window`` positions only: the config's layer_types
    where it has them, else all (Mistral)."""
    n = config.num_hidden_layers
    if window is None:
        return (False,) * n
    types = getattr(config, "layer_types", None)
    if types:
        return tuple(t == "sliding_attention" for t in types)
    return (True,) * n


def _per_layer_type_rope(config: object) -> bool:
    """Whether the rope parameters are given per layer type (Gemma 3 in transformers 5:
    ``{"full_attention": {...}, "sliding_attention": {...}}``)."""
    rope = getattr(config, "rope_parameters", None) or {}
    return isinstance(rope.get("full_attention"), dict)


def _rope_params(config: object, layer_type: str | None = None) -> dict:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return rope[layer_type] if layer_type is not None else rope


def _rope_limit(config: object) -> tuple[str, int] | None:
    """The rope type whose frequencies change past some length, and that length: longrope
    switches to its long factor past original_max_position_embeddings, dynamic rescales past
    max_position_embeddings."""
    rope = _rope_params(config, "full_attention" if _per_layer_type_rope(config) else None)
    kind = rope.get("rope_type", rope.get("type"))
    if kind == "dynamic":
        return kind, int(config.max_position_embeddings)
    if kind != "longrope":
        return None
    original = rope.get("original_max_position_embeddings")
    original = int(original or getattr(config, "original_max_position_embeddings", 0) or 0)
    return (kind, original) if original else None


# What each rope type does past its limit, and the config field that sets the limit.
_PAST_LIMIT = {
    "longrope": ("original_max_position_embeddings", "switch to its long factor"),
    "dynamic": ("max_position_embeddings", "rescale its frequencies"),
}


def _rope_frequencies(
    config: object, layer_type: str | None = None
) -> tuple[tuple[float, ...], float]:
    """The rotary frequencies and cos/sin scale of ``config``'s rope type (of the layers of
    ``layer_type`` where the config gives one per type), computed by transformers' own rope
    functions (the reference the parity tests compare with)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = _rope_params(config, layer_type)
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind not in SUPPORTED_ROPE:
        raise ValueError(
            f"rope type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE)}: "
            "frequencies that do not change with the sequence length)"
        )
    if kind == "default":
        theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        heads = config.num_attention_heads
        d = getattr(config, "head_dim", None) or config.hidden_size // heads
        part = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        d = int(d * part)
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        return tuple(inv.tolist()), 1.0
    by_type = {"layer_type": layer_type} if layer_type is not None else {}
    inv, scale = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"), **by_type)
    return tuple(inv.float().tolist()), float(scale)


def text_decoder(
    config: object, state: dict[str, torch.Tensor]
) -> tuple[object, dict[str, torch.Tensor]]:
    """A multimodal Gemma 3 (``gemma3``, which transformers loads as a causal LM): its text
    model's config and weights (``model.language_model.*`` as ``model.*``, the LM head), the
    vision tower and projector left out; text prompts only. Anything else as it is."""
    if getattr(config, "model_type", None) != "gemma3":
        return config, state
    prefix = "model.language_model."
    kept = {f"model.{k.removeprefix(prefix)}": v for k, v in state.items() if k.startswith(prefix)}
    if "lm_head.weight" in state:
        kept["lm_head.weight"] = state["lm_head.weight"]
    return _text_config(config), kept


def _text_config(config: object) -> object:
    """Gemma 3's text config, tied as the whole model is."""
    if getattr(config, "model_type", None) != "gemma3":
        return config
    text = config.get_text_config()
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
    return text
