"""The one protobuf <-> plan conversion: total over every enum value, exact round trips,
and one error type naming the field for anything it cannot take."""

from __future__ import annotations

import pytest

from inference_api import convert
from inference_api.plan import (
    Bucket,
    CompilationMode,
    LogprobsMode,
    ModelKind,
    ModelProfile,
    Phase,
    SamplerPath,
    Step,
    StepKind,
)
from inference_api.stubs.inference.v1 import admin_pb2 as apb

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("table,pb_enum,plan_enum", convert.TABLES)
def test_every_enum_value_maps_both_ways(table, pb_enum, plan_enum) -> None:
    named = {v for v in pb_enum.values() if not pb_enum.Name(v).endswith("_UNSPECIFIED")}
    assert set(table) == named, f"{pb_enum} values without a plan value"
    assert set(table.values()) == set(plan_enum), f"{plan_enum} members without a wire value"
    for value, member in table.items():
        assert convert.to_pb(member) == value


@pytest.mark.parametrize("table,pb_enum,plan_enum", convert.TABLES)
def test_unknown_and_unspecified_values_raise_one_error_naming_the_field(
    table, pb_enum, plan_enum
) -> None:
    for value in (0, 999):
        with pytest.raises(convert.ConversionError, match=r"^the field: got .*; expected one of"):
            convert.from_pb(table, value, pb_enum, "the field")


PROFILES = [
    ModelProfile(
        "minilm", ModelKind.EMBEDDING, False, False, CompilationMode.DEFAULT,
        buckets=(Bucket(Phase.EMBED, 2, 16), Bucket(Phase.EMBED, 4, 32)),
    ),
    ModelProfile(
        "smollm2", ModelKind.GENERATIVE, True, False, CompilationMode.MAX_AUTOTUNE,
        LogprobsMode.PROCESSED, (Bucket(Phase.PREFILL, 2, 16), Bucket(Phase.DECODE, 2, 1)),
    ),
    ModelProfile("lm", ModelKind.GENERATIVE, True, True, CompilationMode.NONE),
]  # fmt: skip


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_profiles_round_trip(profile: ModelProfile) -> None:
    pb = convert.profile_to_pb(profile, kv_cache_tokens=2048, compiled=profile.buckets[:1])
    assert convert.profile_from_pb(apb.ModelProfile.FromString(pb.SerializeToString())) == profile
    assert pb.kv_cache_tokens == 2048 and len(pb.compiled_buckets) == len(profile.buckets[:1])


def test_steps_round_trip_and_warmup_requests_carry_the_step() -> None:
    step = Step(StepKind.SAMPLER, "smollm2", (SamplerPath.GREEDY, SamplerPath.SEEDED), "why")
    assert convert.step_from_pb(convert.step_to_pb(step, done=True)) == step
    request = convert.warmup_request(step)
    assert convert.warmup_step_from_request(request) == Step(
        step.kind, step.model, step.sampler_paths
    )


@pytest.mark.parametrize("kind", [StepKind.RESEED, StepKind.MARK_SERVING])
def test_reseed_and_mark_serving_are_not_warmup_requests(kind: StepKind) -> None:
    with pytest.raises(convert.ConversionError, match=kind.name):
        convert.warmup_request(Step(kind))
    with pytest.raises(convert.ConversionError, match="Reseed and MarkServing are their own calls"):
        convert.warmup_step_from_request(apb.WarmupRequest(step=convert.to_pb(kind)))


def test_a_profile_that_contradicts_itself_is_refused_with_the_model_name() -> None:
    pb = convert.profile_to_pb(PROFILES[0])
    pb.kv_cache_sizing = apb.KV_CACHE_SIZING_AUTOMATIC  # but has_kv_cache is false
    with pytest.raises(convert.ConversionError, match="model 'minilm': kv_cache_sizing"):
        convert.profile_from_pb(pb)
    pb = convert.profile_to_pb(PROFILES[1])
    pb.buckets.add(phase=42, batch_size=2, seq_len=16)
    with pytest.raises(convert.ConversionError, match="model 'smollm2': bucket phase: got unknown"):
        convert.profile_from_pb(pb)
