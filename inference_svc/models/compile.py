"""How a model function is compiled under each compilation mode."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch._inductor.config as inductor_config

from inference_api.plan import CompilationMode

# Whether compiled graphs freeze the weights (--freeze-weights): set once at start.
_FREEZE = {"weights": False}

_MODES = {
    CompilationMode.DEFAULT: "default",
    CompilationMode.MAX_AUTOTUNE: "max-autotune-no-cudagraphs",
}


def set_freezing(freeze: bool) -> None:
    """Freeze weights into the graphs that compile_fn makes from now on (or not)."""
    _FREEZE["weights"] = freeze


def compile_fn(fn: Callable[..., Any], mode: CompilationMode) -> Callable[..., Any]:
    """``fn`` itself in mode NONE, else ``torch.compile(fn)`` with dynamic shapes. CUDA
    graphs stay off: the KV cache is written in place between calls.

    With set_freezing(True) the weights become constants of the graph, so inductor folds
    what depends only on them and prepacks linear weights for oneDNN/MKL (faster steps),
    but torch 2.13 caches no frozen graph (AOTAutograd bypasses it, the FX graph cache
    cannot pickle prepacked mkldnn weights, Dynamo packages refuse it): every start
    compiles again. Freezing is set around each call (the compile happens inside the
    first): torch 2.13 ignores ``freezing`` passed as a torch.compile option, and its
    config is per thread. Freezing needs the callers' ``torch.inference_mode``.
    """
    if mode is CompilationMode.NONE:
        return fn
    compiled = torch.compile(fn, dynamic=True, mode=_MODES[mode], fullgraph=False)
    if not _FREEZE["weights"]:
        return compiled

    @functools.wraps(fn)
    def frozen(*args: Any) -> Any:
        with inductor_config.patch(freezing=True):
            return compiled(*args)

    return frozen


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
