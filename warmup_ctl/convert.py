"""Protobuf <-> plan types, at the edge, so that plan.py stays free of protobuf.

Total: every enum value either maps to a plan value or raises ConversionError
with a message that names the model, the field and the value.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeVar

from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

from inference_svc._pb.inference.v1 import admin_pb2, inference_pb2
from warmup_ctl import plan

T = TypeVar("T")

_KIND = {
    inference_pb2.MODEL_KIND_EMBEDDING: plan.ModelKind.EMBEDDING,
    inference_pb2.MODEL_KIND_GENERATIVE: plan.ModelKind.GENERATIVE,
}
_MODE = {
    inference_pb2.COMPILATION_MODE_NONE: plan.CompilationMode.NONE,
    inference_pb2.COMPILATION_MODE_DEFAULT: plan.CompilationMode.DEFAULT,
    inference_pb2.COMPILATION_MODE_MAX_AUTOTUNE: plan.CompilationMode.MAX_AUTOTUNE,
}
_LOGPROBS = {
    admin_pb2.LOGPROBS_MODE_RAW: plan.LogprobsMode.RAW,
    admin_pb2.LOGPROBS_MODE_PROCESSED: plan.LogprobsMode.PROCESSED,
}
_STEP = {
    admin_pb2.WARMUP_STEP_KIND_PROFILE: plan.StepKind.PROFILE,
    admin_pb2.WARMUP_STEP_KIND_COMPILE: plan.StepKind.COMPILE,
    admin_pb2.WARMUP_STEP_KIND_SAMPLER: plan.StepKind.SAMPLER,
    admin_pb2.WARMUP_STEP_KIND_RESEED: plan.StepKind.RESEED,
    admin_pb2.WARMUP_STEP_KIND_MARK_SERVING: plan.StepKind.MARK_SERVING,
}
_PATH = {
    admin_pb2.SAMPLER_PATH_GREEDY: plan.SamplerPath.GREEDY,
    admin_pb2.SAMPLER_PATH_RANDOM: plan.SamplerPath.RANDOM,
    admin_pb2.SAMPLER_PATH_SEEDED: plan.SamplerPath.SEEDED,
    admin_pb2.SAMPLER_PATH_LOGPROBS: plan.SamplerPath.LOGPROBS,
}
_PHASE = {
    admin_pb2.PHASE_EMBED: "embed",
    admin_pb2.PHASE_PREFILL: "prefill",
    admin_pb2.PHASE_DECODE: "decode",
}
_KIND_PB = {v: k for k, v in _KIND.items()}
_MODE_PB = {v: k for k, v in _MODE.items()}
_LOGPROBS_PB = {v: k for k, v in _LOGPROBS.items()}
_STEP_PB = {v: k for k, v in _STEP.items()}
_PATH_PB = {v: k for k, v in _PATH.items()}
_PHASE_PB = {v: k for k, v in _PHASE.items()}
# The steps a Warmup RPC runs; RESEED and MARK_SERVING have RPCs of their own.
WARMUP_RPC_STEPS = frozenset({plan.StepKind.PROFILE, plan.StepKind.COMPILE, plan.StepKind.SAMPLER})


class ConversionError(ValueError):
    """A message from the service that the decision table cannot take."""


def _name(enum_type: EnumTypeWrapper, value: int) -> str:
    try:
        return enum_type.Name(value)
    except ValueError:
        return f"unknown value {value}"


def _lookup(table: Mapping[int, T], value: int, enum_type: EnumTypeWrapper, where: str) -> T:
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


def bucket_from_pb(pb: admin_pb2.ShapeBucket, model: str = "") -> tuple[str, int, int]:
    """A ShapeBucket as the (phase, batch_size, seq_len) triple plan.ModelProfile holds."""
    phase = _lookup(_PHASE, pb.phase, admin_pb2.Phase, f"model {model!r}: bucket phase")
    return (phase, pb.batch_size, pb.seq_len)


def bucket_to_pb(bucket: tuple[str, int, int]) -> admin_pb2.ShapeBucket:
    phase, batch_size, seq_len = bucket
    if phase not in _PHASE_PB:
        raise ConversionError(f"bucket phase {phase!r}; expected one of {', '.join(_PHASE_PB)}")
    return admin_pb2.ShapeBucket(phase=_PHASE_PB[phase], batch_size=batch_size, seq_len=seq_len)


def profile_from_pb(pb: admin_pb2.ModelProfile) -> plan.ModelProfile:
    """One Describe model entry as the decision table's input."""
    where = f"model {pb.name!r}"
    kind = _lookup(_KIND, pb.kind, inference_pb2.ModelKind, f"{where}: kind")
    mode = _lookup(
        _MODE, pb.compilation_mode, inference_pb2.CompilationMode, f"{where}: compilation_mode"
    )
    if kind is plan.ModelKind.EMBEDDING and pb.logprobs_mode == admin_pb2.LOGPROBS_MODE_UNSPECIFIED:
        logprobs = plan.LogprobsMode.RAW  # no sampler: the mode does not matter
    else:
        logprobs = _lookup(
            _LOGPROBS, pb.logprobs_mode, admin_pb2.LogprobsMode, f"{where}: logprobs_mode"
        )
    return plan.ModelProfile(
        name=pb.name,
        kind=kind,
        has_kv_cache=pb.has_kv_cache,
        kv_cache_explicit=_kv_explicit(pb),
        compilation_mode=mode,
        logprobs_mode=logprobs,
        buckets=tuple(bucket_from_pb(b, pb.name) for b in pb.buckets),
    )


def profiles_from_describe(resp: admin_pb2.DescribeResponse) -> tuple[plan.ModelProfile, ...]:
    return tuple(profile_from_pb(m) for m in resp.models)


def profile_to_pb(p: plan.ModelProfile) -> admin_pb2.ModelProfile:
    """The inverse of profile_from_pb (for the service and for test doubles)."""
    if not p.has_kv_cache:
        sizing = admin_pb2.KV_CACHE_SIZING_NONE
    elif p.kv_cache_explicit:
        sizing = admin_pb2.KV_CACHE_SIZING_EXPLICIT
    else:
        sizing = admin_pb2.KV_CACHE_SIZING_AUTOMATIC
    return admin_pb2.ModelProfile(
        name=p.name,
        kind=_KIND_PB[p.kind],
        has_kv_cache=p.has_kv_cache,
        kv_cache_sizing=sizing,
        compilation_mode=_MODE_PB[p.compilation_mode],
        logprobs_mode=_LOGPROBS_PB[p.logprobs_mode],
        buckets=[bucket_to_pb(b) for b in p.buckets],
    )


def step_from_pb(pb: admin_pb2.PlannedStep) -> plan.Step:
    where = f"required step for model {pb.model!r}"
    kind = _lookup(_STEP, pb.step, admin_pb2.WarmupStepKind, f"{where}: step")
    paths = tuple(
        _lookup(_PATH, p, admin_pb2.SamplerPath, f"{where}: sampler path") for p in pb.sampler_paths
    )
    return plan.Step(kind, pb.model, paths, pb.reason)


def step_to_pb(step: plan.Step, done: bool = False) -> admin_pb2.PlannedStep:
    return admin_pb2.PlannedStep(
        step=_STEP_PB[step.kind],
        model=step.model,
        sampler_paths=[_PATH_PB[p] for p in step.sampler_paths],
        reason=step.reason,
        done=done,
    )


def step_to_request(step: plan.Step) -> admin_pb2.WarmupRequest:
    """The Warmup RPC that runs this step (PROFILE, COMPILE or SAMPLER only)."""
    if step.kind not in WARMUP_RPC_STEPS:
        raise ConversionError(f"{step.kind.name} is not run by Warmup; it has an RPC of its own")
    return admin_pb2.WarmupRequest(
        model=step.model,
        step=_STEP_PB[step.kind],
        sampler_paths=[_PATH_PB[p] for p in step.sampler_paths],
    )


def path_names(paths: Iterable[plan.SamplerPath | int]) -> str:
    """Sampler paths (plan or protobuf values) as a short comma-separated list."""
    names = []
    for p in paths:
        if isinstance(p, plan.SamplerPath):
            names.append(p.value)
        else:
            names.append(_PATH[p].value if p in _PATH else _name(admin_pb2.SamplerPath, p))
    return ", ".join(names)
