"""The engine: owns the models, their worker threads, the warmup steps and the gate."""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from inference_svc.compile_monitor import CompileMonitor, LateCompile
from inference_svc.config import ServiceConfig
from inference_svc.engine import warmup
from inference_svc.engine.embedding import EmbedWorker
from inference_svc.engine.gate import ServingGate
from inference_svc.engine.generation import GenerateWorker, GenJob
from inference_svc.engine.types import EmbedParams, EmbedResult, GenChunk, GenerateParams
from inference_svc.errors import InvalidArgument, Unavailable
from inference_svc.models.embedding import load_embedding
from inference_svc.models.generative import GenLimits, load_generative
from inference_svc.models.loading import (
    display_name,
    pick_device,
    pick_dtype,
    resolve_embed_dir,
    resolve_lm_dir,
)
from inference_svc.sampling import Sampler
from warmup_ctl.plan import ModelKind, ModelProfile, SamplerPath, Step, StepKind, plan

log = logging.getLogger(__name__)
EMBED_NAME = "embedding"
LM_NAME = "generative"


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
        self.embed: EmbedWorker | None = None
        self.gen: GenerateWorker | None = None
        self.loaded: list[LoadedModel] = []
        # What responses and Info call each model (e.g. "all-MiniLM-L6-v2").
        self.display_names: dict[str, str] = {}
        self.models_loaded = False
        self.compiled: dict[str, set[warmup.Bucket]] = {EMBED_NAME: set(), LM_NAME: set()}
        # Called with (serving, reason) whenever the health of the service changes.
        self.on_health: Callable[[bool, str], None] = lambda serving, reason: None

    # -- lifecycle ----------------------------------------------------------------
    def load(self) -> None:
        """Load the configured models (blocking: run it off the event loop)."""
        c = self.config
        self.monitor.install()
        device = pick_device(c.device)
        dtype = pick_dtype(c.dtype, device)
        if c.embed_model != "none":
            self._load(EMBED_NAME, ModelKind.EMBEDDING, lambda: self._load_embed(device, dtype))
        if c.lm_model != "none":
            self._load(LM_NAME, ModelKind.GENERATIVE, lambda: self._load_lm(device, dtype))
        self._seed(c.seed)  # a fresh process starts from the configured random state
        self.models_loaded = True

    def _load(self, name: str, kind: ModelKind, fn: Callable[[], None]) -> None:
        log.info("loading model %s (%s)", name, kind.value)
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        self.loaded.append(LoadedModel(name, kind, took))
        log.info("loaded model %s in %.1f s", name, took)

    def _load_embed(self, device: torch.device, dtype: torch.dtype) -> None:
        c = self.config
        directory = resolve_embed_dir(c.embed_model)
        self.display_names[EMBED_NAME] = display_name(c.embed_model, directory)
        model = load_embedding(
            EMBED_NAME,
            directory,
            c.embed_max_batch,
            c.compilation_mode,
            self.monitor,
            device,
            dtype,
        )
        model.warm_text()
        self.embed = EmbedWorker(model, c.max_queue)

    def _load_lm(self, device: torch.device, dtype: torch.dtype) -> None:
        c = self.config
        limits = GenLimits(c.gen_max_batch, c.max_input_tokens, c.max_new_tokens)
        directory = resolve_lm_dir(c.lm_model)
        self.display_names[LM_NAME] = display_name(c.lm_model, directory)
        cache = Path(c.model_cache_dir).expanduser() if c.model_cache_dir else None
        model = load_generative(
            LM_NAME, directory, limits, c.compilation_mode, self.monitor, device, dtype, cache
        )
        if c.kv_cache_tokens is not None:
            model.allocate_cache(c.kv_cache_tokens)
        model.warm_text()
        sampler = Sampler(LM_NAME, c.compilation_mode, self.monitor)
        self.gen = GenerateWorker(model, sampler, c.logprobs_mode, c.max_queue)

    def close(self) -> None:
        for worker in (self.embed, self.gen):
            if worker is not None:
                worker.stop()
        self.monitor.close()

    # -- describe and the plan ----------------------------------------------------
    def profiles(self) -> list[ModelProfile]:
        c = self.config
        out: list[ModelProfile] = []
        if self.embed is not None:
            buckets = tuple(warmup.embed_buckets(self.embed.model))
            out.append(
                ModelProfile(
                    EMBED_NAME,
                    ModelKind.EMBEDDING,
                    False,
                    False,
                    c.compilation_mode,
                    c.logprobs_mode,
                    buckets,
                )
            )
        if self.gen is not None:
            buckets = tuple(warmup.generative_buckets(self.gen.model))
            out.append(
                ModelProfile(
                    LM_NAME,
                    ModelKind.GENERATIVE,
                    True,
                    c.kv_cache_tokens is not None,
                    c.compilation_mode,
                    c.logprobs_mode,
                    buckets,
                )
            )
        return out

    def required_steps(self) -> list[Step]:
        return list(plan(self.profiles()).steps)

    # -- warmup steps --------------------------------------------------------------
    async def warmup(
        self, model: str, kind: StepKind, paths: list[SamplerPath]
    ) -> warmup.StepReport:
        self._require_loaded()
        if self.gate.serving:
            log.info("warmup %s %s asked for after SERVING", kind.name, model)
        fn = self._step(model, kind, paths)
        worker = self.gen if model == LM_NAME else self.embed
        assert worker is not None
        report: warmup.StepReport = await asyncio.wrap_future(worker.call(fn))
        if not report.skipped:
            self.gate.invalidate_reseed()
        self.gate.record_warmup(kind, model, report.paths)
        log.info(
            "warmup %s %s: %s in %.1f s, %d compile events",
            kind.name,
            model,
            report.skip_reason if report.skipped else report.detail,
            report.seconds,
            report.compile_events,
        )
        return report

    def _step(
        self, model: str, kind: StepKind, paths: list[SamplerPath]
    ) -> Callable[[], warmup.StepReport]:
        c, mon = self.config, self.monitor
        if model == EMBED_NAME and self.embed is not None:
            m = self.embed.model
            if kind is StepKind.COMPILE:
                embed = self.embed
                return lambda: warmup.compile_buckets(
                    m, self.compiled[EMBED_NAME], mon, after=embed.warm_request
                )
            reason = "embedding model: no KV cache" if kind is StepKind.PROFILE else "no sampler"
            return lambda: warmup.StepReport(model, kind, True, f"{reason}: nothing to warm")
        if model == LM_NAME and self.gen is not None:
            g = self.gen
            done = self.compiled[LM_NAME]
            if kind is StepKind.PROFILE:
                return lambda: warmup.profile(g.model, c.kv_cache_memory_fraction, done, mon)
            if kind is StepKind.COMPILE:
                return lambda: warmup.compile_buckets(g.model, done, mon)
            if kind is StepKind.SAMPLER:
                want = paths or self._sampler_paths(model)
                return lambda: warmup.warm_sampler(g.model, g.sampler, want, c.logprobs_mode, mon)
        loaded = ", ".join(m.name for m in self.loaded) or "none"
        raise InvalidArgument(
            f"warmup: no step {kind.name} for model {model!r} (loaded models: {loaded})"
        )

    def _sampler_paths(self, model: str) -> list[SamplerPath]:
        for step in self.required_steps():
            if step.kind is StepKind.SAMPLER and step.model == model:
                return list(step.sampler_paths)
        return []

    def reseed(self, seed: int | None) -> int:
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

    def mark_serving(self) -> None:
        self._require_loaded()
        self.gate.mark_serving(self.required_steps())
        self.monitor.mark_serving()
        log.info("health: SERVING (boot %s)", self.boot_id)
        self.on_health(True, "warmed up")

    def _on_late_compile(self, event: LateCompile) -> None:
        if self.config.on_late_compile != "fail" or self.gate.failed:
            return
        self.gate.failed = f"compile after SERVING ({event.describe()}); --on-late-compile fail"
        log.error("health: NOT_SERVING: %s", self.gate.failed)
        self.on_health(False, self.gate.failed)

    # -- requests ---------------------------------------------------------------
    def _require_loaded(self) -> None:
        if not self.models_loaded:
            raise Unavailable("models are still loading; retry shortly")

    def _require_serving(self) -> None:
        if not self.gate.serving:
            raise Unavailable(
                "the service is warming up (not SERVING yet); retry when grpc.health.v1 "
                "reports SERVING for inference.v1.Inference"
            )

    async def embed_texts(self, params_of: Callable[[int], EmbedParams]) -> EmbedResult:
        self._require_serving()
        if self.embed is None:
            raise InvalidArgument("no embedding model is loaded (start with --embed-model)")
        job = self.embed.prepare(params_of(self.embed.model.max_batch))
        self.embed.submit(job)
        return await asyncio.wrap_future(job.future)

    async def generate(self, params_of: Callable[[int], GenerateParams]) -> AsyncIterator[GenChunk]:
        self._require_serving()
        if self.gen is None:
            raise InvalidArgument("no generative model is loaded (start with --lm-model)")
        params = params_of(self.gen.model.limits.max_new_tokens)
        ids = self.gen.prepare(params)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[GenChunk | BaseException] = asyncio.Queue()
        job = GenJob(ids, params, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        self.gen.submit(job)
        try:
            while True:
                event = await events.get()
                if isinstance(event, BaseException):
                    raise event
                yield event
                if event.finish is not None:
                    return
        finally:
            job.cancelled.set()
