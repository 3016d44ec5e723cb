"""The one place that knows which runtimes a configuration asks for, and how to load each.

A new kind of model is a runtime module and an entry here; the engine, ``wire`` and the
servicers route by runtime name and kind and need no change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from inference_api.plan import ModelKind
from inference_svc.compile_monitor import CompileMonitor
from inference_svc.config import ServiceConfig
from inference_svc.engine.compute import ComputeThread
from inference_svc.engine.embed_runtime import EmbeddingRuntime
from inference_svc.engine.generate_runtime import GenerativeRuntime, KvCachePolicy
from inference_svc.engine.runtime import ModelRuntime
from inference_svc.limits import GenLimits
from inference_svc.models.embedding import load_embedding
from inference_svc.models.generative import load_generative
from inference_svc.models.loading import (
    display_name,
    pick_device,
    pick_dtype,
    resolve_embed_dir,
    resolve_lm_dir,
)

# Runtime names: what Describe, Warmup and the compile monitor call each model.
EMBED_NAME = "embedding"
LM_NAME = "generative"
# The flag that loads a model of each kind (named in "no such model" errors).
LOAD_FLAG = {ModelKind.EMBEDDING: "--embed-model", ModelKind.GENERATIVE: "--lm-model"}


@dataclass(frozen=True)
class RuntimeSpec:
    name: str
    kind: ModelKind
    load: Callable[[], ModelRuntime]  # blocking: runs off the event loop


def runtime_specs(
    config: ServiceConfig, monitor: CompileMonitor, compute: ComputeThread
) -> list[RuntimeSpec]:
    """The runtimes ``config`` asks for, in the order they load and warm."""
    c = config
    specs: list[RuntimeSpec] = []
    if c.embed_model != "none":
        specs.append(
            RuntimeSpec(
                EMBED_NAME, ModelKind.EMBEDDING, lambda: _load_embedding(c, monitor, compute)
            )
        )
    if c.lm_model != "none":
        specs.append(
            RuntimeSpec(
                LM_NAME, ModelKind.GENERATIVE, lambda: _load_generative(c, monitor, compute)
            )
        )
    return specs


def model_dirs(config: ServiceConfig) -> dict[str, Path]:
    """The directory of each configured model (what kept compiled artifacts are keyed on)."""
    dirs = {}
    if config.embed_model != "none":
        dirs[EMBED_NAME] = resolve_embed_dir(config.embed_model)
    if config.lm_model != "none":
        dirs[LM_NAME] = resolve_lm_dir(config.lm_model)
    return dirs


def _device_and_dtype(c: ServiceConfig) -> tuple[torch.device, torch.dtype]:
    device = pick_device(c.device)
    return device, pick_dtype(c.dtype, device)


def _load_embedding(
    c: ServiceConfig, monitor: CompileMonitor, compute: ComputeThread
) -> EmbeddingRuntime:
    device, dtype = _device_and_dtype(c)
    directory = resolve_embed_dir(c.embed_model)
    model = load_embedding(
        EMBED_NAME, directory, c.embed_max_batch, c.compilation_mode, monitor, device, dtype
    )
    model.warm_text()
    return EmbeddingRuntime(
        model, display_name(c.embed_model, directory), c.max_queue, monitor, compute,
        batch_wait_s=c.embed_batch_wait_ms / 1000,
    )  # fmt: skip


def _load_generative(
    c: ServiceConfig, monitor: CompileMonitor, compute: ComputeThread
) -> GenerativeRuntime:
    device, dtype = _device_and_dtype(c)
    limits = GenLimits(
        c.gen_max_batch, c.max_input_tokens, c.max_new_tokens, c.prefill_chunk_tokens
    )
    directory = resolve_lm_dir(c.lm_model)
    cache = Path(c.model_cache_dir).expanduser() if c.model_cache_dir else None
    model = load_generative(
        LM_NAME,
        directory,
        limits,
        c.compilation_mode,
        monitor,
        device,
        dtype,
        cache,
        c.lm_weights,
    )
    if c.kv_cache_tokens is not None:
        model.allocate_cache(c.kv_cache_tokens)
    model.warm_text()
    policy = KvCachePolicy(c.kv_cache_tokens is not None, c.kv_cache_memory_fraction)
    return GenerativeRuntime(
        model,
        display_name(c.lm_model, directory),
        c.logprobs_mode,
        policy,
        c.max_queue,
        monitor,
        compute,
    )
