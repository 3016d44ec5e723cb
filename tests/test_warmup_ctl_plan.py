"""The sidecar's pure parts: its cross-check of the service's plan against its own copy of
the decision table, and its configuration."""

from __future__ import annotations

import pytest

from inference_api import plan
from inference_api.plan import (
    CompilationMode,
    LogprobsMode,
    ModelKind,
    ModelProfile,
    SamplerPath,
    StepKind,
)
from tests.warmup_fakes import MINILM, PROFILES, SMOLLM
from warmup_ctl.config import parse_args
from warmup_ctl.plan import cross_check

pytestmark = pytest.mark.unit


def test_cross_check_names_each_difference_with_the_services_steps() -> None:
    processed = ModelProfile(
        "smollm2", ModelKind.GENERATIVE, True, True, CompilationMode.DEFAULT,
        LogprobsMode.PROCESSED,
    )  # fmt: skip
    seeded = plan.Step(StepKind.SAMPLER, "smollm2", (SamplerPath.SEEDED,), "svc")
    required = [
        plan.Step(StepKind.PROFILE, "minilm"),  # the service only
        plan.Step(StepKind.COMPILE, "smollm2"),
        seeded,  # other paths
        # COMPILE minilm: the sidecar only
    ]
    lines = cross_check([MINILM, processed], required)
    assert lines == [
        "PROFILE minilm: the service requires it; the sidecar's table leaves it out",
        "SAMPLER smollm2: the service warms paths [seeded]; "
        "the sidecar's table [greedy, random, logprobs]",
        "COMPILE minilm: the sidecar's table has it; the service does not require it",
    ]


def test_cross_check_is_empty_when_both_tables_agree() -> None:
    steps = plan.plan(PROFILES).steps
    assert cross_check(PROFILES, steps) == []
    # RESEED and MARK_SERVING always run; listing them or not is no difference.
    warmups = [s for s in steps if s.kind not in (StepKind.RESEED, StepKind.MARK_SERVING)]
    assert cross_check(PROFILES, warmups) == []
    # Neither is the order of the sampler paths.
    flip = [plan.Step(s.kind, s.model, s.sampler_paths[::-1]) for s in warmups]
    assert cross_check(PROFILES, flip) == []
    assert cross_check([SMOLLM], []) == [
        f"{k} smollm2: the sidecar's table has it; the service does not require it"
        for k in ("PROFILE", "COMPILE", "SAMPLER")
    ]


def test_config_from_flags_and_environment() -> None:
    env = {"WARMUP_CTL_ADMIN": "10.0.0.1:7000"}
    cfg = parse_args([], env)
    assert cfg.admin == "10.0.0.1:7000" and cfg.public == "127.0.0.1:50051"
    assert cfg.step_timeout >= 600 and not cfg.once
    cfg = parse_args(["--admin", "h:1", "--once", "--retries", "0", "--step-timeout", "5"], env)
    assert (cfg.admin, cfg.once, cfg.retries, cfg.step_timeout) == ("h:1", True, 0, 5.0)
    with pytest.raises(SystemExit):
        parse_args(["--retries", "-1"], {})
    with pytest.raises(AttributeError):
        cfg.once = False  # type: ignore[misc]
