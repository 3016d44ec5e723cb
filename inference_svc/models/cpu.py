"""What this CPU computes natively, read once, and what ``--lm-weights auto`` makes of it.

``auto`` is the fastest linear-weight format for the machine among those whose top-1
agreement with float32 stays >= 0.98 (docs/numerics.md; tests/test_accuracy.py holds each
to it). It is resolved once, when the engine loads its models (engine/core.py): the model
loader, the kept artifacts' key and everything below them get a concrete scheme.

The rule (``AUTO_RULES``, first match wins; docs/numerics.md has it with its figures) was
decided from the packaged SmolLM2's decode step, eager, batch 1 and 8 at context 256,
medians of 30 calls, every format in one run (``bench/decode_step.py --backends eager``):

- Intel Xeon (Sapphire Rapids class) with AMX and AVX512_BF16, 2 cores: against float32,
  int4 1.66x / 1.83x, bfloat16 0.81x / 1.32x: int4 wins even where bfloat16 is native.
- AMD EPYC, AVX2 only, no native bfloat16 (another machine, the same step eager): int4
  2.3x float32 at 1 stream.

int4 runs on torch's vectorised CPU kernels, so every row needs torch's own capability to
be AVX2 or AVX512; anything else (no AVX2, another architecture: not measured) keeps the
model's dtype. On a CUDA device ``auto`` is ``same`` (int4 and bfloat16 linears are CPU-only).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from inference_api.plan import CompilationMode
from inference_svc.config import ServiceConfig
from inference_svc.models.loading import pick_device

log = logging.getLogger(__name__)

# Top-1 agreement of greedy tokens with float32 (docs/numerics.md, tests/test_accuracy.py):
# auto may choose only a scheme at or above the floor.
AGREEMENT = {"same": 1.0, "bfloat16": 0.983, "int4": 0.986}
AGREEMENT_FLOOR = 0.98
VECTOR = ("AVX2", "AVX512")  # torch's capability levels whose kernels are vectorised


@dataclass(frozen=True)
class Capabilities:
    """torch's CPU capability (what its kernels dispatch to: "AVX512", "AVX2", "DEFAULT",
    ...) and the feature flags /proc/cpuinfo lists (amx_bf16, avx512_bf16, avx2, ...)."""

    isa: str
    flags: frozenset[str]


@functools.cache
def capabilities() -> Capabilities:
    """This machine's, read once per process (no /proc/cpuinfo: no flags)."""
    flags: frozenset[str] = frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = frozenset(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return Capabilities(torch.backends.cpu.get_cpu_capability(), flags)


@dataclass(frozen=True)
class AutoRule:
    """One row of auto's table: what the CPU must have, and the scheme it gets."""

    tag: str  # what the CPU has, as the reason names it ("AMX-BF16")
    isa: tuple[str, ...]  # torch's capability must be one of these
    flag: str  # and /proc/cpuinfo must list this flag ("" = none needed)
    scheme: str
    measured: str  # the figures behind the choice, and the CPU they were measured on
    absent: str = ""  # and /proc/cpuinfo must not list this one ("" = no such condition)

    def matches(self, caps: Capabilities) -> bool:
        flags = caps.flags
        return (caps.isa in self.isa and (not self.flag or self.flag in flags)
                and (not self.absent or self.absent not in flags))  # fmt: skip


AUTO_RULES: tuple[AutoRule, ...] = (
    AutoRule("AMX-BF16", VECTOR, "amx_bf16", "int4",
             "Xeon, AMX + AVX512_BF16, 2 cores: eager decode step against float32, batch 1 / 8: "
             "int4 1.66x / 1.83x, bfloat16 0.81x / 1.32x"),
    AutoRule("AVX512-BF16", VECTOR, "avx512_bf16", "int4",
             "AMD EPYC, AVX512_BF16 without AMX, 2 cores: eager decode step against float32, "
             "batch 1 / 8: int4 3.34x / 2.63x (4.84x / 3.59x on --linear-kernel native), "
             "bfloat16 1.64x / 1.83x"),
    AutoRule("AVX-512", ("AVX512",), "", "int4",
             "not measured apart: no native bfloat16, so as AVX2"),
    AutoRule("AVX2", ("AVX2",), "", "int4",
             "AMD EPYC, AVX2 only: eager int4 2.3x float32 at 1 stream"),
)  # fmt: skip


@dataclass(frozen=True)
class WeightsChoice:
    """A concrete ``--lm-weights`` scheme, and why auto chose it ("" when it was named)."""

    scheme: str
    tag: str = ""  # short, for Describe and Info: "AMX-BF16", "CUDA", "no AVX2"
    reason: str = ""  # the log's: "CPU has AMX-BF16"

    @property
    def auto(self) -> bool:
        return bool(self.tag)


def choose_lm_weights(setting: str, device: torch.device) -> WeightsChoice:
    """``setting`` itself, or for "auto" the table's choice for this machine's CPU."""
    no_avx2 = ("no AVX2", "torch's CPU capability is {isa}, no AVX2")
    return _choose(setting, device, AUTO_RULES, no_avx2)


# --embed-dtype auto: bfloat16 where the CPU computes it natively. The encoder's batched
# forward is compute-bound (unlike a decode step), so native bfloat16 GEMMs pay; its vectors
# keep cosine >= 0.9999 with float32's (docs/numerics.md, tests/test_accuracy.py).
EMBED_AUTO_RULES: tuple[AutoRule, ...] = (
    AutoRule("AMX-BF16", VECTOR, "amx_bf16", "bfloat16",
             "Xeon, AMX + AVX512_BF16, 2 cores: eager all-MiniLM-L6-v2 against float32, "
             "1x16 / 8x64 / 32x128 / 32x256 tokens: 1.31x / 2.02x / 4.33x / 3.34x; "
             "cosine min 0.99994"),
    AutoRule("AVX512-BF16", VECTOR, "avx512_bf16", "bfloat16",
             "AMD EPYC, AVX512_BF16 without AMX, 2 cores: eager all-MiniLM-L6-v2 against "
             "float32, 1x16 / 8x64 / 32x128 tokens: 1.44x / 1.79x / 1.99x; cosine 0.99989"),
)  # fmt: skip


def choose_embed_dtype(setting: str, device: torch.device) -> WeightsChoice:
    """``setting`` itself, or for "auto": bfloat16 on a CPU with native bfloat16, else
    "same" (the model's --dtype; on CUDA --dtype auto is bfloat16 already)."""
    none = ("no native bfloat16", "the CPU has no AMX or AVX512_BF16")
    return _choose(setting, device, EMBED_AUTO_RULES, none)


def _choose(
    setting: str, device: torch.device, rules: tuple[AutoRule, ...], otherwise: tuple[str, str]
) -> WeightsChoice:
    """A named setting as it is; "auto": "same" off the CPU, else the first rule this CPU
    matches, else "same" for ``otherwise``'s (tag, reason)."""
    if setting != "auto":
        return WeightsChoice(setting)
    if device.type != "cpu":
        return WeightsChoice("same", device.type.upper(), f"a {device.type} device")
    caps = capabilities()
    for rule in rules:
        if rule.matches(caps):
            return WeightsChoice(rule.scheme, rule.tag, f"CPU has {rule.tag}")
    tag, reason = otherwise
    return WeightsChoice("same", tag, reason.format(isa=caps.isa))


def choose_compile_backend(setting: str, device: torch.device) -> str:
    """``setting`` itself, or for "auto": aoti on a CPU (its packages are kept whole, frozen
    and autotuned ones included, and a restart runs no Dynamo: docs/restarts.md), else
    torch-compile (AOTInductor packages are not verified on a GPU by this project)."""
    if setting != "auto":
        return setting
    return "aoti" if device.type == "cpu" else "torch-compile"


def choose_decode_attention(setting: str, device: torch.device) -> str:
    """``setting`` itself, or for "auto" (logged with its reason): native on a CPU where the
    kernel builds and loads (inference_svc/kernels: here, once per CPU and torch), else sdpa
    (torch's kernel: the native one has no GPU implementation)."""
    if setting != "auto":
        return setting
    attention, why = "sdpa", f"a {device.type} device"
    if device.type == "cpu":
        missing = _ops_missing("--decode-attention", "the native kernel did not build")
        attention, why = ("sdpa", missing) if missing else ("native", "a CPU with a C++ compiler")
    log.info("--decode-attention auto: %s (%s)", attention, why)
    return attention


def choose_linear_kernel(setting: str, device: torch.device, scheme: str) -> str:
    """``setting`` itself, or for "auto" (logged with its reason): native for the int4 scheme
    on a CPU of a class where it was measured faster than torch's int4 kernel (LINEAR_NATIVE:
    AVX2; AVX-512 with VNNI and no AMX) and the kernel builds; else torch."""
    if setting != "auto":
        return setting
    kernel, why = "torch", f"--lm-weights {scheme}"
    if scheme == "int4" and device.type != "cpu":
        why = f"a {device.type} device"
    elif scheme == "int4":
        caps = capabilities()
        rule = next((r for r in LINEAR_NATIVE if r.matches(caps)), None)
        why = f"torch's capability {caps.isa}: native not measured on this CPU class"
        if rule is not None:
            missing = _ops_missing("--linear-kernel", "this project's ops did not build")
            kernel, why = ("torch", missing) if missing else ("native", rule.measured)
    log.info("--linear-kernel auto: %s (%s)", kernel, why)
    return kernel


# Where --linear-kernel auto runs the native kernel, with what was measured there (the
# SmolLM2 decode step's linears against torch's int4 kernel). AMX CPUs: torch's int4 GEMM
# templates there are not measured against it yet.
LINEAR_NATIVE: tuple[AutoRule, ...] = (
    AutoRule("AVX512-VNNI", ("AVX512",), "avx512_vnni", "native",
             "AMD EPYC, AVX512-VNNI: the max-autotune decode step 1.2x / 1.6x / 1.7x torch's "
             "int4 kernel at 1 / 8 / 16 rows", absent="amx_tile"),
    AutoRule("AVX2", ("AVX2",), "", "native",
             "AMD EPYC, AVX2: SmolLM2's 30 layers 2.7x torch's int4 kernel at 1 row, "
             "1.3-1.45x at 8-16, the output layer in int8 2.7-5x bfloat16"),
)  # fmt: skip


def _ops_missing(flag: str, failed: str) -> str:
    """Why this project's ops cannot run here: no compiler, or ``failed`` (logged with the
    error); empty when they build and load (inference_svc/kernels: once per CPU and torch)."""
    from inference_svc import kernels

    if not kernels.available():
        return "no C++ compiler"
    try:
        kernels.load()
    except Exception as e:  # the service still starts, on torch's kernels
        log.warning("%s auto: %s: %s", flag, failed, e)
        return failed
    return ""


@dataclass(frozen=True)
class Choices:
    """What each "auto" became: the LM's linear weights, the Embed model's dtype, the
    compiled modes' backend and the decode step's attention."""

    lm: WeightsChoice
    embed: WeightsChoice
    backend: str
    attention: str = "sdpa"
    linear: str = "torch"


def choices(config: ServiceConfig) -> Choices:
    """What ``config``'s settings run as on this machine ("auto" resolved)."""
    device = pick_device(config.device)
    lm = choose_lm_weights(config.lm_weights, device)
    backend = choose_compile_backend(config.compile_backend, device)
    no_lm = config.lm_model == "none"  # nothing decodes: no kernel to build
    attention = "sdpa" if no_lm else choose_decode_attention(config.decode_attention, device)
    linear = "torch" if no_lm else choose_linear_kernel(config.linear_kernel, device, lm.scheme)
    embed = choose_embed_dtype(config.embed_dtype, device)
    return Choices(lm, embed, backend, attention, linear)


def resolve(config: ServiceConfig) -> tuple[ServiceConfig, Choices]:
    """``config`` with a concrete ``lm_weights``, ``embed_dtype``, ``compile_backend``,
    ``decode_attention`` and ``linear_kernel``, and the choices; logs each auto's reason."""
    auto = choices(config)
    lm, embed = auto.lm, auto.embed
    if lm.auto:
        log.info("--lm-weights auto: %s (%s)", lm.scheme, lm.reason)
    if embed.auto:
        log.info("--embed-dtype auto: %s (%s)", embed.scheme, embed.reason)
    compiled = config.compilation_mode is not CompilationMode.NONE
    if compiled and config.compile_backend == "auto":
        where = pick_device(config.device).type
        log.info("--compile-backend auto: %s (a %s device)", auto.backend, where)
    config = dataclasses.replace(
        config, lm_weights=lm.scheme, embed_dtype=embed.scheme, compile_backend=auto.backend,
        decode_attention=auto.attention, linear_kernel=auto.linear,
    )  # fmt: skip
    return config, auto
