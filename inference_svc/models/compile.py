"""What every model is built with, and how a model function is compiled under each mode."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch._inductor.config as inductor_config

from inference_api.plan import CompilationMode
from inference_svc.compile_monitor import CompileMonitor
from inference_svc.models.aoti import AotiGraph, Family, PackageStore, inductor_options

_MODES = {
    CompilationMode.DEFAULT: "default",
    CompilationMode.MAX_AUTOTUNE: "max-autotune-no-cudagraphs",
}


@dataclass(frozen=True)
class ModelContext:
    """One model's settings, passed whole to its loader and its class."""

    name: str  # the runtime's name: what Describe, Warmup and the compile monitor call it
    mode: CompilationMode
    monitor: CompileMonitor
    device: torch.device
    dtype: torch.dtype
    freeze: bool = False  # --freeze-weights: weights become constants of compiled graphs
    backend: str = "torch-compile"  # --compile-backend: "aoti" or "torch-compile"
    packages: PackageStore | None = None  # where AOTInductor packages are found and kept

    def compile(self, module: torch.nn.Module, family: Family | None = None) -> Callable[..., Any]:
        """``module`` as the compiled mode runs it: itself (NONE), an AOTInductor package
        (backend aoti, for a module with a graph ``family``) or torch.compile."""

        def dynamo() -> Callable[..., Any]:
            return compile_fn(module, self.mode, self.freeze)

        if self.mode is CompilationMode.NONE:
            return module
        if self.backend != "aoti" or family is None or self.packages is None:
            return dynamo()
        name = f"{self.name}-{family.graph}"
        options = inductor_options(self.mode, self.freeze, module)
        return AotiGraph(module, family, name, options, self.packages, self.monitor, dynamo)


def compile_fn(
    fn: Callable[..., Any], mode: CompilationMode, freeze: bool = False
) -> Callable[..., Any]:
    """``fn`` itself in mode NONE, else ``torch.compile(fn)`` with dynamic shapes. CUDA
    graphs stay off: the KV cache is written in place between calls.

    With ``freeze`` the weights become constants of the graph, so inductor folds what
    depends only on them and prepacks linear weights for oneDNN/MKL (faster steps), but
    torch 2.13 caches no frozen graph (AOTAutograd bypasses it, the FX graph cache cannot
    pickle prepacked mkldnn weights, Dynamo packages refuse it): every start compiles again.
    Freezing is set around each call (the compile happens inside the first): torch 2.13
    ignores ``freezing`` passed as a torch.compile option, and its config is per thread.
    Freezing needs the callers' ``torch.inference_mode``.
    """
    if mode is CompilationMode.NONE:
        return fn
    compiled = torch.compile(fn, dynamic=True, mode=_MODES[mode], fullgraph=False)
    if not freeze:
        return compiled

    @functools.wraps(fn)
    def frozen(*args: Any) -> Any:
        with inductor_config.patch(freezing=True):
            return compiled(*args)

    return frozen
