"""The sidecar's cross-check of the service's plan. Never changes what runs.

The service plans: Describe carries its required steps, and MarkServing enforces them. The
sidecar runs those, and only re-plans with the decision table it has installed
(``inference_api.plan.plan``) to tell the operator when the two tables disagree, which
means the service and the sidecar run different versions of that table.

Pure functions over plan values: the standard library and inference_api only.
"""

from __future__ import annotations

from collections.abc import Sequence

from inference_api import plan
from inference_api.convert import WARMUP_RPC_STEPS, path_names

Key = tuple[plan.StepKind, str]  # (step kind, model)


def _warmup_steps(steps: Sequence[plan.Step]) -> dict[Key, plan.Step]:
    """The Warmup RPC steps (PROFILE, COMPILE, SAMPLER) by kind and model, first one kept."""
    out: dict[Key, plan.Step] = {}
    for s in steps:
        if s.kind in WARMUP_RPC_STEPS:
            out.setdefault((s.kind, s.model), s)
    return out


def cross_check(profiles: Sequence[plan.ModelProfile], required: Sequence[plan.Step]) -> list[str]:
    """Where this sidecar's decision table disagrees with the service's required steps.

    One line per difference: a step only one side has, or a SAMPLER step warming other
    sampler paths. RESEED and MARK_SERVING are left out (the driver always runs them).
    An empty list means both tables agree.
    """
    ours = _warmup_steps(plan.plan(profiles).steps)
    theirs = _warmup_steps(required)
    lines: list[str] = []
    for key, svc in theirs.items():
        label = f"{key[0].name} {key[1]}"
        mine = ours.get(key)
        if mine is None:
            lines.append(f"{label}: the service requires it; the sidecar's table leaves it out")
        elif set(mine.sampler_paths) != set(svc.sampler_paths):
            lines.append(
                f"{label}: the service warms paths [{path_names(svc.sampler_paths)}]; "
                f"the sidecar's table [{path_names(mine.sampler_paths)}]"
            )
    lines += [
        f"{kind.name} {model}: the sidecar's table has it; the service does not require it"
        for kind, model in ours
        if (kind, model) not in theirs
    ]
    return lines
