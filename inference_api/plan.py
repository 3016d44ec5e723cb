"""The warmup plan: its vocabulary (every enum, ``Phase``, ``Bucket``) and DESIGN.md's
decision table as a pure function.

``plan(profiles)`` turns what the service knows about each model into the ordered
steps to run and the steps left out, each with its reason. The service plans with
it: Describe carries the required steps and MarkServing enforces them. The sidecar
runs what Describe says and re-plans only as a cross-check (warmup_ctl.plan).

This module imports nothing but the standard library.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field


class StepKind(enum.Enum):
    PROFILE = "profile"
    COMPILE = "compile"
    SAMPLER = "sampler"
    RESEED = "reseed"
    MARK_SERVING = "mark_serving"


class SamplerPath(enum.Enum):
    GREEDY = "greedy"
    RANDOM = "random"
    SEEDED = "seeded"
    LOGPROBS = "logprobs"


class ModelKind(enum.Enum):
    EMBEDDING = "embedding"
    GENERATIVE = "generative"


class CompilationMode(enum.Enum):
    NONE = "none"
    DEFAULT = "default"
    MAX_AUTOTUNE = "max-autotune"


class LogprobsMode(enum.Enum):
    RAW = "raw"
    # Binds the sampler to its native per-row path: seeded == random there.
    PROCESSED = "processed"


class Phase(enum.Enum):
    """Which forward pass a shape bucket is for."""

    EMBED = "embed"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class Bucket:
    """A padded shape the service batches into: one compiled graph's input shape."""

    phase: Phase
    batch_size: int
    seq_len: int  # padded tokens per row: embed, a prefill chunk, or 1 (decode)
    context_len: int = 0  # KV-cache slots attended (prefill, decode); 0 for embed

    def __str__(self) -> str:
        ctx = f"@{self.context_len}" if self.context_len else ""
        return f"{self.phase.value} {self.batch_size}x{self.seq_len}{ctx}"


@dataclass(frozen=True)
class ModelProfile:
    """What Describe reports about one model."""

    name: str
    kind: ModelKind
    has_kv_cache: bool
    kv_cache_explicit: bool
    compilation_mode: CompilationMode
    logprobs_mode: LogprobsMode = LogprobsMode.RAW
    # The shapes the service batches into: what COMPILE runs.
    buckets: tuple[Bucket, ...] = ()
    # What the graphs compute in ("float32", "float32+int4-linear"): COMPILE warms these.
    numerics: str = ""
    # Where the compiled graphs came from: "loaded" (kept artifacts), "compiled", or "".
    artifacts: str = ""
    # How the compiled graphs run: "aoti", "torch-compile" (+ why, on a fallback), or "".
    backend: str = ""
    # Packages checked against eager on fixed inputs (the largest difference per graph).
    proof: str = ""


@dataclass(frozen=True)
class Step:
    kind: StepKind
    model: str = ""
    sampler_paths: tuple[SamplerPath, ...] = ()
    reason: str = ""


@dataclass(frozen=True)
class Plan:
    steps: tuple[Step, ...]
    # Steps the table leaves out, with the reason for each.
    skipped: tuple[Step, ...] = field(default=())


def sampler_paths(logprobs_mode: LogprobsMode) -> tuple[SamplerPath, ...]:
    """Every distinct sampler path the service can take under this logprobs mode."""
    paths = [SamplerPath.GREEDY, SamplerPath.RANDOM]
    if logprobs_mode is not LogprobsMode.PROCESSED:
        paths.append(SamplerPath.SEEDED)
    paths.append(SamplerPath.LOGPROBS)
    return tuple(paths)


def _model_steps(p: ModelProfile) -> tuple[list[Step], list[Step]]:
    steps: list[Step] = []
    skipped: list[Step] = []
    compiled = p.compilation_mode is not CompilationMode.NONE
    generative = p.kind is ModelKind.GENERATIVE

    if not p.has_kv_cache:
        skipped.append(Step(StepKind.PROFILE, p.name, reason="no KV cache to size"))
    elif p.kv_cache_explicit:
        skipped.append(Step(StepKind.PROFILE, p.name, reason="KV-cache size given explicitly"))
    else:
        why = "sizes the KV cache (size is automatic)"
        if compiled:
            why += "; compiles the largest prefill shape too"
        steps.append(Step(StepKind.PROFILE, p.name, reason=why))

    n = len(p.buckets)
    numerics = f" in {p.numerics}" if p.numerics else ""
    if p.artifacts == "loaded":
        numerics += ", from kept artifacts"
    if not compiled:
        skipped.append(Step(StepKind.COMPILE, p.name, reason="compilation mode NONE"))
    elif not p.has_kv_cache:
        why = f"{n} shape buckets{numerics}; no KV-cache profile run would compile this model"
        steps.append(Step(StepKind.COMPILE, p.name, reason=why))
    elif p.kv_cache_explicit:
        why = f"{n} prefill/decode buckets{numerics}"
        why += " (KV-cache size explicit: no PROFILE run compiles any)"
        steps.append(Step(StepKind.COMPILE, p.name, reason=why))
    else:
        why = f"{n} prefill/decode buckets{numerics}, except those PROFILE already compiled"
        steps.append(Step(StepKind.COMPILE, p.name, reason=why))

    if not generative:
        skipped.append(Step(StepKind.SAMPLER, p.name, reason="embedding model: no sampler"))
    elif not compiled:
        skipped.append(Step(StepKind.SAMPLER, p.name, reason="compilation mode NONE"))
    else:
        paths = sampler_paths(p.logprobs_mode)
        why = "every sampler path: " + ", ".join(x.value for x in paths)
        if SamplerPath.SEEDED not in paths:
            why += " (seeded left out: the processed logprobs mode binds the native path)"
        steps.append(Step(StepKind.SAMPLER, p.name, paths, why))
    return steps, skipped


def plan(profiles: Sequence[ModelProfile]) -> Plan:
    """The ordered warmup steps for these models: DESIGN.md's decision table."""
    steps: list[Step] = []
    skipped: list[Step] = []
    for profile in profiles:
        s, k = _model_steps(profile)
        steps += s
        skipped += k
    steps.append(Step(StepKind.RESEED, reason="always, after the last warmup step"))
    steps.append(Step(StepKind.MARK_SERVING, reason="always, last"))
    return Plan(tuple(steps), tuple(skipped))
