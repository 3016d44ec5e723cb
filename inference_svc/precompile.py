"""``inference-svc precompile [flags]``: fill --compile-cache-dir and exit.

It loads the models the flags name and runs every warmup step Describe would require,
in process (no ports, no sidecar), then keeps the compiled artifacts exactly as a serving
process does (with --compile-backend aoti: the AOTInductor packages, frozen weights
too). For an image build stage or a Kubernetes Job that fills a shared cache volume: a
service started later with the same flags (and the same CPU, thread count,
torch and weights: the key) loads them and reaches SERVING without compiling.
"""

from __future__ import annotations

import asyncio
import logging
import time

from inference_api.plan import CompilationMode
from inference_svc.config import ServiceConfig
from inference_svc.engine.core import WARMING, Engine
from inference_svc.models import cpu

log = logging.getLogger("inference_svc")


async def precompile(config: ServiceConfig) -> int:
    """0 once the artifacts are kept (or were already), 1 with the reason otherwise."""
    if config.compilation_mode is CompilationMode.NONE:
        log.error("precompile: --compilation-mode none compiles nothing; name a compiled mode")
        return 1
    if not config.compile_cache_dir:
        log.error("precompile: needs --compile-cache-dir")
        return 1
    if config.freeze_weights and cpu.choices(config).backend != "aoti":
        log.error(
            "precompile: --freeze-weights on is kept only with --compile-backend aoti "
            "(torch.compile caches no frozen graph)"
        )
        return 1
    start = time.perf_counter()
    engine = Engine(config)
    try:
        await asyncio.to_thread(engine.load)
        steps = [s for s in engine.required_steps() if s.kind in WARMING]
        for n, step in enumerate(steps, 1):
            log.info("precompile: step %d/%d: %s %s", n, len(steps), step.kind.name, step.model)
            await engine.warmup(step)
        # The last warmup step kept the artifacts (Engine._keep_artifacts).
        assert engine.artifacts is not None
        kept = engine.artifacts.entry
        if not (kept / "manifest.json").is_file():
            log.error("precompile: nothing kept in %s (see above)", kept)
            return 1
        log.info("precompile: done in %.1f s; artifacts in %s", time.perf_counter() - start, kept)
        return 0
    except Exception as e:
        log.error("precompile failed: %s", e, exc_info=e)
        return 1
    finally:
        engine.close()
