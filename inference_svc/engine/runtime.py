"""The model runtime interface: what the engine needs of each loaded model.

A runtime owns one model, its inbox and turn on the compute thread, the shape buckets it
batches into and the set of those already compiled. The engine routes warmup steps to
runtimes by name and requests by the RPC each answers, and knows nothing else about them:
a new kind of model is a module (its runtime and its ``ModelKindEntry``) and a line in
engine/registry.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

from inference_api.plan import (
    Bucket,
    CompilationMode,
    ModelKind,
    ModelProfile,
    SamplerPath,
    Step,
    StepKind,
)
from inference_svc.compile_monitor import CompileMonitor
from inference_svc.config import ServiceConfig
from inference_svc.engine.compute import ComputeThread
from inference_svc.engine.inbox import Inbox
from inference_svc.engine.types import RuntimeInfo
from inference_svc.models.aoti import AotiGraph, PackageStore
from inference_svc.models.compile import ModelContext
from inference_svc.models.loading import pick_device, pick_dtype

A = TypeVar("A")
T = TypeVar("T")


@dataclass
class StepReport:
    """What one warmup step did for one model."""

    model: str
    step: StepKind
    skipped: bool = False
    skip_reason: str = ""
    buckets: list[Bucket] = field(default_factory=list)  # shapes run (PROFILE, COMPILE)
    sampler_paths: list[SamplerPath] = field(default_factory=list)  # paths run (SAMPLER)
    seconds: float = 0.0
    compile_events: int = 0
    kv_cache_tokens: int = 0
    detail: str = ""

    @classmethod
    def skip(cls, model: str, step: StepKind, reason: str) -> StepReport:
        return cls(model, step, skipped=True, skip_reason=reason)

    def as_step(self) -> Step:
        """The step as the gate records it (with the sampler paths it warmed)."""
        return Step(self.step, self.model, tuple(self.sampler_paths))


def timed(monitor: CompileMonitor, report: StepReport, fn: Callable[[], None]) -> StepReport:
    """Run ``fn`` and fill in the report's time and the compile events it caused."""
    start = time.perf_counter()
    with monitor.counting() as box:
        fn()
    report.seconds = time.perf_counter() - start
    report.compile_events = box[0]
    return report


@dataclass(frozen=True)
class LoadEnv:
    """What the engine hands every model kind's loader."""

    config: ServiceConfig
    monitor: CompileMonitor
    compute: ComputeThread
    packages: PackageStore | None = None  # AOTInductor packages (--compile-backend aoti)
    # Why --lm-weights auto chose config.lm_weights ("AMX-BF16"); "" when it was named.
    lm_weights_auto: str = ""
    embed_dtype_auto: str = ""  # the same for --embed-dtype auto

    def context(self, name: str, dtype_setting: str = "same") -> ModelContext:
        """The settings the model of runtime ``name`` is built with; ``dtype_setting`` other
        than "same" (--embed-dtype) overrides --dtype for that model."""
        c = self.config
        device = pick_device(c.device)
        dtype = pick_dtype(c.dtype if dtype_setting == "same" else dtype_setting, device)
        return ModelContext(
            name, c.compilation_mode, self.monitor, device, dtype, c.freeze_weights,
            c.compile_backend, self.packages,
        )  # fmt: skip


@dataclass(frozen=True)
class ModelKindEntry:
    """A kind of model the service can load: registered once, in engine/registry.py."""

    name: str  # the runtime's name: Describe, Warmup and the compile monitor use it
    setting: str  # the ServiceConfig field naming the model ("none" leaves it out)
    rpc: str  # the Inference RPC its runtime answers ("Embed"); "" for none
    resolve: Callable[[str], Path]  # the model's directory from that setting
    load: Callable[[LoadEnv, Path], ModelRuntime]  # blocking: runs on the compute thread

    @property
    def flag(self) -> str:
        return "--" + self.setting.replace("_", "-")

    def model(self, config: ServiceConfig) -> str | None:
        """What ``config`` names for this kind; None when it is turned off."""
        value = getattr(config, self.setting)
        return None if value == "none" else value


@runtime_checkable
class ModelRuntime(Protocol):
    """One loaded model, as the engine sees it."""

    @property
    def name(self) -> str:
        """The name Describe, Warmup and the compile monitor use, e.g. "generative"."""

    @property
    def kind(self) -> ModelKind: ...

    @property
    def rpc(self) -> str:
        """The Inference RPC it answers ("Embed", "Generate"), or "" for none."""

    @property
    def limits(self) -> Any:
        """What a request may ask of it (``wire`` checks each request against them)."""

    def serve(self, params: Any) -> AsyncIterator[Any]:
        """Answer one request: its results as they come (one for Embed, chunks for Generate)."""

    @property
    def display_name(self) -> str:
        """The model's own name, as responses and Info give it (e.g. "all-MiniLM-L6-v2")."""

    @property
    def compiled(self) -> frozenset[Bucket]:
        """The buckets already compiled in this process (by PROFILE or COMPILE)."""

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens the KV cache holds; 0 without one, or before it is sized."""

    artifacts: str  # where its compiled graphs came from: "loaded", "compiled" or ""

    def loaded_from_artifacts(self) -> None:
        """Its compiled graphs came from kept artifacts (engine/artifacts.py)."""

    def graphs(self) -> list[Any]:
        """Its graphs that run from AOTInductor packages (models/aoti.py): none on the
        other backends."""

    async def touch(self) -> None:
        """Run the request path once (nothing random, nothing compiled), just before SERVING."""

    def profile(self) -> ModelProfile:
        """What the decision table needs to know about this model."""

    def buckets(self) -> tuple[Bucket, ...]:
        """Every shape the runtime can batch a request into: what COMPILE must run."""

    async def warm(self, step: Step) -> StepReport:
        """Run one warmup step (PROFILE, COMPILE or SAMPLER) on the compute thread."""

    def info(self) -> RuntimeInfo: ...

    def close(self) -> None: ...


class RuntimeBase:
    """What every runtime shares: its name, display name, inbox, compiled set, and
    a text thread: tokenizing a request runs there, never on the event loop (a long text
    would stall every other call, health checks included), one at a time (a tokenizer is
    not meant to be called from two threads at once)."""

    def __init__(self, name: str, display_name: str, inbox: Inbox, monitor: CompileMonitor) -> None:
        self._name = name
        self.display_name = display_name
        self.inbox = inbox
        self.monitor = monitor
        self._compiled: set[Bucket] = set()
        # Where its compiled graphs came from: "loaded", "compiled" or "" (engine/artifacts.py).
        self.artifacts = ""
        self._text = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"text-{name}")

    @property
    def name(self) -> str:
        return self._name

    async def on_text_thread(self, fn: Callable[[A], T], arg: A) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._text, fn, arg)

    @property
    def compiled(self) -> frozenset[Bucket]:
        return frozenset(self._compiled)

    def loaded_from_artifacts(self) -> None:
        self.artifacts = "loaded"

    def graphs(self) -> list[AotiGraph]:
        return list(getattr(getattr(self, "model", None), "graphs", []))

    def backend(self, mode: CompilationMode) -> tuple[str, str]:
        """How its compiled graphs run, and their proof, as Describe says them."""
        if mode is CompilationMode.NONE:
            return "", ""
        graphs = self.graphs()
        if not graphs:
            return "torch-compile", ""
        fallbacks = [g.backend for g in graphs if g.source == "fallback"]
        proof = "; ".join(text for g in graphs if (text := g.proof_text()))
        return (fallbacks[0] if fallbacks else "aoti"), proof

    async def touch(self) -> None:
        return None

    def _info(self, model: Any, **fields: Any) -> RuntimeInfo:
        """What every runtime's Info says, and ``fields``: what only this kind says."""
        return RuntimeInfo(
            name=self.display_name, kind=self.kind, dtype=model.numerics, device=str(model.device),
            compilation_mode=model.mode, late_compile_events=self.monitor.late_by_model[self.name],
            **fields,
        )  # fmt: skip

    def close(self) -> None:
        self.inbox.stop()
        # Not cancelled: what the output stage still has to send (a stop's answers) is sent.
        self._text.shutdown(wait=False)
