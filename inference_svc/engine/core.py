"""The engine: the lifecycle of the model runtimes, the serving gate, and routing.

It loads the runtimes the factory names, plans their warmup with the contract's
decision table, routes each warmup step and each request to its runtime, and
keeps the gate that decides when the service may be SERVING. What a model is and
how it warms is the runtime's business (engine/runtime.py).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import random
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from inference_api.plan import ModelKind, ModelProfile, Plan, Step, StepKind, plan
from inference_svc.compile_monitor import CompileMonitor, LateCompile
from inference_svc.config import LateCompilePolicy, ServiceConfig
from inference_svc.engine import artifacts
from inference_svc.engine.compute import ComputeThread
from inference_svc.engine.embed_runtime import EmbeddingRuntime
from inference_svc.engine.factory import LOAD_FLAG, model_dirs, runtime_specs
from inference_svc.engine.gate import ServingGate
from inference_svc.engine.generate_runtime import GenerativeRuntime
from inference_svc.engine.runtime import ModelRuntime, StepReport
from inference_svc.engine.types import RuntimeInfo
from inference_svc.errors import InvalidArgument, Unavailable
from inference_svc.models.compile import set_freezing

log = logging.getLogger(__name__)
R = TypeVar("R")
WARMING = (StepKind.PROFILE, StepKind.COMPILE, StepKind.SAMPLER)  # steps that compile


@dataclass(frozen=True)
class LoadedModel:
    name: str
    kind: ModelKind
    seconds: float


class Engine:
    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.boot_id = uuid.uuid4().hex
        self.monitor = CompileMonitor()
        self.monitor.on_late = self._on_late_compile
        self.gate = ServingGate()
        self.compute = ComputeThread()  # runs every model's work (engine/compute.py)
        self.runtimes: dict[str, ModelRuntime] = {}  # by runtime name, in load order
        self.loaded: list[LoadedModel] = []
        self.warmup_reports: list[StepReport] = []  # every step run in this process, in order
        self.models_loaded = False
        self.artifacts: artifacts.CompileArtifacts | None = None  # --compile-cache-dir
        self._kept = False  # this process has kept (or loaded) its artifacts
        # Called with (serving, reason) whenever the health of the service changes.
        self.on_health: Callable[[bool, str], None] = lambda serving, reason: None

    # -- lifecycle ----------------------------------------------------------------
    def load(self) -> None:
        """Load the configured models (blocking: run it off the event loop)."""
        self.monitor.install()
        # Before any model is built: compile_fn reads it when it wraps a model function.
        set_freezing(self.config.freeze_weights)
        self.artifacts = artifacts.for_config(self.config, model_dirs(self.config))
        if self.artifacts is not None:
            # Before any model is built: torch.compile looks up Dynamo packages then.
            self.compute.run(self.artifacts.open).result()
        for spec in runtime_specs(self.config, self.monitor, self.compute):
            log.info("loading model %s (%s)", spec.name, spec.kind.value)
            start = time.perf_counter()
            before = artifacts.dynamo_cache_counts()
            # On the compute thread: it is the only thread that runs torch's parallel
            # kernels in this process (engine/compute.py says why).
            try:
                runtime = self.runtimes[spec.name] = self.compute.run(spec.load).result()
            except Exception as exc:
                if self.artifacts is not None and self.artifacts.loaded:
                    moved = self.artifacts.discard(f"loading {spec.name} failed: {exc!r}")
                    log.error(
                        "compiled artifacts: loading model %s with them failed (%r); set "
                        "aside as %s: the next start compiles", spec.name, exc, moved,
                    )  # fmt: skip
                raise
            if self.artifacts is not None:
                runtime.artifacts = self.artifacts.model_status(spec.name, before)
                if runtime.artifacts == "loaded":
                    runtime.loaded_from_artifacts()
            took = time.perf_counter() - start
            self.loaded.append(LoadedModel(spec.name, spec.kind, took))
            log.info("loaded model %s in %.1f s", spec.name, took)
        self._seed(self.config.seed)  # a fresh process starts from the configured random state
        self.models_loaded = True

    def close(self) -> None:
        for runtime in self.runtimes.values():
            runtime.close()
        self.monitor.close()
        if self.artifacts is not None:
            self.artifacts.close()

    # -- the plan -----------------------------------------------------------------
    def profiles(self) -> list[ModelProfile]:
        return [r.profile() for r in self.runtimes.values()]

    def plan(self) -> Plan:
        """The contract's decision table over the loaded models: what MarkServing requires."""
        return plan(self.profiles())

    def required_steps(self) -> list[Step]:
        return list(self.plan().steps)

    # -- warmup, reseed, mark -----------------------------------------------------
    async def warmup(self, step: Step) -> StepReport:
        self._require_loaded()
        runtime = self.runtimes.get(step.model)
        if runtime is None:
            loaded = ", ".join(self.runtimes) or "none"
            raise InvalidArgument(f"model: {step.model!r} is not loaded (loaded models: {loaded})")
        if self.gate.serving:
            log.info("warmup %s %s asked for after SERVING", step.kind.name, step.model)
        try:
            report = await runtime.warm(step)
        except Exception as exc:
            if runtime.artifacts == "loaded":
                self._artifacts_failed(f"{step.kind.name} {step.model} failed with them: {exc}")
            raise
        self.warmup_reports.append(report)
        if not report.skipped:
            self.gate.invalidate_reseed()
        self.gate.record_warmup(report.as_step())
        await self._keep_artifacts()
        log.info(
            "warmup %s %s: %s in %.1f s, %d compile events",
            step.kind.name,
            step.model,
            report.skip_reason if report.skipped else report.detail,
            report.seconds,
            report.compile_events,
        )
        return report

    def _refuse_unless_rewarm(self, call: str, rewarm: bool) -> None:
        self.gate.check_rewarm(call, rewarm)
        if self.gate.serving:
            log.warning("%s on a SERVING service (rewarm=true)", call)

    def reseed(self, seed: int | None, rewarm: bool = False) -> int:
        self._refuse_unless_rewarm("Reseed", rewarm)
        value = self.config.seed if seed is None else seed
        self._seed(value)
        self.gate.record_reseed()
        log.info("reseeded the random state with %d", value)
        return value

    @staticmethod
    def _seed(seed: int) -> None:
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)

    async def mark_serving(self, rewarm: bool = False) -> None:
        self._require_loaded()
        self._refuse_unless_rewarm("MarkServing", rewarm)
        self.gate.check(self.required_steps())
        # Loading and compiling leave millions of objects behind: collect them now and
        # move the survivors out of the collector's sight, so that a full collection does
        # not land on one of the first requests.
        gc.collect()
        gc.freeze()
        # Then the request path once more, right before SERVING (only Embed has one to
        # touch): the generative model's steps and the collection ran since it last ran,
        # and steady Embed calls find MiniLM's 90 MB of weights and their own objects in
        # the CPU's caches (L3 480 MiB here); the first one after them did not (first Embed
        # after a restart 1.2-1.4x the steady median, `bench/cold_start.py`).
        for runtime in self.runtimes.values():
            await runtime.touch()
        self.gate.mark_serving(self.required_steps())
        self.monitor.mark_serving()
        log.info("health: SERVING (boot %s)", self.boot_id)
        self.on_health(True, "warmed up")

    def _artifacts_failed(self, reason: str) -> None:
        """Loaded artifacts broke a warmup step (a torch error, not a miss: a miss just
        compiles). This process cannot unload them: set them aside so that the next start
        compiles, and stop (SIGTERM) so that the supervisor starts that process."""
        assert self.artifacts is not None
        moved = self.artifacts.discard(reason)
        log.error("compiled artifacts: %s; set aside as %s; stopping to start without them",
                  reason, moved)  # fmt: skip
        os.kill(os.getpid(), signal.SIGTERM)

    async def _keep_artifacts(self) -> None:
        """Once every warmup step has run, keep what this start compiled for the next one:
        inside the last step, so no request shares the CPU with it and a process killed
        right after SERVING has kept them already."""
        if self.artifacts is None or self._kept:
            return
        if not all(self.gate.is_done(s) for s in self.required_steps() if s.kind in WARMING):
            return
        self._kept = True
        start = time.perf_counter()
        try:
            outcome = await asyncio.to_thread(self.artifacts.publish, self.boot_id)
            log.info("compiled artifacts: %s (%.1f s)", outcome, time.perf_counter() - start)
        except Exception:  # never let keeping artifacts fail the warmup
            log.exception("compiled artifacts: could not keep them")

    def _on_late_compile(self, event: LateCompile) -> None:
        if self.config.on_late_compile is not LateCompilePolicy.FAIL:
            return
        reason = f"compile after SERVING ({event.describe()}); --on-late-compile fail"
        if self.gate.fail(reason):
            log.error("health: NOT_SERVING: %s", reason)
            self.on_health(False, reason)

    # -- routing requests ---------------------------------------------------------
    def infos(self) -> list[RuntimeInfo]:
        return [r.info() for r in self.runtimes.values()]

    def embedder(self) -> EmbeddingRuntime:
        """The runtime that answers Embed; Unavailable before SERVING."""
        return self._serving_runtime(ModelKind.EMBEDDING, EmbeddingRuntime)

    def generator(self) -> GenerativeRuntime:
        """The runtime that answers Generate; Unavailable before SERVING."""
        return self._serving_runtime(ModelKind.GENERATIVE, GenerativeRuntime)

    def _serving_runtime(self, kind: ModelKind, cls: type[R]) -> R:
        if not self.gate.serving:
            raise Unavailable(
                "the service is warming up (not SERVING yet); retry when grpc.health.v1 "
                "reports SERVING for inference.v1.Inference"
            )
        for runtime in self.runtimes.values():
            if runtime.kind is kind and isinstance(runtime, cls):
                return runtime
        raise InvalidArgument(f"no {kind.value} model is loaded (start with {LOAD_FLAG[kind]})")

    def _require_loaded(self) -> None:
        if not self.models_loaded:
            raise Unavailable("models are still loading; retry shortly")
