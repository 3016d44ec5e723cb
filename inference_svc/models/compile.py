"""How a model function is compiled under each compilation mode."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from inference_api.plan import CompilationMode

# Inductor options per mode. Freezing (every mode): the weights become constants of the
# graph, so inductor folds what depends only on them and prepacks linear weights for
# oneDNN, which runs bfloat16 GEMMs on the CPU's AMX tiles (measured on SmolLM2 decode,
# bfloat16, 8 rows: 33.8 ms a step frozen against 50.4 ms eager). torch.compile takes
# either a mode name or options, so max-autotune is spelled as its options.
_OPTIONS: dict[CompilationMode, dict[str, Any]] = {
    CompilationMode.DEFAULT: {"freezing": True},
    CompilationMode.MAX_AUTOTUNE: {"freezing": True, "max_autotune": True},
}


def compile_fn(fn: Callable[..., Any], mode: CompilationMode) -> Callable[..., Any]:
    """``fn`` itself in mode NONE, else ``torch.compile(fn)`` with dynamic shapes and
    frozen weights (the callers run it under ``torch.inference_mode``, which freezing
    needs). CUDA graphs stay off: the KV cache is written in place between calls.
    """
    if mode is CompilationMode.NONE:
        return fn
    return torch.compile(fn, dynamic=True, options=dict(_OPTIONS[mode]), fullgraph=False)


def length_buckets(limit: int, smallest: int = 16) -> tuple[int, ...]:
    """Powers of two from ``smallest`` up to ``limit`` (``limit`` itself last)."""
    out: list[int] = []
    n = smallest
    while n < limit:
        out.append(n)
        n *= 2
    out.append(limit)
    return tuple(out)


def batch_buckets(limit: int, mode: CompilationMode) -> tuple[int, ...]:
    """Powers of two up to ``limit``. Compiled, from 2: a batch of 1 is padded to 2, so no
    size-1 specialisation is left to compile later. Eager, from 1: nothing compiles, and
    on a CPU one row costs much less than two (a matrix-vector product)."""
    if mode is CompilationMode.NONE:
        return length_buckets(limit, smallest=1)
    return length_buckets(max(limit, 2), smallest=2)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
