"""The warmup decision table of DESIGN.md, over every combination of its inputs.

`expected()` restates the table independently of inference_api.plan, row by row; the
parametrised test holds plan() to it for kind x KV cache x KV sizing x mode x logprobs.
"""

from __future__ import annotations

import itertools

import pytest

from inference_api.plan import (
    Bucket,
    CompilationMode,
    LogprobsMode,
    ModelKind,
    ModelProfile,
    Phase,
    Plan,
    SamplerPath,
    Step,
    StepKind,
    plan,
    sampler_paths,
)

pytestmark = pytest.mark.unit

PER_MODEL = (StepKind.PROFILE, StepKind.COMPILE, StepKind.SAMPLER)
BUCKETS = (Bucket(Phase.PREFILL, 2, 16), Bucket(Phase.PREFILL, 2, 32), Bucket(Phase.DECODE, 2, 1))
ALL_PATHS = (SamplerPath.GREEDY, SamplerPath.RANDOM, SamplerPath.SEEDED, SamplerPath.LOGPROBS)

COMBOS = list(
    itertools.product(
        ModelKind, (False, True), (False, True), CompilationMode, LogprobsMode
    )  # kind, has_kv_cache, kv_cache_explicit, mode, logprobs mode
)


def profile(
    kind: ModelKind = ModelKind.GENERATIVE,
    has_kv: bool = True,
    explicit: bool = False,
    mode: CompilationMode = CompilationMode.DEFAULT,
    logprobs: LogprobsMode = LogprobsMode.RAW,
    name: str = "m",
) -> ModelProfile:
    return ModelProfile(name, kind, has_kv, explicit, mode, logprobs, BUCKETS)


def expected(p: ModelProfile) -> dict[StepKind, tuple[SamplerPath, ...] | None]:
    """DESIGN.md's table: step -> sampler paths when it runs, None when it is skipped."""
    compiled = p.compilation_mode is not CompilationMode.NONE
    generative = p.kind is ModelKind.GENERATIVE
    paths = tuple(
        x
        for x in ALL_PATHS
        if not (x is SamplerPath.SEEDED and p.logprobs_mode is LogprobsMode.PROCESSED)
    )
    return {
        StepKind.PROFILE: () if p.has_kv_cache and not p.kv_cache_explicit else None,
        StepKind.COMPILE: () if compiled else None,
        StepKind.SAMPLER: paths if generative and compiled else None,
    }


def by_kind(steps: tuple[Step, ...], model: str) -> dict[StepKind, Step]:
    found = [s for s in steps if s.model == model]
    kinds = [s.kind for s in found]
    assert len(kinds) == len(set(kinds)), f"duplicate steps for {model}: {kinds}"
    return {s.kind: s for s in found}


def ids(combo: tuple) -> str:
    kind, has_kv, explicit, mode, logprobs = combo
    kv = ("kv" if has_kv else "no_kv") + ("-explicit" if explicit else "-auto")
    return f"{kind.value}-{kv}-{mode.value}-{logprobs.value}"


@pytest.mark.parametrize("combo", COMBOS, ids=[ids(c) for c in COMBOS])
def test_whole_decision_table(combo: tuple) -> None:
    p = profile(*combo)
    result = plan([p])
    ran = by_kind(result.steps, p.name)
    skipped = by_kind(result.skipped, p.name)

    for kind, paths in expected(p).items():
        if paths is None:
            assert kind not in ran, f"{kind.name} should be skipped"
            assert kind in skipped, f"{kind.name} skipped without saying so"
            assert skipped[kind].reason.strip(), f"{kind.name} skipped without a reason"
        else:
            assert kind not in skipped
            assert ran[kind].sampler_paths == paths
            assert ran[kind].reason.strip(), f"{kind.name} runs without a reason"

    order = [s.kind for s in result.steps]
    assert order[-2:] == [StepKind.RESEED, StepKind.MARK_SERVING]
    assert order[:-2] == [k for k in PER_MODEL if k in ran]


def test_combos_cover_the_table() -> None:
    assert len(COMBOS) == 2 * 2 * 2 * 3 * 2
    assert len({ids(c) for c in COMBOS}) == len(COMBOS)


# The three cases DESIGN.md was written for.


@pytest.mark.parametrize("mode", [CompilationMode.DEFAULT, CompilationMode.MAX_AUTOTUNE])
def test_kv_cache_less_model_is_compiled_explicitly(mode: CompilationMode) -> None:
    p = profile(ModelKind.EMBEDDING, has_kv=False, mode=mode, name="minilm")
    ran = by_kind(plan([p]).steps, "minilm")
    assert StepKind.COMPILE in ran
    assert StepKind.PROFILE not in ran  # nothing else would compile it
    assert "KV-cache" in ran[StepKind.COMPILE].reason or "KV cache" in ran[StepKind.COMPILE].reason


@pytest.mark.parametrize(
    ("kind", "has_kv", "explicit"),
    [(k, h, e) for k in ModelKind for h in (False, True) for e in (False, True)],
)
def test_mode_none_runs_no_compile_or_sampler(
    kind: ModelKind, has_kv: bool, explicit: bool
) -> None:
    p = profile(kind, has_kv, explicit, CompilationMode.NONE)
    result = plan([p])
    kinds = [s.kind for s in result.steps if s.model]
    profile_needed = has_kv and not explicit
    assert kinds == ([StepKind.PROFILE] if profile_needed else [])
    skipped = by_kind(result.skipped, "m")
    assert "NONE" in skipped[StepKind.COMPILE].reason
    if kind is ModelKind.GENERATIVE:
        assert "NONE" in skipped[StepKind.SAMPLER].reason
    if has_kv and explicit:
        assert "explicit" in skipped[StepKind.PROFILE].reason


@pytest.mark.parametrize("logprobs", list(LogprobsMode))
@pytest.mark.parametrize("mode", [CompilationMode.DEFAULT, CompilationMode.MAX_AUTOTUNE])
def test_seeded_sampler_warm_unless_processed_logprobs(
    mode: CompilationMode, logprobs: LogprobsMode
) -> None:
    ran = by_kind(plan([profile(mode=mode, logprobs=logprobs)]).steps, "m")
    paths = ran[StepKind.SAMPLER].sampler_paths
    assert (SamplerPath.SEEDED in paths) is (logprobs is not LogprobsMode.PROCESSED)
    # Greedy, unseeded random and logprobs are always warmed.
    assert {SamplerPath.GREEDY, SamplerPath.RANDOM, SamplerPath.LOGPROBS} <= set(paths)
    if logprobs is LogprobsMode.PROCESSED:
        assert "seeded left out" in ran[StepKind.SAMPLER].reason


def test_sampler_paths_are_distinct_and_ordered() -> None:
    for mode in LogprobsMode:
        paths = sampler_paths(mode)
        assert len(paths) == len(set(paths))
        assert paths[0] is SamplerPath.GREEDY
        assert paths == tuple(x for x in ALL_PATHS if x in paths)


# Ordering and several models.


def test_empty_plan_still_reseeds_then_marks() -> None:
    result = plan([])
    assert [s.kind for s in result.steps] == [StepKind.RESEED, StepKind.MARK_SERVING]
    assert all(s.reason for s in result.steps)
    assert result.skipped == ()


def test_two_models_keep_their_order_and_reseed_comes_after_both() -> None:
    embed = profile(ModelKind.EMBEDDING, has_kv=False, name="minilm")
    lm = profile(ModelKind.GENERATIVE, has_kv=True, name="smollm2")
    result = plan([embed, lm])
    assert [(s.kind, s.model) for s in result.steps] == [
        (StepKind.COMPILE, "minilm"),
        (StepKind.PROFILE, "smollm2"),
        (StepKind.COMPILE, "smollm2"),
        (StepKind.SAMPLER, "smollm2"),
        (StepKind.RESEED, ""),
        (StepKind.MARK_SERVING, ""),
    ]
    assert [(s.kind, s.model) for s in result.skipped] == [
        (StepKind.PROFILE, "minilm"),
        (StepKind.SAMPLER, "minilm"),
    ]


@pytest.mark.parametrize("combo", COMBOS[::5], ids=[ids(c) for c in COMBOS[::5]])
def test_every_per_model_step_is_either_run_or_skipped(combo: tuple) -> None:
    result = plan([profile(*combo, name="a"), profile(*combo, name="b")])
    for name in ("a", "b"):
        ran, skipped = by_kind(result.steps, name), by_kind(result.skipped, name)
        assert set(ran) | set(skipped) == set(PER_MODEL)
        assert not set(ran) & set(skipped)
    assert sum(s.kind is StepKind.RESEED for s in result.steps) == 1
    assert result.steps[-1].kind is StepKind.MARK_SERVING


def test_plan_is_pure_and_hashable() -> None:
    p = profile()
    assert plan([p]) == plan([p])
    assert isinstance(plan([p]), Plan)
    hash(plan([p]))
