"""Service configuration: parsed once, from flags and environment, into a frozen dataclass.

Every setting has a flag; the environment variable named beside it (read at
parse time, never at import) supplies the default.
"""

from __future__ import annotations

import argparse
import enum
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from inference_api.names import DEFAULT_ADMIN_HOST, DEFAULT_ADMIN_PORT, DEFAULT_PORT
from inference_api.plan import CompilationMode, LogprobsMode

# The generative model's linear-layer weights (inference_svc.models.weights applies them).
LM_WEIGHTS = ("same", "bfloat16", "int4")

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
    tls_cert_file: str | None = None  # TLS on the public port: certificate chain (PEM)
    tls_key_file: str | None = None  # ...and its private key (PEM)
    tls_client_ca_file: str | None = None  # require client certificates signed by this CA
    port_file: str | None = None  # write {"port", "admin_port", "pid"} here once listening
    embed_model: str = "default"  # "default" (packaged MiniLM), "none", or a directory
    lm_model: str = "default"  # "default" (packaged SmolLM2), "none", or a directory
    # Converted (dequantized) GGUF models are kept here; "" turns the cache off.
    model_cache_dir: str = "~/.cache/inference-svc/models"
    compilation_mode: CompilationMode = CompilationMode.NONE
    # Compiled artifacts (Dynamo packages, AOTAutograd and inductor caches) are kept here and
    # reused by the next start whose key matches; "" turns it off (inductor's own cache only).
    compile_cache_dir: str = "~/.cache/inference-svc/compile"
    # Freeze weights into compiled graphs (prepacked for oneDNN/MKL): faster steps, but torch
    # 2.13 caches no frozen graph, so every start compiles from scratch.
    freeze_weights: bool = False
    logprobs_mode: LogprobsMode = LogprobsMode.RAW
    seed: int = 0  # global random state at start and the seed Describe hands to Reseed
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    lm_weights: str = "same"  # linear layers of the LM: same as --dtype, bfloat16 or int4
    embed_max_batch: int = 32  # most inputs per Embed batch
    # Under concurrent Embed calls, how long a batch may wait for the callers of the last
    # one to come back (at most that batch's own time; 0 = never wait). See engine/worker.py.
    embed_batch_wait_ms: float = 20.0
    gen_max_batch: int = 16  # most sequences decoded together (KV-cache rows, memory allowing)
    prefill_chunk_tokens: int = 64  # most prompt tokens prefilled between two decode steps
    max_input_tokens: int = 512  # longest Generate prompt
    max_new_tokens: int = 512  # largest max_tokens
    kv_cache_tokens: int | None = None  # explicit KV-cache size; None = sized by PROFILE
    kv_cache_memory_fraction: float = 0.5  # share of free memory PROFILE may give the cache
    max_queue: int = 256  # queued requests per model before RESOURCE_EXHAUSTED
    # Largest request message the public port accepts (grpc answers RESOURCE_EXHAUSTED past it).
    max_request_bytes: int = 4 * 2**20
    on_late_compile: LateCompilePolicy = LateCompilePolicy.WARN
    grace_period: float = 10.0  # seconds in-flight calls get on SIGTERM
    # Shared token every admin call must carry; "" = none. From --admin-token-file or the
    # environment only (a flag's value would show in ps). Kept out of repr and logs.
    admin_token: str = field(default="", repr=False)
    log_level: str = "info"


def _env(name: str, default: object) -> object:
    return os.environ.get(ENV_PREFIX + name.upper(), default)


def _flag(p: argparse.ArgumentParser, name: str, default: object, text: str, **kw: object) -> None:
    """A flag whose default comes from INFERENCE_SVC_<NAME>; its help line says both."""
    dest = name.removeprefix("--").replace("-", "_")
    env = ENV_PREFIX + dest.upper()
    shown = (
        "off" if default is None else (default.value if isinstance(default, enum.Enum) else default)
    )
    value = default.value if isinstance(default, enum.Enum) else default
    p.add_argument(
        name, default=_env(dest, value), help=f"{text} (default: {shown!s}; env {env})", **kw
    )


def build_parser() -> argparse.ArgumentParser:
    d = ServiceConfig()
    p = argparse.ArgumentParser(
        prog="inference-svc",
        description="gRPC inference service (Embed, Generate) behind a warmup health gate: "
        "NOT_SERVING until warmup-ctl has run the warmup steps Describe requires. Each "
        "flag's default can also be set by the environment variable named beside it. "
        "'inference-svc precompile [flags]' runs the warmup steps in process, keeps the "
        "compiled artifacts in --compile-cache-dir and exits.",
    )
    f = functools.partial(_flag, p)
    f("--host", d.host, "public interface (Inference, grpc.health.v1, reflection)")
    f("--port", d.port, "public gRPC port; 0 picks a free one", type=int)
    f("--admin-host", d.admin_host, "WarmupAdmin interface: keep it loopback")
    f("--admin-port", d.admin_port, "WarmupAdmin port; 0 picks a free one", type=int)
    f("--metrics-host", d.metrics_host, "Prometheus /metrics interface")
    f("--metrics-port", d.metrics_port, "Prometheus /metrics port; 0 picks one", type=int)
    f("--tls-cert-file", d.tls_cert_file, "TLS on the public port: certificate chain (PEM)")
    f("--tls-key-file", d.tls_key_file, "TLS on the public port: private key (PEM)")
    f(
        "--tls-client-ca-file",
        d.tls_client_ca_file,
        "require client certificates signed by this CA (mutual TLS; needs --tls-cert-file)",
    )
    f("--port-file", d.port_file, "write the ports, pid and boot id here as JSON once listening")
    f("--embed-model", d.embed_model, "'default' (all-MiniLM-L6-v2), 'none' or a model directory")
    f("--lm-model", d.lm_model, "'default' (SmolLM2-135M-Instruct), 'none' or a model directory")
    f("--model-cache-dir", d.model_cache_dir, "converted GGUF models kept here ('' = no cache)")
    f(
        "--compilation-mode",
        d.compilation_mode,
        "none (eager) or a torch.compile mode",
        choices=[m.value for m in CompilationMode],
    )
    f(
        "--compile-cache-dir",
        d.compile_cache_dir,
        "compiled artifacts kept here for the next start ('' = none)",
    )
    f(
        "--freeze-weights",
        "off",
        "on: weights frozen into compiled graphs (faster steps; every start compiles)",
        choices=["on", "off"],
    )
    f(
        "--logprobs-mode",
        d.logprobs_mode,
        "logprobs of the raw logits or of the processed distribution",
        choices=[m.value for m in LogprobsMode],
    )
    f("--seed", d.seed, "random state at start; the seed Describe gives to Reseed", type=int)
    f("--device", d.device, "auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    f(
        "--dtype",
        d.dtype,
        "auto: bfloat16 on cuda, float32 on cpu",
        choices=["auto", "float32", "bfloat16", "float16"],
    )
    f(
        "--lm-weights",
        d.lm_weights,
        "LM linear layers: same (as --dtype), bfloat16 or int4 (the rest stays --dtype)",
        choices=list(LM_WEIGHTS),
    )
    f("--embed-max-batch", d.embed_max_batch, "most inputs per Embed batch", type=int)
    f(
        "--embed-batch-wait-ms",
        d.embed_batch_wait_ms,
        "after a batch of several concurrent Embed calls, the next waits up to this long "
        "(and no longer than that batch took) for their callers' next calls; a lone call "
        "never waits; 0 = off",
        type=float,
    )
    f(
        "--gen-max-batch",
        d.gen_max_batch,
        "most sequences decoded together (KV-cache rows; PROFILE caps it by memory)",
        type=int,
    )
    f(
        "--prefill-chunk-tokens",
        d.prefill_chunk_tokens,
        "most prompt tokens prefilled between two decode steps of running streams",
        type=int,
    )
    f("--max-input-tokens", d.max_input_tokens, "longest Generate prompt, in tokens", type=int)
    f("--max-new-tokens", d.max_new_tokens, "largest max_tokens a request may ask", type=int)
    f(
        "--kv-cache-tokens",
        d.kv_cache_tokens,
        "explicit KV-cache size in tokens (off: the PROFILE warmup step sizes it)",
        type=int,
    )
    f(
        "--kv-cache-memory-fraction",
        d.kv_cache_memory_fraction,
        "share of free memory PROFILE may give the KV cache",
        type=float,
    )
    f("--max-queue", d.max_queue, "queued requests per model before RESOURCE_EXHAUSTED", type=int)
    f(
        "--max-request-bytes",
        d.max_request_bytes,
        "largest request message on the public port",
        type=int,
    )
    f(
        "--on-late-compile",
        d.on_late_compile,
        "a compile after SERVING: warn (log, count) or fail (also health NOT_SERVING)",
        choices=[x.value for x in LateCompilePolicy],
    )
    f(
        "--admin-token-file",
        None,
        "file holding the token every admin call must carry (or set INFERENCE_SVC_ADMIN_TOKEN)",
    )
    f("--grace-period", d.grace_period, "seconds in-flight calls get on SIGTERM", type=float)
    f("--log-level", d.log_level, "debug, info, warning or error")
    return p


def parse_config(argv: Sequence[str] | None = None) -> ServiceConfig:
    p = build_parser()
    a = p.parse_args(argv)
    if a.gen_max_batch < 2 or a.embed_max_batch < 1:
        p.error("--gen-max-batch must be at least 2 and --embed-max-batch at least 1")
    if a.embed_batch_wait_ms < 0:
        p.error("--embed-batch-wait-ms must be 0 (off) or more")
    if a.max_input_tokens < 2 or a.max_new_tokens < 1:
        p.error("--max-input-tokens must be at least 2 and --max-new-tokens at least 1")
    if a.prefill_chunk_tokens < 16:
        p.error("--prefill-chunk-tokens must be at least 16")
    if not 0 < a.kv_cache_memory_fraction <= 1:
        p.error("--kv-cache-memory-fraction must be in (0, 1]")
    if bool(a.tls_cert_file) != bool(a.tls_key_file):
        p.error("--tls-cert-file and --tls-key-file go together")
    if a.tls_client_ca_file and not a.tls_cert_file:
        p.error("--tls-client-ca-file needs --tls-cert-file and --tls-key-file")
    token = os.environ.get(ENV_PREFIX + "ADMIN_TOKEN", "")
    if a.admin_token_file:
        try:
            token = Path(a.admin_token_file).read_text().strip()
        except OSError as e:
            p.error(f"--admin-token-file: {e}")
    return ServiceConfig(
        host=a.host,
        port=int(a.port),
        admin_host=a.admin_host,
        admin_port=int(a.admin_port),
        tls_cert_file=a.tls_cert_file or None,
        tls_key_file=a.tls_key_file or None,
        tls_client_ca_file=a.tls_client_ca_file or None,
        port_file=a.port_file,
        metrics_host=a.metrics_host,
        metrics_port=None if a.metrics_port in (None, "") else int(a.metrics_port),
        embed_model=a.embed_model,
        lm_model=a.lm_model,
        model_cache_dir=a.model_cache_dir,
        compilation_mode=CompilationMode(a.compilation_mode),
        compile_cache_dir=a.compile_cache_dir,
        freeze_weights=a.freeze_weights == "on",
        logprobs_mode=LogprobsMode(a.logprobs_mode),
        seed=int(a.seed),
        device=a.device,
        dtype=a.dtype,
        lm_weights=a.lm_weights,
        embed_max_batch=int(a.embed_max_batch),
        embed_batch_wait_ms=float(a.embed_batch_wait_ms),
        gen_max_batch=int(a.gen_max_batch),
        prefill_chunk_tokens=int(a.prefill_chunk_tokens),
        max_input_tokens=int(a.max_input_tokens),
        max_new_tokens=int(a.max_new_tokens),
        kv_cache_tokens=None if a.kv_cache_tokens in (None, "") else int(a.kv_cache_tokens),
        kv_cache_memory_fraction=float(a.kv_cache_memory_fraction),
        max_queue=int(a.max_queue),
        max_request_bytes=int(a.max_request_bytes),
        on_late_compile=LateCompilePolicy(a.on_late_compile),
        grace_period=float(a.grace_period),
        admin_token=token,
        log_level=a.log_level,
    )
