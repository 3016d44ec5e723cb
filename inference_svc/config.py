"""Service configuration: parsed once, from flags and environment, into a frozen dataclass.

Every setting has a flag; the environment variable named beside it (read at
parse time, never at import) supplies the default.
"""

from __future__ import annotations

import argparse
import enum
import os
from collections.abc import Sequence
from dataclasses import dataclass

from inference_api.names import DEFAULT_ADMIN_HOST, DEFAULT_ADMIN_PORT, DEFAULT_PORT
from inference_api.plan import CompilationMode, LogprobsMode

ENV_PREFIX = "INFERENCE_SVC_"


class LateCompilePolicy(enum.Enum):
    """What a compile after SERVING (a cold path reached by a request) does to health."""

    WARN = "warn"  # logged and counted (Info, late_compile_events)
    FAIL = "fail"  # also turns health NOT_SERVING


@dataclass(frozen=True)
class ServiceConfig:
    host: str = "0.0.0.0"  # public interface
    port: int = DEFAULT_PORT  # public port: Inference, health, reflection (0 = any)
    admin_host: str = DEFAULT_ADMIN_HOST  # admin port binds here: loopback only by default
    admin_port: int = DEFAULT_ADMIN_PORT  # WarmupAdmin (0 = any)
    metrics_host: str = "0.0.0.0"  # Prometheus /metrics listens here
    metrics_port: int | None = None  # None: no metrics endpoint; 0: any free port
    port_file: str | None = None  # write {"port", "admin_port", "pid"} here once listening
    embed_model: str = "default"  # "default" (packaged MiniLM), "none", or a directory
    lm_model: str = "default"  # "default" (packaged SmolLM2), "none", or a directory
    # Converted (dequantized) GGUF models are kept here; "" turns the cache off.
    model_cache_dir: str = "~/.cache/inference-svc/models"
    compilation_mode: CompilationMode = CompilationMode.NONE
    logprobs_mode: LogprobsMode = LogprobsMode.RAW
    seed: int = 0  # global random state at start and the seed Describe hands to Reseed
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    embed_max_batch: int = 32  # most inputs per Embed batch
    gen_max_batch: int = 4  # most sequences decoded together (KV-cache rows)
    max_input_tokens: int = 512  # longest Generate prompt
    max_new_tokens: int = 512  # largest max_tokens
    kv_cache_tokens: int | None = None  # explicit KV-cache size; None = sized by PROFILE
    kv_cache_memory_fraction: float = 0.5  # share of free memory PROFILE may give the cache
    max_queue: int = 256  # queued requests per model before RESOURCE_EXHAUSTED
    # Largest request message the public port accepts (grpc answers RESOURCE_EXHAUSTED past it).
    max_request_bytes: int = 4 * 2**20
    on_late_compile: LateCompilePolicy = LateCompilePolicy.WARN
    grace_period: float = 10.0  # seconds in-flight calls get on SIGTERM
    log_level: str = "info"


def _env(name: str, default: object) -> object:
    return os.environ.get(ENV_PREFIX + name.upper(), default)


def build_parser() -> argparse.ArgumentParser:
    d = ServiceConfig()
    p = argparse.ArgumentParser(
        prog="inference-svc",
        description="gRPC inference service (Embed, Generate) behind a warmup health gate. "
        f"Each flag's default can be set by the environment variable {ENV_PREFIX}<FLAG>, "
        f"e.g. {ENV_PREFIX}COMPILATION_MODE=default.",
    )
    add = p.add_argument
    add("--host", default=_env("host", d.host))
    add("--port", type=int, default=_env("port", d.port))
    add("--admin-host", default=_env("admin_host", d.admin_host))
    add("--admin-port", type=int, default=_env("admin_port", d.admin_port))
    add("--port-file", default=_env("port_file", None))
    add("--metrics-host", default=_env("metrics_host", d.metrics_host))
    add(
        "--metrics-port",
        type=int,
        default=_env("metrics_port", None),
        help="serve Prometheus metrics at http://HOST:PORT/metrics (default: off; 0 = any port)",
    )
    add(
        "--embed-model",
        default=_env("embed_model", d.embed_model),
        help="'default' (all-MiniLM-L6-v2), 'none', or a local model directory",
    )
    add(
        "--lm-model",
        default=_env("lm_model", d.lm_model),
        help="'default' (SmolLM2-135M-Instruct), 'none', or a local model directory",
    )
    add(
        "--model-cache-dir",
        default=_env("model_cache_dir", d.model_cache_dir),
        help="where converted GGUF models are kept between starts ('' = no cache)",
    )
    add(
        "--compilation-mode",
        choices=[m.value for m in CompilationMode],
        default=_env("compilation_mode", d.compilation_mode.value),
    )
    add(
        "--logprobs-mode",
        choices=[m.value for m in LogprobsMode],
        default=_env("logprobs_mode", d.logprobs_mode.value),
    )
    add("--seed", type=int, default=_env("seed", d.seed))
    add("--device", default=_env("device", d.device))
    add(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default=_env("dtype", d.dtype),
    )
    add("--embed-max-batch", type=int, default=_env("embed_max_batch", d.embed_max_batch))
    add("--gen-max-batch", type=int, default=_env("gen_max_batch", d.gen_max_batch))
    add("--max-input-tokens", type=int, default=_env("max_input_tokens", d.max_input_tokens))
    add("--max-new-tokens", type=int, default=_env("max_new_tokens", d.max_new_tokens))
    add(
        "--kv-cache-tokens",
        type=int,
        default=_env("kv_cache_tokens", None),
        help="explicit KV-cache size in tokens (default: sized by the PROFILE warmup step)",
    )
    add(
        "--kv-cache-memory-fraction",
        type=float,
        default=_env("kv_cache_memory_fraction", d.kv_cache_memory_fraction),
    )
    add("--max-queue", type=int, default=_env("max_queue", d.max_queue))
    add(
        "--max-request-bytes",
        type=int,
        default=_env("max_request_bytes", d.max_request_bytes),
        help="largest request message accepted on the public port (default 4 MiB)",
    )
    add(
        "--on-late-compile",
        choices=[p.value for p in LateCompilePolicy],
        default=_env("on_late_compile", d.on_late_compile.value),
    )
    add("--grace-period", type=float, default=_env("grace_period", d.grace_period))
    add("--log-level", default=_env("log_level", d.log_level))
    return p


def parse_config(argv: Sequence[str] | None = None) -> ServiceConfig:
    p = build_parser()
    a = p.parse_args(argv)
    if a.gen_max_batch < 2 or a.embed_max_batch < 1:
        p.error("--gen-max-batch must be at least 2 and --embed-max-batch at least 1")
    if a.max_input_tokens < 2 or a.max_new_tokens < 1:
        p.error("--max-input-tokens must be at least 2 and --max-new-tokens at least 1")
    if not 0 < a.kv_cache_memory_fraction <= 1:
        p.error("--kv-cache-memory-fraction must be in (0, 1]")
    return ServiceConfig(
        host=a.host,
        port=int(a.port),
        admin_host=a.admin_host,
        admin_port=int(a.admin_port),
        port_file=a.port_file,
        metrics_host=a.metrics_host,
        metrics_port=None if a.metrics_port in (None, "") else int(a.metrics_port),
        embed_model=a.embed_model,
        lm_model=a.lm_model,
        model_cache_dir=a.model_cache_dir,
        compilation_mode=CompilationMode(a.compilation_mode),
        logprobs_mode=LogprobsMode(a.logprobs_mode),
        seed=int(a.seed),
        device=a.device,
        dtype=a.dtype,
        embed_max_batch=int(a.embed_max_batch),
        gen_max_batch=int(a.gen_max_batch),
        max_input_tokens=int(a.max_input_tokens),
        max_new_tokens=int(a.max_new_tokens),
        kv_cache_tokens=None if a.kv_cache_tokens in (None, "") else int(a.kv_cache_tokens),
        kv_cache_memory_fraction=float(a.kv_cache_memory_fraction),
        max_queue=int(a.max_queue),
        max_request_bytes=int(a.max_request_bytes),
        on_late_compile=LateCompilePolicy(a.on_late_compile),
        grace_period=float(a.grace_period),
        log_level=a.log_level,
    )
