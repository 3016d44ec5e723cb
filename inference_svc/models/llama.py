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

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inference_svc.models.decoder_shape import LlamaShape


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if offset else torch.ones(size))
        self.eps = eps
        self.offset = offset  # Gemma: scale by 1 + weight, in float32, then cast

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)


def _softcapped(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, s: LlamaShape) -> Tensor:
    """Attention with tanh-capped scores (Gemma 2: SDPA has no cap), in float32 softmax.
    ``q`` [B, KV, Q, D] against ``k``/``v`` [B, KV, L, D], ``mask`` broadcast to the scores."""
    scale = s.attn_scale if s.attn_scale is not None else s.head_dim**-0.5
    cap = s.attn_softcap
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype), v)


class Attention(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.s = s
        self.q_proj = nn.Linear(s.hidden_size, s.num_heads * s.head_dim, bias=s.qkv_bias)
        self.k_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=s.qkv_bias)
        self.v_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=s.qkv_bias)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=s.o_bias)
        norm = s.qk_norm
        self.q_norm = RMSNorm(s.head_dim, s.rms_eps, s.norm_offset) if norm else None
        self.k_norm = RMSNorm(s.head_dim, s.rms_eps, s.norm_offset) if norm else None
        self.qkv_proj: nn.Module | None = None  # q, k and v as one layer (see fuse)

    def fuse(self) -> None:
        """q, k and v become one layer (rows in that order): one product per step where
        there were three, each reading the same input (see LlamaLM.fuse)."""
        self.qkv_proj = fused_linear(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b, n, _ = x.shape
        s = self.s
        assert self.qkv_proj is not None, "Attention.fuse() was not called"
        kv = s.num_kv_heads * s.head_dim
        q, k, v = self.qkv_proj(x).split([s.num_heads * s.head_dim, kv, kv], dim=-1)
        q = q.reshape(b, n, s.num_heads, s.head_dim)
        k = k.reshape(b, n, s.num_kv_heads, s.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.reshape(b, n, s.num_kv_heads, s.head_dim).transpose(1, 2)
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        b, heads, n, d = q.shape
        s = self.s
        if s.attn_softcap is not None:  # the query heads of one KV head side by side
            kv = k.shape[1]
            grouped = q.reshape(b, kv, heads // kv * n, d)
            m = mask.expand(b, 1, n, mask.shape[-1]).repeat(1, 1, heads // kv, 1)
            out = _softcapped(grouped, k, v, m, s).reshape(b, heads, n, d)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=True, scale=s.attn_scale
            )
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
        if self.s.attn_softcap is not None:
            out = _softcapped(grouped, k, v, mask, self.s)
        else:
            out = F.scaled_dot_product_attention(
                grouped, k, v, attn_mask=mask, scale=self.s.attn_scale
            )
        return self.o_proj(out.reshape(b, 1, heads * d))

    def attend_cache(self, q: Tensor, k: Tensor, v: Tensor, where: Tensor, window: int) -> Tensor:
        """``attend_one`` by this project's kernel (inference_svc/kernels): each row to the
        slots up to its position ``where`` [B] (and no further back than ``window``, if set),
        no mask tensor; the query heads grouped per KV head as there."""
        b, heads, _, d = q.shape
        grouped = q.reshape(b, k.shape[1], heads // k.shape[1], d)
        scale = self.s.attn_scale if self.s.attn_scale is not None else d**-0.5
        out = torch.ops.inference.decode_attention(grouped, k, v, where, window, scale)
        return self.o_proj(out.reshape(b, 1, heads * d))


class MLP(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=s.mlp_bias)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=s.mlp_bias)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=s.mlp_bias)
        self.gate_up_proj: nn.Module | None = None  # gate and up as one layer (see fuse)
        self.gelu = s.activation == "gelu_tanh"

    def fuse(self) -> None:
        """gate and up become one layer (gate's rows first)."""
        self.gate_up_proj = fused_linear(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: Tensor) -> Tensor:
        assert self.gate_up_proj is not None, "MLP.fuse() was not called"
        g, up = self.gate_up_proj(x).chunk(2, dim=-1)
        g = F.gelu(g, approximate="tanh") if self.gelu else F.silu(g)
        return self.down_proj(g * up)


def fused_linear(*parts: nn.Linear) -> nn.Linear:
    """One linear layer computing ``parts`` side by side: their weight rows (and biases)
    stacked in order. Each output is the same dot product as before, so the layer computes
    what the parts did (a weight format converts it row by row, as it did each part)."""
    weight = torch.cat([p.weight.detach() for p in parts])
    biases = [p.bias for p in parts]
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=biases[0] is not None, device="meta")
    out.weight = nn.Parameter(weight)
    if biases[0] is not None:
        out.bias = nn.Parameter(torch.cat([b.detach() for b in biases]))
    return out


class DecoderLayer(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        norm = lambda: RMSNorm(s.hidden_size, s.rms_eps, s.norm_offset)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = Attention(s)
        # Llama: the norm before the MLP. Gemma 2 ("sandwich"): the norm of the attention's
        # output, with a norm before and after the MLP beside it.
        self.post_attention_layernorm = norm()
        self.mlp = MLP(s)
        if s.sandwich_norms:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()


class Backbone(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(s) for _ in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_eps, s.norm_offset)


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


def _cos_sin(
    positions: Tensor, inv_freq: Tensor, scale: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, N, D]
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


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
        self.register_buffer("inv_freq", self._inv_freq(s.inv_freq), persistent=False)
        if s.local_inv_freq is not None:
            local = self._inv_freq(s.local_inv_freq)
            self.register_buffer("local_inv_freq", local, persistent=False)
        # Per layer, which of ``_masks``' masks it uses: 1 = the sliding window's; and which
        # of ``_cos_sin``'s rope tables: 1 = the local one (Gemma 3).
        self._local = tuple(int(x) for x in s.sliding_layers) or (0,) * s.num_layers
        self._rope_of = tuple(int(x) for x in s.local_rope_layers) or (0,) * s.num_layers
        # decode's attention: torch's SDPA, or "native" (Attention.attend_cache; set by the
        # loader once the kernel is registered, for a model it supports: native_unsupported)
        self.decode_attention = "sdpa"

    def native_unsupported(self, device: torch.device, dtype: torch.dtype) -> str:
        """Why the native decode attention cannot run this model ("" when it can)."""
        if device.type != "cpu":
            return f"no {device.type} kernel"
        if dtype not in (torch.float32, torch.bfloat16):
            return f"no {dtype} kernel"
        if self.shape.attn_softcap is not None:
            return "the model caps its attention scores (softcap)"
        return ""

    @staticmethod
    def _inv_freq(freq: tuple[float, ...]) -> Tensor:
        return torch.tensor(freq, dtype=torch.float32)

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
        lm.inv_freq = lm._inv_freq(s.inv_freq)
        if s.local_inv_freq is not None:
            lm.local_inv_freq = lm._inv_freq(s.local_inv_freq)
        lm.tie_weights()
        missing = [k for k in missing if not (s.tie_embeddings and k == "lm_head.weight")]
        return lm, missing

    def fuse(self) -> None:
        """Each layer's q/k/v and gate/up as one product each, once the weights are loaded
        (the forward passes need it): a decode step of one row runs seven small products a
        layer otherwise, and each call costs more than its bytes (SmolLM2's int4 layers on
        an AVX-512 CPU: 152 us a layer apart, 133 fused)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def tie_weights(self) -> None:
        if self.shape.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _ropes(self, positions: Tensor, dtype: torch.dtype) -> tuple[tuple[Tensor, Tensor], ...]:
        """The cos/sin tables at ``positions``: the rope's, and the local layers' second."""
        s = self.shape
        tables = (_cos_sin(positions, self.inv_freq, s.rope_scale, dtype),)
        if s.local_inv_freq is None:
            return tables
        return (*tables, _cos_sin(positions, self.local_inv_freq, s.local_rope_scale, dtype))

    def _masks(self, slots: Tensor, positions: Tensor) -> tuple[Tensor, ...]:
        """Causal mask of each query position over the cache slots; with a sliding window,
        a second one that also hides the slots ``window`` or more positions back."""
        causal = slots <= positions
        window = self.shape.sliding_window
        if window is None:
            return (causal,)
        return causal, causal & (slots > positions - window)

    def _mlp_block(self, layer: DecoderLayer, h: Tensor, attn: Tensor) -> Tensor:
        if self.shape.sandwich_norms:
            h = h + layer.post_attention_layernorm(attn)
            mlp = layer.mlp(layer.pre_feedforward_layernorm(h))
            return h + layer.post_feedforward_layernorm(mlp)
        h = h + attn
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def _embed(self, input_ids: Tensor) -> Tensor:
        h = self.model.embed_tokens(input_ids)
        if self.shape.embed_scale is not None:  # Gemma: sqrt(hidden), in the weights' dtype
            h = h * torch.tensor(self.shape.embed_scale, dtype=h.dtype)
        return h

    def _logits(self, h: Tensor) -> Tensor:
        logits = self.lm_head(self.model.norm(h)).float()
        cap = self.shape.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

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
        h = self._embed(input_ids)
        ropes = self._ropes(positions, h.dtype)
        n = slots.shape[0]
        masks = self._masks(slots[None, :], positions[0, :, None])
        masks = tuple(m[None, None] for m in masks)  # [1, 1, C, L]
        where = positions[0]
        rows = row.expand(where.shape[0])
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            q, k, v = attn.qkv(layer.input_layernorm(h), *ropes[self._rope_of[i]])
            keys, values = k_cache[i], v_cache[i]
            # the cache may be float16 under a float32 model (--kv-cache-dtype)
            keys[rows, :, where] = k[0].transpose(0, 1).to(keys.dtype)
            values[rows, :, where] = v[0].transpose(0, 1).to(values.dtype)
            seen_k = keys[:, :, :n].index_select(0, row).to(q.dtype)  # [1, kv_heads, L, head_dim]
            seen_v = values[:, :, :n].index_select(0, row).to(q.dtype)
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
        h = self._embed(input_ids)
        ropes = self._ropes(positions, h.dtype)
        b, n = input_ids.shape[0], slots.shape[0]
        native = self.decode_attention == "native"
        masks = () if native else self._masks(slots[None, :], positions)
        masks = tuple(m[:, None, None, :] for m in masks)  # [B, 1, 1, L]
        rows = torch.arange(b, device=h.device)
        where = positions[:, 0]
        windows = (0, self.shape.sliding_window or 0)
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            q, k, v = attn.qkv(layer.input_layernorm(h), *ropes[self._rope_of[i]])
            keys, values = k_cache[i], v_cache[i]
            keys[rows, :, where] = k[:, :, 0].to(keys.dtype)
            values[rows, :, where] = v[:, :, 0].to(values.dtype)
            seen_k, seen_v = keys[:b, :, :n], values[:b, :, :n]
            if native:  # the kernel reads a float16 cache as it is
                out = attn.attend_cache(q, seen_k, seen_v, where, windows[self._local[i]])
            else:
                seen_k, seen_v = seen_k.to(q.dtype), seen_v.to(q.dtype)
                out = attn.attend_one(q, seen_k, seen_v, masks[self._local[i]])
            h = self._mlp_block(layer, h, out)
        return self._logits(h[:, -1])
