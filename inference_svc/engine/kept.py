"""The life of kept compiled artifacts in one process (engine/artifacts.py keys, verifies
and stores them): opened before any model is built, asked where each model's graphs came
from, published once every compiling step has run, set aside when they break a step."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from inference_api.plan import Step
from inference_svc.config import ServiceConfig
from inference_svc.engine import artifacts
from inference_svc.engine.compute import ComputeThread
from inference_svc.engine.runtime import ModelRuntime
from inference_svc.errors import Unavailable

log = logging.getLogger(__name__)


class RestartRequired(Unavailable):
    """This process cannot go on as it is (loaded artifacts broke a step and cannot be
    unloaded): the app stops it, and the supervisor's next start goes without them."""


class KeptArtifacts:
    def __init__(self, store: artifacts.CompileArtifacts) -> None:
        self.store = store
        self._published = False
        self._before: dict[str, int] = {}

    @classmethod
    def open(
        cls, config: ServiceConfig, dirs: dict[str, Path], compute: ComputeThread
    ) -> KeptArtifacts | None:
        """The kept artifacts ``config`` uses, opened (None: nothing is kept). Before any
        model is built, on the compute thread: torch.compile looks up Dynamo packages then."""
        store = artifacts.for_config(config, dirs)
        if store is None:
            return None
        compute.run(store.open).result()
        return cls(store)

    @property
    def entry(self) -> Path:
        return self.store.entry

    def before_load(self) -> None:
        self._before = artifacts.dynamo_cache_counts()

    def after_load(self, runtime: ModelRuntime) -> None:
        """Say where ``runtime``'s graphs came from ("loaded" or "compiled")."""
        packages = [g.source == "loaded" for g in runtime.graphs()]
        runtime.artifacts = self.store.model_status(runtime.name, self._before, packages)
        if runtime.artifacts == "loaded":
            runtime.loaded_from_artifacts()

    def load_failed(self, name: str, exc: BaseException) -> None:
        if self.store.loaded:
            moved = self.store.discard(f"loading {name} failed: {exc!r}")
            log.error(
                "compiled artifacts: loading model %s with them failed (%r); set aside as %s: "
                "the next start compiles", name, exc, moved,
            )  # fmt: skip

    def step_failed(self, reason: str) -> RestartRequired:
        """Loaded artifacts broke a warmup step (a torch error, not a miss: a miss just
        compiles). This process cannot unload them: set them aside so that the next start
        compiles; the caller raises what this returns, and the app stops the process."""
        moved = self.store.discard(reason)
        log.error("compiled artifacts: %s; set aside as %s; stopping to start without them",
                  reason, moved)  # fmt: skip
        return RestartRequired(reason)

    async def publish_when_warm(
        self, boot_id: str, compiling: Iterable[Step], done: Callable[[Step], bool]
    ) -> None:
        """Once every compiling step has run, keep what this start compiled for the next
        one: inside the last step, so no request shares the CPU with it and a process killed
        right after SERVING has kept them already."""
        if self._published or not all(done(s) for s in compiling):
            return
        self._published = True
        start = time.perf_counter()
        try:
            outcome = await asyncio.to_thread(self.store.publish, boot_id)
            log.info("compiled artifacts: %s (%.1f s)", outcome, time.perf_counter() - start)
        except Exception:  # never let keeping artifacts fail the warmup
            log.exception("compiled artifacts: could not keep them")

    def close(self) -> None:
        self.store.close()
