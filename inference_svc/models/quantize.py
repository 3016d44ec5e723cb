"""Weight quantization options for the generative model's linear layers.

``int8``: int8 weights, one scale per output channel (torchao's weight-only int8),
activations stay in the model's dtype. A decode step reads a quarter of float32's
weight bytes; with bfloat16 activations inductor lowers each linear layer to
``aten._weight_int8pack_mm``. It pays in compiled modes; eager runs dequantize per call.
"""

from __future__ import annotations

import logging

import torch

from inference_svc.config import QUANTIZATIONS

log = logging.getLogger(__name__)


def quantize_linears(module: torch.nn.Module, scheme: str) -> None:
    """Quantize every ``nn.Linear`` of ``module`` in place (``none``: leave it)."""
    if scheme == "none":
        return
    if scheme != "int8":
        raise ValueError(f"quantization {scheme!r} is not one of {', '.join(QUANTIZATIONS)}")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchao's import-time deprecation notices
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

    quantize_(module, Int8WeightOnlyConfig())
    log.info("linear layers quantized: int8 weights, per-channel scales")


def numerics(dtype: torch.dtype, scheme: str) -> str:
    """What a model computes in, as Describe and Info report it: ``float32``,
    ``bfloat16``, ``bfloat16+int8`` (activations + weight quantization)."""
    name = str(dtype).removeprefix("torch.")
    return name if scheme == "none" else f"{name}+{scheme}"
