"""A Llama-family causal LM with a static KV cache, written for torch.compile.

The forward passes are pure functions of tensors: the KV cache is a pair of
preallocated tensors passed in and written in place, the write position is a
tensor, and no Python state changes between calls. So a compiled decode step is
one graph for every sequence length (no guard on mutable cache state to
recompile it), and a compiled prefill is one graph for every padded shape.

Weights use the Hugging Face parameter names (``model.layers.N.self_attn...``),
so a ``LlamaForCausalLM`` state dict loads as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# The architectures Generate serves: Llama's decoder, and what each family changes in it.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "phi3", "qwen2", "qwen3")
# Rotary embeddings; a static cache and compiled graphs need frequencies that do not change
# with the sequence length: "dynamic" keeps its own up to max_position_embeddings (the loader's
# limit anyway), "longrope" its short factor up to original_max_position_embeddings (the
# loader refuses a longer max sequence, see LlamaShape.rope_limit).
SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
# Families whose sliding_window applies (Qwen's only with use_sliding_window).
WINDOWED = ("mistral", "phi3", "qwen2", "qwen3")


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
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # the output projection carries one (Llama's attention_bias)
    mlp_bias: bool = False  # the MLP projections carry one (Llama's mlp_bias)
    qk_norm: bool = False  # an RMSNorm over each head of q and k before rope (Qwen3)
    # Attention limited to the last N positions (Mistral; Qwen with use_sliding_window) on
    # the layers ``sliding_layers`` marks (the config's layer_types; every layer without
    # them). A mask over the static cache: the same graphs, the whole cache kept.
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()
    # The longest sequence whose rotary frequencies are the ones above (longrope switches to
    # its long factor past original_max_position_embeddings); None: any.
    rope_limit: int | None = None

    @classmethod
    def from_hf(cls, config: object) -> LlamaShape:
        """Read a transformers config of a supported architecture; ValueError names what is
        not supported (before any weight is read into the model)."""
        c = config
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
        inv_freq, scale = _rope_frequencies(c)
        heads = c.num_attention_heads
        attention_bias = bool(getattr(c, "attention_bias", False))
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
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(c, "mlp_bias", False)),
            qk_norm=family == "qwen3",
            sliding_window=window if any(sliding) else None,
            sliding_layers=sliding if any(sliding) else (),
            rope_limit=_rope_limit(c),
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


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


def _rope_params(config: object) -> dict:
    return getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}


def _rope_limit(config: object) -> int | None:
    rope = _rope_params(config)
    if rope.get("rope_type", rope.get("type")) != "longrope":
        return None
    original = rope.get("original_max_position_embeddings")
    return int(original or getattr(config, "original_max_position_embeddings", 0) or 0) or None


def _rope_frequencies(config: object) -> tuple[tuple[float, ...], float]:
    """The rotary frequencies and cos/sin scale of ``config``'s rope type, computed by
    transformers' own rope functions (the reference the parity tests compare with)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = _rope_params(config)
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
    inv, scale = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"))
    return tuple(inv.float().tolist()), float(scale)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.s = s
        self.q_proj = nn.Linear(s.hidden_size, s.num_heads * s.head_dim, bias=s.qkv_bias)
        self.k_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=s.qkv_bias)
        self.v_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=s.qkv_bias)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=s.o_bias)
        norm = s.qk_norm
        self.q_norm = RMSNorm(s.head_dim, s.rms_eps) if norm else None
        self.k_norm = RMSNorm(s.head_dim, s.rms_eps) if norm else None

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b, n, _ = x.shape
        s = self.s
        q = self.q_proj(x).view(b, n, s.num_heads, s.head_dim)
        k = self.k_proj(x).view(b, n, s.num_kv_heads, s.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, n, s.num_kv_heads, s.head_dim).transpose(1, 2)
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        b, _, n, _ = q.shape
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))

    def attend_one(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """Attention of one new token per row ([B, H, 1, D]) over the whole cache.

        The query heads that share a KV head become that head's "query positions"
        ([B, KV, H/KV, D]), so the cache is read as it is, never expanded per query head
        (expanding copies every layer's cache at every step).
        """
        b, heads, _, d = q.shape
        kv = k.shape[1]
        grouped = q.reshape(b, kv, heads // kv, d)
        out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask)
        return self.o_proj(out.reshape(b, 1, heads * d))


class MLP(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=s.mlp_bias)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=s.mlp_bias)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=s.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_eps)
        self.self_attn = Attention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_eps)
        self.mlp = MLP(s)


class Backbone(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(s) for _ in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_eps)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of the first ``cos.shape[-1]`` features of each head (all of them,
    or a part: Phi's partial_rotary_factor); the rest pass as they are."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot = x[..., :r]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, x[..., r:]), dim=-1)


def split_fused(s: LlamaShape, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Phi-3's fused projections as the shared decoder's own: ``qkv_proj`` into q/k/v (rows
    in that order) and ``gate_up_proj`` into gate and up (gate first, as Phi3MLP chunks it)."""
    out = {}
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    for name, t in state.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            base = name.removesuffix("qkv_proj.weight")
            parts = t.split([q, kv, kv], dim=0)
            out.update({f"{base}{p}_proj.weight": w for p, w in zip("qkv", parts, strict=True)})
        elif name.endswith("mlp.gate_up_proj.weight"):
            base = name.removesuffix("gate_up_proj.weight")
            gate, up = t.chunk(2, dim=0)
            out.update({f"{base}gate_proj.weight": gate, f"{base}up_proj.weight": up})
        else:
            out[name] = t
    return out


class LlamaLM(nn.Module):
    """The model. ``prefill`` and ``decode`` are the two graphs that get compiled."""

    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.shape = s
        self.model = Backbone(s)
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)
        # Per layer, which of ``_masks``' masks it uses: 1 = the sliding window's.
        self._local = tuple(int(x) for x in s.sliding_layers) or (0,) * s.num_layers

    def _inv_freq(self) -> Tensor:
        return torch.tensor(self.shape.inv_freq, dtype=torch.float32)

    @classmethod
    def from_state(cls, s: LlamaShape, state: dict[str, Tensor]) -> tuple[LlamaLM, list[str]]:
        """The model holding ``state``'s tensors, and the names of the weights it lacked.

        Built on the meta device (no random init of weights that are replaced at once:
        about half of a 135M model's load time on a small CPU)."""
        with torch.device("meta"):
            lm = cls(s)
        state = split_fused(s, state)
        missing, unexpected = lm.load_state_dict(state, strict=False, assign=True)
        if unexpected:
            raise ValueError(f"weights do not fit: unexpected {unexpected[:5]}")
        lm.inv_freq = lm._inv_freq()
        lm.tie_weights()
        missing = [k for k in missing if not (s.tie_embeddings and k == "lm_head.weight")]
        return lm, missing

    def tie_weights(self) -> None:
        if self.shape.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, N, D]
        cos, sin = emb.cos(), emb.sin()
        if self.shape.rope_scale != 1.0:
            cos, sin = cos * self.shape.rope_scale, sin * self.shape.rope_scale
        return cos.to(dtype), sin.to(dtype)

    def _masks(self, slots: Tensor, positions: Tensor) -> tuple[Tensor, ...]:
        """Causal mask of each query position over the cache slots; with a sliding window,
        a second one that also hides the slots ``window`` or more positions back."""
        causal = slots <= positions
        window = self.shape.sliding_window
        if window is None:
            return (causal,)
        return causal, causal & (slots > positions - window)

    def _mlp_block(self, layer: DecoderLayer, h: Tensor, attn: Tensor) -> Tensor:
        h = h + attn
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def _logits(self, h: Tensor) -> Tensor:
        return self.lm_head(self.model.norm(h)).float()

    def prefill(
        self,
        input_ids: Tensor,
        positions: Tensor,
        last: Tensor,
        row: Tensor,
        slots: Tensor,
        k_cache: list[Tensor],
        v_cache: list[Tensor],
    ) -> Tensor:
        """One chunk of one prompt [1, C] into cache row ``row`` [1]; the logits at ``last``.

        ``positions`` [1, C] are the chunk's cache slots (a right-padded chunk's padding
        repeats a slot nobody attends to yet). ``k_cache``/``v_cache`` are the whole cache,
        one [rows, kv_heads, slots, head_dim] tensor per layer, as in ``decode``: the
        chunk's keys are written there in place, and its queries attend to the row's first
        ``L = len(slots)`` slots, each up to its own position (earlier chunks included).
        """
        h = self.model.embed_tokens(input_ids)
        cos, sin = self._cos_sin(positions, h.dtype)
        n = slots.shape[0]
        masks = self._masks(slots[None, :], positions[0, :, None])
        masks = tuple(m[None, None] for m in masks)  # [1, 1, C, L]
        where = positions[0]
        rows = row.expand(where.shape[0])
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            q, k, v = attn.qkv(layer.input_layernorm(h), cos, sin)
            keys, values = k_cache[i], v_cache[i]
            keys[rows, :, where] = k[0].transpose(0, 1)
            values[rows, :, where] = v[0].transpose(0, 1)
            seen_k = keys[:, :, :n].index_select(0, row)  # [1, kv_heads, L, head_dim]
            seen_v = values[:, :, :n].index_select(0, row)
            mask = masks[self._local[i]]
            h = self._mlp_block(layer, h, attn.attend(q, seen_k, seen_v, mask))
        return self._logits(h[0, last])

    def decode(
        self,
        input_ids: Tensor,
        positions: Tensor,
        slots: Tensor,
        k_cache: list[Tensor],
        v_cache: list[Tensor],
    ) -> Tensor:
        """One token per row [B, 1], each written at its own slot ``positions`` [B, 1].

        ``k_cache``/``v_cache`` are the whole cache, one [rows, kv_heads, slots, head_dim]
        tensor per layer; the step attends to its batch's rows and their first ``L`` slots,
        ``L = len(slots)`` (``slots`` = arange(L)), each row to the slots up to its own
        position, so rows of different lengths and ages decode in one step. The whole
        cache comes in, not a view of it: a compiled graph then writes the new keys in
        place (an in-place write into a view input is functionalised into a copy of the
        whole view, every layer, every step).
        """
        h = self.model.embed_tokens(input_ids)
        cos, sin = self._cos_sin(positions, h.dtype)
        b, n = input_ids.shape[0], slots.shape[0]
        masks = tuple(m[:, None, None, :] for m in self._masks(slots[None, :], positions))
        rows = torch.arange(b, device=h.device)  # masks: [B, 1, 1, L]
        where = positions[:, 0]
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            q, k, v = attn.qkv(layer.input_layernorm(h), cos, sin)
            keys, values = k_cache[i], v_cache[i]
            keys[rows, :, where] = k[:, :, 0]
            values[rows, :, where] = v[:, :, 0]
            out = attn.attend_one(q, keys[:b, :, :n], values[:b, :, :n], masks[self._local[i]])
            h = self._mlp_block(layer, h, out)
        return self._logits(h[:, -1])
