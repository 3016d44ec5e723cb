"""The engine: the lifecycle of the model runtimes, the serving gate, and routing.

It loads the runtimes the registry names (engine/registry.py), plans their warmup with the
contract's decision table, routes each warmup step to its runtime by name and each request
to the runtime that answers its RPC, and keeps the gate that decides when the service may
be SERVING. What a model is and how it warms is the runtime's business (engine/runtime.py);
kept compiled artifacts are engine/kept.py's.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from inference_api.plan import CompilationMode, ModelKind, ModelProfile, Plan, Step, StepKind, plan
from inference_svc import kernels
from inference_svc.compile_monitor import CompileMonitor, LateCompile
from inference_svc.config import LateCompilePolicy, ServiceConfig
from inference_svc.engine.compute import ComputeThread
from inference_svc.engine.gate import ServingGate
from inference_svc.engine.kept import KeptArtifacts
from inference_svc.engine.registry import KINDS
from inference_svc.engine.runtime import LoadEnv, ModelKindEntry, ModelRuntime, StepReport
from inference_svc.engine.types import RuntimeInfo
from inference_svc.errors import InvalidArgument, Unavailable
from inference_svc.models import cpu
from inference_svc.models.aoti import PackageStore, ScratchPackages

log = logging.getLogger(__name__)
WARMING = (StepKind.PROFILE, StepKind.COMPILE, StepKind.SAMPLER)  # steps that compile


@dataclass(frozen=True)
class LoadedModel:
    name: str
    kind: ModelKind
    seconds: float


class Engine:
    def __init__(self, config: ServiceConfig, kinds: tuple[ModelKindEntry, ...] = KINDS) -> None:
        self.config = config
        self.kinds = kinds
        self.boot_id = uuid.uuid4().hex
        self.monitor = CompileMonitor()
        self.monitor.on_late = self._on_late_compile
        self.gate = ServingGate()
        self.compute = ComputeThread()  # runs every model's work (engine/compute.py)
        self.runtimes: dict[str, ModelRuntime] = {}  # by runtime name, in load order
        self.loaded: list[LoadedModel] = []
        self.warmup_reports: list[StepReport] = []  # every step run in this process, in order
        self.models_loaded = False
        self.artifacts: KeptArtifacts | None = None  # --compile-cache-dir
        self._scratch: ScratchPackages | None = None  # packages without --compile-cache-dir
        # Called with (serving, reason) whenever the health of the service changes.
        self.on_health: Callable[[bool, str], None] = lambda serving, reason: None
        # Called with the reason when this process must be restarted (the app stops it).
        self.on_restart: Callable[[str], None] = lambda reason: None

    # -- lifecycle ----------------------------------------------------------------
    def load(self) -> None:
        """Load the configured models (blocking: run it off the event loop)."""
        self.monitor.install()
        # this project's C++ ops (decode attention, package runs) are kept beside the artifacts
        kernels.set_directory(self.config.compile_cache_dir)
        # --lm-weights and --embed-dtype auto become concrete here, once: the kept artifacts'
        # key and the loaders see only that; the reason goes to Describe and Info (numerics).
        self.config, auto = cpu.resolve(self.config)
        chosen = [(k, m) for k in self.kinds if (m := k.model(self.config)) is not None]
        dirs = {k.name: k.resolve(m) for k, m in chosen}
        self.artifacts = KeptArtifacts.open(self.config, dirs, self.compute)
        env = LoadEnv(
            self.config, self.monitor, self.compute, self._packages(), auto.lm.tag, auto.embed.tag
        )
        for kind, _ in chosen:
            self._load_one(kind, env, dirs[kind.name])
        self._seed(self.config.seed)  # a fresh process starts from the configured random state
        self.models_loaded = True

    def _load_one(self, kind: ModelKindEntry, env: LoadEnv, directory: object) -> None:
        log.info("loading model %s", kind.name)
        start = time.perf_counter()
        kept = self.artifacts
        if kept is not None:
            kept.before_load()

        # On the compute thread: it is the only thread that runs torch's parallel kernels
        # in this process (engine/compute.py says why). With AOTInductor, outside its
        # inference mode: weights made there would be inference tensors, which torch.export
        # cannot trace (models/aoti.py); forward passes still run under inference mode.
        # (Not for torch.compile: Dynamo keeps no package of a graph whose weights are
        # normal tensors, "Graph contains named parameters due to static addresses".)
        aoti = self.config.compile_backend == "aoti"

        def load() -> ModelRuntime:
            with torch.inference_mode(False) if aoti else contextlib.nullcontext():
                return kind.load(env, directory)

        try:
            runtime = self.compute.run(load).result()
        except Exception as exc:
            if kept is not None:
                kept.load_failed(kind.name, exc)
            raise
        self.runtimes[kind.name] = runtime
        if kept is not None:
            kept.after_load(runtime)
        took = time.perf_counter() - start
        self.loaded.append(LoadedModel(kind.name, runtime.kind, took))
        log.info("loaded model %s in %.1f s", kind.name, took)

    def _packages(self) -> PackageStore | None:
        """Where AOTInductor packages are found and kept: the kept artifacts, or a scratch
        directory of this process (no --compile-cache-dir)."""
        c = self.config
        if c.compile_backend != "aoti" or c.compilation_mode is CompilationMode.NONE:
            return None
        if self.artifacts is not None:
            return self.artifacts.store
        self._scratch = ScratchPackages()
        return self._scratch

    def close(self) -> None:
        for runtime in self.runtimes.values():
            runtime.close()
        if self._scratch is not None:
            self._scratch.close()
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
            if runtime.artifacts == "loaded" and self.artifacts is not None:
                why = f"{step.kind.name} {step.model} failed with them: {exc}"
                restart = self.artifacts.step_failed(why)
                self.on_restart(why)
                raise restart from exc
            raise
        self.warmup_reports.append(report)
        if not report.skipped:
            self.gate.invalidate_reseed()
        self.gate.record_warmup(report.as_step())
        if self.artifacts is not None:
            compiling = [s for s in self.required_steps() if s.kind in WARMING]
            await self.artifacts.publish_when_warm(self.boot_id, compiling, self.gate.is_done)
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

    def serving(self, rpc: str) -> ModelRuntime:
        """The runtime that answers ``rpc`` ("Embed", "Generate"); Unavailable before SERVING."""
        if not self.gate.serving:
            raise Unavailable(
                "the service is warming up (not SERVING yet); retry when grpc.health.v1 "
                "reports SERVING for inference.v1.Inference"
            )
        for runtime in self.runtimes.values():
            if runtime.rpc == rpc:
                return runtime
        flags = [k.flag for k in self.kinds if k.rpc == rpc]
        hint = f" (start with {flags[0]})" if flags else ""
        raise InvalidArgument(f"no model that answers {rpc} is loaded{hint}")

    def _require_loaded(self) -> None:
        if not self.models_loaded:
            raise Unavailable("models are still loading; retry shortly")
