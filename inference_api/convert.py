"""The one protobuf <-> plan conversion, used by the service and the sidecar alike.

Total: every value of every plan enum maps to a protobuf value, and every protobuf
value either maps to a plan value or raises ConversionError with a message that
names the field and the value (the service answers it with INVALID_ARGUMENT).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from enum import Enum
from typing import TypeVar

from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

from inference_api import plan
from inference_api.stubs.inference.v1 import admin_pb2, inference_pb2

E = TypeVar("E", bound=Enum)

# protobuf value -> plan value; the reverse tables are derived from these.
KIND = {
    inference_pb2.MODEL_KIND_EMBEDDING: plan.ModelKind.EMBEDDING,
    inference_pb2.MODEL_KIND_GENERATIVE: plan.ModelKind.GENERATIVE,
}
MODE = {
    inference_pb2.COMPILATION_MODE_NONE: plan.CompilationMode.NONE,
    inference_pb2.COMPILATION_MODE_DEFAULT: plan.CompilationMode.DEFAULT,
    inference_pb2.COMPILATION_MODE_MAX_AUTOTUNE: plan.CompilationMode.MAX_AUTOTUNE,
}
LOGPROBS = {
    admin_pb2.LOGPROBS_MODE_RAW: plan.LogprobsMode.RAW,
    admin_pb2.LOGPROBS_MODE_PROCESSED: plan.LogprobsMode.PROCESSED,
}
STEP = {
    admin_pb2.WARMUP_STEP_KIND_PROFILE: plan.StepKind.PROFILE,
    admin_pb2.WARMUP_STEP_KIND_COMPILE: plan.StepKind.COMPILE,
    admin_pb2.WARMUP_STEP_KIND_SAMPLER: plan.StepKind.SAMPLER,
    admin_pb2.WARMUP_STEP_KIND_RESEED: plan.StepKind.RESEED,
    admin_pb2.WARMUP_STEP_KIND_MARK_SERVING: plan.StepKind.MARK_SERVING,
}
PATH = {
    admin_pb2.SAMPLER_PATH_GREEDY: plan.SamplerPath.GREEDY,
    admin_pb2.SAMPLER_PATH_RANDOM: plan.SamplerPath.RANDOM,
    admin_pb2.SAMPLER_PATH_SEEDED: plan.SamplerPath.SEEDED,
    admin_pb2.SAMPLER_PATH_LOGPROBS: plan.SamplerPath.LOGPROBS,
}
PHASE = {
    admin_pb2.PHASE_EMBED: plan.Phase.EMBED,
    admin_pb2.PHASE_PREFILL: plan.Phase.PREFILL,
    admin_pb2.PHASE_DECODE: plan.Phase.DECODE,
}
# Every table, with the protobuf enum it reads, for the totality test.
TABLES: tuple[tuple[Mapping[int, Enum], EnumTypeWrapper, type[Enum]], ...] = (
    (KIND, inference_pb2.ModelKind, plan.ModelKind),
    (MODE, inference_pb2.CompilationMode, plan.CompilationMode),
    (LOGPROBS, admin_pb2.LogprobsMode, plan.LogprobsMode),
    (STEP, admin_pb2.WarmupStepKind, plan.StepKind),
    (PATH, admin_pb2.SamplerPath, plan.SamplerPath),
    (PHASE, admin_pb2.Phase, plan.Phase),
)
_TO_PB: dict[Enum, int] = {v: k for table, _, _ in TABLES for k, v in table.items()}
# The steps a Warmup RPC runs; RESEED and MARK_SERVING have RPCs of their own.
WARMUP_RPC_STEPS = frozenset({plan.StepKind.PROFILE, plan.StepKind.COMPILE, plan.StepKind.SAMPLER})


class ConversionError(ValueError):
    """A message the other side cannot take; str() names the field and the value."""


def to_pb(value: Enum) -> int:
    """The protobuf value of any plan enum value."""
    return _TO_PB[value]


def _name(enum_type: EnumTypeWrapper, value: int) -> str:
    try:
        return enum_type.Name(value)
    except ValueError:
        return f"unknown value {value}"


def from_pb(table: Mapping[int, E], value: int, enum_type: EnumTypeWrapper, where: str) -> E:
    """The plan value of a protobuf enum value, or ConversionError naming ``where``."""
    if value in table:
        return table[value]
    expected = ", ".join(enum_type.Name(k) for k in table)
    raise ConversionError(f"{where}: got {_name(enum_type, value)}; expected one of {expected}")


def _kv_explicit(pb: admin_pb2.ModelProfile) -> bool:
    sizing = pb.kv_cache_sizing
    name = _name(admin_pb2.KvCacheSizing, sizing)
    where = f"model {pb.name!r}: kv_cache_sizing {name} with has_kv_cache={pb.has_kv_cache}"
    if pb.has_kv_cache:
        if sizing == admin_pb2.KV_CACHE_SIZING_AUTOMATIC:
            return False
        if sizing == admin_pb2.KV_CACHE_SIZING_EXPLICIT:
            return True
        raise ConversionError(f"{where}; a model with a KV cache must say AUTOMATIC or EXPLICIT")
    if sizing in (admin_pb2.KV_CACHE_SIZING_UNSPECIFIED, admin_pb2.KV_CACHE_SIZING_NONE):
        return False
    raise ConversionError(f"{where}; a model without a KV cache must say NONE")


def bucket_from_pb(pb: admin_pb2.ShapeBucket, model: str = "") -> plan.Bucket:
    phase = from_pb(PHASE, pb.phase, admin_pb2.Phase, f"model {model!r}: bucket phase")
    return plan.Bucket(phase, pb.batch_size, pb.seq_len, pb.context_len)


def bucket_to_pb(bucket: plan.Bucket) -> admin_pb2.ShapeBucket:
    return admin_pb2.ShapeBucket(
        phase=to_pb(bucket.phase),
        batch_size=bucket.batch_size,
        seq_len=bucket.seq_len,
        context_len=bucket.context_len,
    )


def profile_from_pb(pb: admin_pb2.ModelProfile) -> plan.ModelProfile:
    """One Describe model entry as the decision table's input."""
    where = f"model {pb.name!r}"
    kind = from_pb(KIND, pb.kind, inference_pb2.ModelKind, f"{where}: kind")
    mode = from_pb(
        MODE, pb.compilation_mode, inference_pb2.CompilationMode, f"{where}: compilation_mode"
    )
    if kind is plan.ModelKind.EMBEDDING and pb.logprobs_mode == admin_pb2.LOGPROBS_MODE_UNSPECIFIED:
        logprobs = plan.LogprobsMode.RAW  # no sampler: the mode does not matter
    else:
        logprobs = from_pb(
            LOGPROBS, pb.logprobs_mode, admin_pb2.LogprobsMode, f"{where}: logprobs_mode"
        )
    return plan.ModelProfile(
        name=pb.name,
        kind=kind,
        has_kv_cache=pb.has_kv_cache,
        kv_cache_explicit=_kv_explicit(pb),
        compilation_mode=mode,
        logprobs_mode=logprobs,
        buckets=tuple(bucket_from_pb(b, pb.name) for b in pb.buckets),
        numerics=pb.numerics,
        artifacts=pb.artifacts,
        backend=pb.backend,
        proof=pb.proof,
    )


def profiles_from_describe(resp: admin_pb2.DescribeResponse) -> tuple[plan.ModelProfile, ...]:
    return tuple(profile_from_pb(m) for m in resp.models)


def profile_to_pb(
    p: plan.ModelProfile, kv_cache_tokens: int = 0, compiled: Iterable[plan.Bucket] = ()
) -> admin_pb2.ModelProfile:
    """The inverse of profile_from_pb, with what this process has done so far."""
    if not p.has_kv_cache:
        sizing = admin_pb2.KV_CACHE_SIZING_NONE
    elif p.kv_cache_explicit:
        sizing = admin_pb2.KV_CACHE_SIZING_EXPLICIT
    else:
        sizing = admin_pb2.KV_CACHE_SIZING_AUTOMATIC
    return admin_pb2.ModelProfile(
        name=p.name,
        kind=to_pb(p.kind),
        has_kv_cache=p.has_kv_cache,
        kv_cache_sizing=sizing,
        kv_cache_tokens=kv_cache_tokens,
        compilation_mode=to_pb(p.compilation_mode),
        logprobs_mode=to_pb(p.logprobs_mode),
        buckets=[bucket_to_pb(b) for b in p.buckets],
        compiled_buckets=[bucket_to_pb(b) for b in compiled],
        numerics=p.numerics,
        artifacts=p.artifacts,
        backend=p.backend,
        proof=p.proof,
    )


def paths_from_pb(values: Iterable[int], where: str) -> tuple[plan.SamplerPath, ...]:
    return tuple(from_pb(PATH, p, admin_pb2.SamplerPath, f"{where}: sampler path") for p in values)


def step_from_pb(pb: admin_pb2.PlannedStep) -> plan.Step:
    where = f"planned step for model {pb.model!r}"
    kind = from_pb(STEP, pb.step, admin_pb2.WarmupStepKind, f"{where}: step")
    return plan.Step(kind, pb.model, paths_from_pb(pb.sampler_paths, where), pb.reason)


def step_to_pb(step: plan.Step, done: bool = False) -> admin_pb2.PlannedStep:
    return admin_pb2.PlannedStep(
        step=to_pb(step.kind),
        model=step.model,
        sampler_paths=[to_pb(p) for p in step.sampler_paths],
        reason=step.reason,
        done=done,
    )


def steps_from_pb(pbs: Sequence[admin_pb2.PlannedStep]) -> tuple[plan.Step, ...]:
    return tuple(step_from_pb(s) for s in pbs)


def warmup_request(step: plan.Step) -> admin_pb2.WarmupRequest:
    """The Warmup RPC that runs this step (PROFILE, COMPILE or SAMPLER only)."""
    if step.kind not in WARMUP_RPC_STEPS:
        raise ConversionError(f"{step.kind.name} is not run by Warmup; it has an RPC of its own")
    return admin_pb2.WarmupRequest(
        model=step.model,
        step=to_pb(step.kind),
        sampler_paths=[to_pb(p) for p in step.sampler_paths],
    )


def warmup_step_from_request(req: admin_pb2.WarmupRequest) -> plan.Step:
    """The step a Warmup RPC asks for; ConversionError unless PROFILE, COMPILE or SAMPLER."""
    kind = from_pb(STEP, req.step, admin_pb2.WarmupStepKind, "step")
    if kind not in WARMUP_RPC_STEPS:
        raise ConversionError(
            f"step: {kind.name}; Warmup runs PROFILE, COMPILE or SAMPLER "
            "(Reseed and MarkServing are their own calls)"
        )
    return plan.Step(kind, req.model, paths_from_pb(req.sampler_paths, "sampler_paths"))


def path_names(paths: Iterable[plan.SamplerPath | int]) -> str:
    """Sampler paths (plan or protobuf values) as a short comma-separated list."""
    names = []
    for p in paths:
        if isinstance(p, plan.SamplerPath):
            names.append(p.value)
        else:
            names.append(PATH[p].value if p in PATH else _name(admin_pb2.SamplerPath, p))
    return ", ".join(names)
