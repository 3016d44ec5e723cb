"""Service configuration: parsed once, from flags and environment, into a frozen dataclass.

Each setting is written once, as a `ServiceConfig` field declared with `setting()`: its
default, its help text and its choices. The command line is generated from those fields:
field `max_queue` is flag `--max-queue`, whose default the environment variable
`INFERENCE_SVC_MAX_QUEUE` supplies (read when parsing, never at import). A field's type
decides how its value is read: int, float, str, an enum by value, bool as on/off, and
`int | None` / `str | None`, where "" (or nothing) means None. A secret setting is never a
flag value (ps would show it): `--<name>-file` names a file holding it, or
`INFERENCE_SVC_<NAME>` holds it.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inference_api.names import DEFAULT_ADMIN_HOST, DEFAULT_ADMIN_PORT, DEFAULT_PORT
from inference_api.plan import CompilationMode, LogprobsMode

# The generative model's linear-layer weights (inference_svc.models.weights applies them),
# and the flag's choices: those, or auto (inference_svc.models.cpu picks one for the CPU).
LM_WEIGHTS = ("same", "bfloat16", "int4")
LM_WEIGHTS_CHOICES = (*LM_WEIGHTS, "auto")
EMBED_DTYPES = ("same", "float32", "bfloat16", "auto")
KV_CACHE_DTYPES = ("same", "float16", "auto")
# How compiled modes compile (inference_svc.models.compile): AOTInductor packages, or
# torch.compile (Dynamo) in the process.
COMPILE_BACKENDS = ("auto", "aoti", "torch-compile")
DECODE_ATTENTIONS = ("auto", "native", "sdpa")
LINEAR_KERNELS = ("auto", "native", "torch")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ON_OFF = ("on", "off")

ENV_PREFIX = "INFERENCE_SVC_"


class LateCompilePolicy(enum.Enum):
    """What a compile after SERVING (a cold path reached by a request) does to health."""

    WARN = "warn"  # logged and counted (Info, late_compile_events)
    FAIL = "fail"  # also turns health NOT_SERVING


def setting(
    default: Any, help: str, *, choices: Sequence[str] | None = None, secret: bool = False
) -> Any:
    """A `ServiceConfig` field: its default, the help line of its flag, the flag's choices.

    Enum fields take their members' values as choices, bool fields on/off. A secret is kept
    out of repr and has no flag of its own: `--<name>-file` reads it from a file.
    """
    meta = {"help": help, "choices": tuple(choices) if choices else None, "secret": secret}
    return dataclasses.field(default=default, repr=not secret, metadata=meta)


@dataclass(frozen=True)
class ServiceConfig:
    host: str = setting("0.0.0.0", "public interface (Inference, grpc.health.v1, reflection)")
    port: int = setting(DEFAULT_PORT, "public gRPC port; 0 picks a free one")
    admin_host: str = setting(DEFAULT_ADMIN_HOST, "WarmupAdmin interface: keep it loopback")
    admin_port: int = setting(DEFAULT_ADMIN_PORT, "WarmupAdmin port; 0 picks a free one")
    metrics_host: str = setting("0.0.0.0", "Prometheus /metrics interface")
    metrics_port: int | None = setting(None, "Prometheus /metrics port; 0 picks one")
    tls_cert_file: str | None = setting(None, "TLS on the public port: certificate chain (PEM)")
    tls_key_file: str | None = setting(None, "TLS on the public port: private key (PEM)")
    tls_client_ca_file: str | None = setting(
        None, "require client certificates signed by this CA (mutual TLS; needs --tls-cert-file)"
    )
    port_file: str | None = setting(
        None, "write the ports, pid and boot id here as JSON once listening"
    )
    embed_model: str = setting(
        "default", "'default' (all-MiniLM-L6-v2), 'none' or a model directory"
    )
    lm_model: str = setting(
        "default", "'default' (SmolLM2-135M-Instruct), 'none' or a model directory"
    )
    model_cache_dir: str = setting(
        "~/.cache/inference-svc/models", "converted GGUF models kept here ('' = no cache)"
    )
    compilation_mode: CompilationMode = setting(
        CompilationMode.NONE, "none (eager) or a torch.compile mode"
    )
    # Dynamo packages, AOTAutograd and inductor caches, reused by the next start whose key
    # matches; "" leaves only inductor's own cache.
    compile_cache_dir: str = setting(
        "~/.cache/inference-svc/compile",
        "compiled artifacts kept here for the next start ('' = none)",
    )
    # Prepacked for oneDNN/MKL; torch 2.13's Dynamo caches no frozen graph (AOTInductor keeps it).
    freeze_weights: bool = setting(
        False,
        "on: weights folded and prepacked into compiled graphs (faster steps at large "
        "batches; torch-compile: every start compiles; aoti: a copy of the weights per "
        "package, where off shares the model's own)",
    )
    compile_backend: str = setting(
        "auto",
        "compiled modes: aoti (torch.export + AOTInductor packages, kept whole in "
        "--compile-cache-dir, frozen weights included; a model that does not export falls "
        "back to torch-compile), torch-compile (Dynamo in the process), or auto: aoti on a "
        "CPU, torch-compile on CUDA",
        choices=COMPILE_BACKENDS,
    )
    decode_attention: str = setting(
        "auto",
        "a decode step's attention: native (a C++ kernel of this project, built once per CPU "
        "and torch and kept in --compile-cache-dir or the user's cache), sdpa (torch's), or "
        "auto: native on a CPU with a C++ compiler, else sdpa",
        choices=DECODE_ATTENTIONS,
    )
    linear_kernel: str = setting(
        "auto",
        "what runs --lm-weights int4's linear layers: native (a C++ kernel of this project: "
        "integer dot products against 8-bit activations, the output layer in 8-bit groups), "
        "torch (torch's int4 kernel, the output layer in bfloat16), or auto: native where "
        "it was measured faster (an AVX2 CPU), else torch",
        choices=LINEAR_KERNELS,
    )
    logprobs_mode: LogprobsMode = setting(
        LogprobsMode.RAW, "logprobs of the raw logits or of the processed distribution"
    )
    seed: int = setting(0, "random state at start; the seed Describe gives to Reseed")
    device: str = setting("auto", "auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    dtype: str = setting("auto", "auto: bfloat16 on cuda, float32 on cpu", choices=DTYPES)
    lm_weights: str = setting(
        "same",
        "LM linear layers: same (as --dtype), bfloat16, int4 (the rest stays --dtype), or "
        "auto: the fastest for this CPU with top-1 agreement >= 0.98 (docs/numerics.md)",
        choices=LM_WEIGHTS_CHOICES,
    )
    embed_dtype: str = setting(
        "same",
        "Embed model's dtype: same (as --dtype), float32, bfloat16, or auto: bfloat16 where "
        "the CPU computes it natively (AMX or AVX512_BF16; cosine with float32 >= 0.9999), "
        "else same (docs/numerics.md)",
        choices=EMBED_DTYPES,
    )
    embed_max_batch: int = setting(32, "most inputs per Embed batch")
    embed_batch_wait_ms: float = setting(
        20.0,
        "after a batch of several concurrent Embed calls, the next waits up to this long "
        "(and no longer than that batch took) for their callers' next calls; a lone call "
        "never waits; 0 = off",
    )
    gen_max_batch: int = setting(
        16, "most sequences decoded together (KV-cache rows; PROFILE caps it by memory)"
    )
    prefill_chunk_tokens: int = setting(
        64, "most prompt tokens prefilled between two decode steps of running streams"
    )
    prefill_stall_steps: float = setting(
        2.0,
        "while streams decode, a joiner's prefill chunk is cut narrower (16-token steps) so "
        "that it costs at most this many of their decode steps, as measured while serving; "
        "0 = off: always --prefill-chunk-tokens",
    )
    max_input_tokens: int = setting(512, "longest Generate prompt, in tokens")
    max_new_tokens: int = setting(512, "largest max_tokens a request may ask")
    kv_cache_tokens: int | None = setting(
        None, "explicit KV-cache size in tokens (off: the PROFILE warmup step sizes it)"
    )
    kv_cache_dtype: str = setting(
        "same",
        "the LM's KV cache: same (the model's dtype), float16 (half the memory and the bytes "
        "a decode step reads; top-1 agreement with float32 0.9985), or auto: float16 for a "
        "float32 model on the native decode attention's AVX-512 path (head size 64, up to 3 "
        "query heads a KV head), else same (docs/numerics.md)",
        choices=KV_CACHE_DTYPES,
    )
    kv_cache_memory_fraction: float = setting(
        0.5, "share of free memory PROFILE may give the KV cache"
    )
    max_queue: int = setting(256, "queued requests per model before RESOURCE_EXHAUSTED")
    # Past it grpc answers RESOURCE_EXHAUSTED.
    max_request_bytes: int = setting(4 * 2**20, "largest request message on the public port")
    on_late_compile: LateCompilePolicy = setting(
        LateCompilePolicy.WARN,
        "a compile after SERVING: warn (log, count) or fail (also health NOT_SERVING)",
    )
    admin_token: str = setting("", "the token every admin call must carry", secret=True)
    grace_period: float = setting(10.0, "seconds in-flight calls get on SIGTERM")
    # A client's HTTP/2 connection carries all its calls to one replica; past this age the
    # server sends GOAWAY and the client reconnects (and re-resolves DNS), so replicas added
    # since get their share. grpc core adds +-10% jitter itself: replicas started together do
    # not send GOAWAY together. docs/scale-out.md says how the defaults were chosen.
    max_connection_age: float = setting(
        300.0,
        "seconds a client connection lives before the server sends GOAWAY; the client "
        "reconnects (and re-resolves) for its next calls; grpc adds +-10% jitter; 0 = off",
    )
    max_connection_age_grace: float = setting(
        600.0,
        "seconds the calls still open on a connection past its age get before it is closed "
        "(covers the longest Generate; only with --max-connection-age)",
    )
    log_level: str = setting("info", "debug, info, warning or error")


@dataclass(frozen=True)
class Setting:
    """How one `ServiceConfig` field is read: its flag, its variable, its value's type."""

    name: str
    kind: type  # int, float, str, bool or an Enum
    optional: bool  # `X | None`: "" means None
    default: Any
    help: str
    choices: tuple[str, ...] | None
    secret: bool

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-") + ("-file" if self.secret else "")

    @property
    def dest(self) -> str:
        """The flag's attribute in argparse's namespace."""
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag_env(self) -> str:
        """The variable supplying the flag's default (for a secret: the file's path)."""
        return self.env + ("_FILE" if self.secret else "")

    def text(self, value: Any) -> str:
        """A value as the command line spells it."""
        if value is None:
            return "off"
        if isinstance(value, bool):
            return "on" if value else "off"
        return str(value.value if isinstance(value, enum.Enum) else value)

    def convert(self, raw: Any) -> Any:
        """A parsed flag's value (a string unless argparse converted it) as the field's type."""
        if raw is None or (self.optional and raw == ""):
            return None
        if self.kind is bool:
            return raw == "on"
        return self.kind(raw)


def _split(hint: Any) -> tuple[type, bool]:
    """The type of a field's values, and whether None is one of them (`X | None`)."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else ()
    kinds = [a for a in args if a is not type(None)]
    return (kinds[0], True) if args else (hint, False)


@functools.cache
def settings() -> tuple[Setting, ...]:
    """Every setting of `ServiceConfig`, in field order."""
    hints = typing.get_type_hints(ServiceConfig)
    out = []
    for f in dataclasses.fields(ServiceConfig):
        kind, optional = _split(hints[f.name])
        choices = f.metadata["choices"]
        if kind is bool:
            choices = ON_OFF
        elif isinstance(kind, type) and issubclass(kind, enum.Enum):
            choices = tuple(m.value for m in kind)
        out.append(
            Setting(f.name, kind, optional, f.default, f.metadata["help"], choices,
                    f.metadata["secret"])
        )  # fmt: skip
    return tuple(out)


def _argparse_type(s: Setting) -> Callable[[str], Any] | None:
    """What argparse applies to a flag's string (enums and bools stay strings until convert)."""
    if s.kind not in (int, float):
        return None
    if not s.optional:
        return s.kind

    def optional(raw: str) -> Any:
        return None if raw == "" else s.kind(raw)

    optional.__name__ = s.kind.__name__  # argparse's error names it: "invalid int value"
    return optional


def _add_flag(p: argparse.ArgumentParser, s: Setting, environ: Mapping[str, str]) -> None:
    """The setting's flag; its default is the variable's value, else the field's default."""
    if s.secret:  # the flag names a file; the field's default is no file
        text, default = f"file holding {s.help} (or set {s.env})", None
    else:
        text, default = s.help, s.default
    line = f"{text} (default: {s.text(default)}; env {s.flag_env})"
    p.add_argument(
        s.flag,
        default=environ.get(s.flag_env, None if default is None else s.text(default)),
        type=_argparse_type(s),
        choices=s.choices,
        help=line.replace("%", "%%"),
    )


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """`inference-svc`'s flags, one per `ServiceConfig` field; defaults from `environ`."""
    environ = os.environ if environ is None else environ
    p = argparse.ArgumentParser(
        prog="inference-svc",
        description="gRPC inference service (Embed, Generate) behind a warmup health gate: "
        "NOT_SERVING until warmup-ctl has run the warmup steps Describe requires. Each "
        "flag's default can also be set by the environment variable named beside it. "
        "'inference-svc precompile [flags]' runs the warmup steps in process, keeps the "
        "compiled artifacts in --compile-cache-dir and exits.",
    )
    for s in settings():
        _add_flag(p, s, environ)
    return p


def _secret(p: argparse.ArgumentParser, s: Setting, path: str | None, env: Mapping) -> str:
    """A secret from the file its flag names, else from its variable."""
    if not path:
        return env.get(s.env, "")
    try:
        return Path(path).read_text().strip()
    except OSError as e:
        p.error(f"{s.flag}: {e}")


def _check(p: argparse.ArgumentParser, c: ServiceConfig) -> None:
    """The rules no single field's type states."""
    if c.gen_max_batch < 2 or c.embed_max_batch < 1:
        p.error("--gen-max-batch must be at least 2 and --embed-max-batch at least 1")
    if c.embed_batch_wait_ms < 0:
        p.error("--embed-batch-wait-ms must be 0 (off) or more")
    if c.max_input_tokens < 2 or c.max_new_tokens < 1:
        p.error("--max-input-tokens must be at least 2 and --max-new-tokens at least 1")
    if c.prefill_chunk_tokens < 16:
        p.error("--prefill-chunk-tokens must be at least 16")
    if c.prefill_stall_steps < 0:
        p.error("--prefill-stall-steps must be 0 (off) or more")
    if not 0 < c.kv_cache_memory_fraction <= 1:
        p.error("--kv-cache-memory-fraction must be in (0, 1]")
    if bool(c.tls_cert_file) != bool(c.tls_key_file):
        p.error("--tls-cert-file and --tls-key-file go together")
    if c.max_connection_age < 0 or c.max_connection_age_grace < 0:
        p.error("--max-connection-age and --max-connection-age-grace must be 0 or more")
    if c.tls_client_ca_file and not c.tls_cert_file:
        p.error("--tls-client-ca-file needs --tls-cert-file and --tls-key-file")


def parse_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> ServiceConfig:
    """Flags over environment (`environ`, default os.environ) over the fields' defaults."""
    environ = os.environ if environ is None else environ
    p = build_parser(environ)
    a = vars(p.parse_args(argv))
    values: dict[str, Any] = {}
    secrets: dict[Setting, str | None] = {}
    for s in settings():
        raw = a[s.dest]
        if s.secret:
            secrets[s] = raw
        elif s.choices and raw not in s.choices:
            # argparse checks a flag's choices, not a default that came from the environment.
            p.error(f"{s.env}: invalid choice: {raw!r} (choose from {', '.join(s.choices)})")
        else:
            values[s.name] = s.convert(raw)
    config = ServiceConfig(**values)
    _check(p, config)
    return dataclasses.replace(
        config, **{s.name: _secret(p, s, path, environ) for s, path in secrets.items()}
    )
