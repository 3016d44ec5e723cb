"""Lighter weights for the generative model's linear layers (``--lm-weights``).

A decode step reads every weight once per step and CPU decode is bound by those
bytes, so the linear layers are where smaller weights pay. Only they change: the
residual stream, the norms, attention and the KV cache keep the model's dtype, and
each layer casts its input to the weights' dtype and its output back.

- ``bfloat16``: the weights in bfloat16 (oneDNN runs them on AMX when compiled).
- ``int4``: 4-bit weights in groups of 32 along the input dimension, each group with
  its own scale and minimum, run by ``aten._weight_int4pack_mm_for_cpu`` (bfloat16
  activations). The packaged SmolLM2 is a Q4_1 GGUF, whose blocks are exactly that
  (32 weights, a scale and a minimum): its weights come back bit for bit (checked at
  load, logged). The output layer (tied to the Q8_0 embedding) stays in bfloat16.

``--linear-kernel native`` runs the ``int4`` scheme on this project's kernel instead
(``inference::quant_linear``, inference_svc/kernels/quant_linear.cpp: integer dot products
against the activations quantised in two 8-bit terms a group of 32): the same 4-bit
groups with float16 scales and minimums (as the GGUF keeps them), and the output layer in
8-bit groups of 32 (the GGUF's own Q8_0), both in ``QuantLinear``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inference_svc.config import LM_WEIGHTS

log = logging.getLogger(__name__)
GROUP = 32


def int4_groups(
    w: Tensor, store: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor, Tensor, float]:
    """``w`` [n, k] float32 in 4-bit groups of 32, w ~ q * scale + low: q [n, k/32, 32] in
    [0, 15] (as float), scale and low [n, k/32, 1] (float32 holding values of ``store``, the
    dtype they are kept in: q is rounded against those), and the largest weight change."""
    n, k = w.shape
    groups = w.view(n, k // GROUP, GROUP)
    low = groups.amin(-1, keepdim=True).to(store).float()
    high = groups.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=torch.finfo(store).tiny).to(store).float()
    q = ((groups - low) / scale).round().clamp(0, 15)
    return q, scale, low, float(((q * scale + low) - groups).abs().max())


class BFloat16Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.register_buffer("weight", linear.weight.detach().to(torch.bfloat16))
        # A bias (Qwen2's q/k/v) stays in the input's dtype, added after the product.
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias)

    def forward(self, x: Tensor) -> Tensor:
        out = F.linear(x.to(torch.bfloat16), self.weight).to(x.dtype)
        return out if self.bias is None else out + self.bias


class Int4Linear(nn.Module):
    """``x @ W.T`` with W stored as 4-bit groups: w = (q - 8) * scale + zero."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        n, k = w.shape
        q, scale, low, self.max_error = int4_groups(w)
        zero = low + 8 * scale
        # [k / GROUP, n, 2] (scale, zero) in the activations' dtype, as the kernel wants.
        pairs = torch.stack([scale.squeeze(-1), zero.squeeze(-1)], -1).transpose(0, 1)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).view(n, k), 1)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", pairs.contiguous().to(torch.bfloat16))
        self.out_features = n

    @staticmethod
    def fits(linear: nn.Linear) -> bool:
        n, k = linear.weight.shape
        return linear.bias is None and k % GROUP == 0 and n % 16 == 0

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat, self.packed, GROUP, self.scales_and_zeros
        )
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


class QuantLinear(nn.Module):
    """``x @ W.T`` on ``inference::quant_linear`` (the library must be loaded: kernels.load):
    W in ``bits`` 4 (w = q * scale + min, q in [0, 15]) or 8 (w = q * scale, q in
    [-128, 127]) groups of 32 along the input dimension, in the kernel's layout of blocks of 8
    output rows."""

    BLOCK = 8  # output rows a block of the kernel's layout

    def __init__(self, linear: nn.Linear, bits: int) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        n, k = w.shape
        # scales and minimums in float16, as GGUF keeps Q4_1 and Q8_0 (its weights come back
        # exactly)
        if bits == 4:
            q, scale, low, self.max_error = int4_groups(w, torch.float16)
        else:
            groups, low = w.view(n, k // GROUP, GROUP), None
            scale = groups.abs().amax(-1, keepdim=True) / 127
            scale = scale.clamp(min=torch.finfo(torch.float16).tiny).half().float()
            q = (groups / scale).round().clamp(-128, 127)
            self.max_error = float((q * scale - groups).abs().max())
        b = self.BLOCK
        if bits == 4:  # [n/8, k/8, 32]: a byte holds index i in its low nibble, i + 4 in its high
            v = q.to(torch.uint8).view(n // b, b, k // 8, 2, 4).permute(0, 2, 3, 1, 4)
            v = v.reshape(n // b, k // 8, 2, 32)
            packed = v[:, :, 0] | (v[:, :, 1] << 4)
        else:  # [n/8, k/4, 32]: 4 consecutive inputs of each of the block's 8 rows
            packed = q.to(torch.int8).view(n // b, b, k // 4, 4).permute(0, 2, 1, 3)
            packed = packed.reshape(n // b, k // 4, 32)

        def per_block(t: Tensor) -> Tensor:  # [n, k/32, 1] -> [n/8, k/32, 8] float16
            return t.view(n // b, b, k // GROUP).transpose(1, 2).half().contiguous()

        self.register_buffer("q", packed.contiguous())
        self.register_buffer("scales", per_block(scale))
        empty = torch.empty(0, dtype=torch.float16)
        self.register_buffer("mins", per_block(low) if low is not None else empty)
        self.bits, self.out_features = bits, n

    @classmethod
    def fits(cls, linear: nn.Linear) -> bool:
        n, k = linear.weight.shape
        return linear.bias is None and k % GROUP == 0 and n % cls.BLOCK == 0

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.inference.quant_linear(x, self.q, self.scales, self.mins, self.bits)


def convert_linears(lm: nn.Module, scheme: str, kernel: str = "torch") -> None:
    """Swap the linear layers of ``lm`` for ``scheme`` in place ("same": leave them), run by
    ``kernel``: "torch" or "native" (``QuantLinear``: the int4 scheme only)."""
    if scheme not in LM_WEIGHTS:
        raise ValueError(f"--lm-weights {scheme!r} is not one of {', '.join(LM_WEIGHTS)}")
    if kernel == "native" and scheme != "int4":
        raise ValueError(f"--linear-kernel native runs --lm-weights int4, not {scheme}")
    if scheme == "same":
        return
    if next(lm.parameters()).device.type != "cpu":
        raise ValueError(f"--lm-weights {scheme} runs on the CPU only")
    if scheme == "bfloat16":
        _swap(lm, lambda name, child: None)
        log.info("linear layers in bfloat16")
        return
    if kernel == "native":  # the output layer in 8 bits (Q8_0), the rest in 4

        def make(name: str, child: nn.Linear) -> nn.Module | None:
            return (
                QuantLinear(child, 8 if name == "lm_head" else 4)
                if QuantLinear.fits(child)
                else None
            )

        where = " on this project's kernel"
    else:

        def make(name: str, child: nn.Linear) -> nn.Module | None:
            return Int4Linear(child) if name != "lm_head" and Int4Linear.fits(child) else None

        where = ""
    kept = _swap(lm, make)
    worst = max((m.max_error for m in lm.modules()
                 if isinstance(m, Int4Linear) or (isinstance(m, QuantLinear) and m.bits == 4)),
                default=0.0)  # fmt: skip
    head = "; the output layer in int8 groups" if kernel == "native" else ""
    log.info(
        "linear layers in int4 groups of %d%s (largest weight change %.3g%s; %s kept in "
        "bfloat16)", GROUP, where, worst, head, ", ".join(sorted(set(kept))) or "none",
    )  # fmt: skip


def _swap(lm: nn.Module, make: Callable[[str, nn.Linear], nn.Module | None]) -> list[str]:
    """Each nn.Linear of ``lm`` replaced by ``make(name, linear)``, or in bfloat16 where that
    is None; the names of those kept in bfloat16."""
    kept = []
    for parent in list(lm.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                layer = make(name, child)
                if layer is None:
                    kept.append(name)
                setattr(parent, name, layer if layer is not None else BFloat16Linear(child))
    return kept


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``: how Describe, Info and the log name a dtype."""
    return str(dtype).removeprefix("torch.")


def numerics(
    dtype: torch.dtype, scheme: str, why: str = "", kernel: str = "torch",
    cache: torch.dtype | None = None,
) -> str:  # fmt: skip
    """What a model computes in, as Describe and Info report it: ``float32``,
    ``float32+int4-linear`` (the dtype, then the linear layers' weights if other; ``-native``
    on this project's kernel: 8-bit activations in the products, the output layer in int8),
    ``+float16-kv`` where the KV cache is in another dtype, then why --lm-weights auto chose
    the weights: ``float32+int4-linear (auto: AMX-BF16)``."""
    name = dtype_name(dtype)
    if not (scheme == "same" or (scheme == "bfloat16" and dtype == torch.bfloat16)):
        name = f"{name}+{scheme}-linear" + ("-native" if kernel == "native" else "")
    if cache is not None and cache != dtype:
        name += f"+{dtype_name(cache)}-kv"
    return f"{name} (auto: {why})" if why else name
