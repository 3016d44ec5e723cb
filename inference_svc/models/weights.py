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
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inference_svc.config import LM_WEIGHTS

log = logging.getLogger(__name__)
GROUP = 32


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
        groups = w.view(n, k // GROUP, GROUP)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        q = ((groups - low) / scale).round().clamp(0, 15)
        self.max_error = float(((q * scale + low) - groups).abs().max())
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


def convert_linears(lm: nn.Module, scheme: str) -> None:
    """Swap the linear layers of ``lm`` for ``scheme`` in place ("same": leave them)."""
    if scheme not in LM_WEIGHTS:
        raise ValueError(f"--lm-weights {scheme!r} is not one of {', '.join(LM_WEIGHTS)}")
    if scheme == "same":
        return
    if next(lm.parameters()).device.type != "cpu":
        raise ValueError(f"--lm-weights {scheme} runs on the CPU only")
    worst, kept = 0.0, []
    for parent in list(lm.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if scheme == "int4" and name != "lm_head" and Int4Linear.fits(child):
                layer = Int4Linear(child)
                worst = max(worst, layer.max_error)
                setattr(parent, name, layer)
            else:
                if scheme == "int4":
                    kept.append(name)
                setattr(parent, name, BFloat16Linear(child))
    if scheme == "int4":
        log.info(
            "linear layers in int4 groups of %d (largest weight change %.3g; "
            "%s kept in bfloat16)", GROUP, worst, ", ".join(sorted(set(kept))) or "none",
        )  # fmt: skip
    else:
        log.info("linear layers in bfloat16")


def numerics(dtype: torch.dtype, scheme: str, why: str = "") -> str:
    """What a model computes in, as Describe and Info report it: ``float32``,
    ``float32+int4-linear`` (the dtype, then the linear layers' weights if other), then why
    --lm-weights auto chose them: ``float32+int4-linear (auto: AMX-BF16)``."""
    name = str(dtype).removeprefix("torch.")
    if not (scheme == "same" or (scheme == "bfloat16" and dtype == torch.bfloat16)):
        name = f"{name}+{scheme}-linear"
    return f"{name} (auto: {why})" if why else name
