"""What the sidecar tells the operator: the plan as a table, one line per step, and where
its own decision table disagrees with the service's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import inference_api
import warmup_ctl
from inference_api import convert, plan
from inference_api.stubs.inference.v1 import admin_pb2


@dataclass(frozen=True)
class Todo:
    """One Warmup step the service requires, as Describe lists it."""

    step: plan.Step
    # The service reports that this process already ran it.
    done: bool = False


def _table(rows: Sequence[tuple[str, str, str, str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return [
        "  " + "  ".join(c.ljust(w) for c, w in zip(r, [*widths, 0], strict=True)).rstrip()
        for r in rows
    ]


def format_plan(
    boot_id: str, todo: Sequence[Todo], skipped: Sequence[plan.Step], seed: int, models: int
) -> str:
    """The service's plan, numbered as the steps will be logged, then every skip with its
    reason (both from Describe)."""
    n = len(todo) + 2
    rows: list[tuple[str, str, str, str]] = [("#", "step", "model", "reason")]
    for k, item in enumerate(todo, 1):
        reason = item.step.reason or "(no reason given)"
        if item.done:
            reason += " [already done in this process]"
        rows.append((str(k), item.step.kind.name, item.step.model, reason))
    rows.append((str(n - 1), "RESEED", "", f"seed {seed}; always, after the last warmup step"))
    rows.append((str(n), "MARK_SERVING", "", "always, last"))
    for s in skipped:
        rows.append(("-", s.kind.name, s.model, f"skipped: {s.reason or '(no reason given)'}"))
    head = f"warmup plan for boot {boot_id}: {models} model(s), {n} step(s), {len(skipped)} skipped"
    return "\n".join([head, *_table(rows)])


def step_label(k: int, n: int, step: plan.Step) -> str:
    return f"step {k}/{n}: {step.kind.name} {step.model}".rstrip()


def format_result(label: str, resp: admin_pb2.WarmupResponse) -> str:
    """'step 2/6: COMPILE minilm 12.3 s, 1 compile event, 4 shapes: detail'."""
    if resp.skipped:
        return f"{label} skipped by the service: {resp.skip_reason or '(no reason given)'}"
    events = resp.compile_events
    parts = [f"{resp.seconds:.1f} s", f"{events} compile event{'' if events == 1 else 's'}"]
    if resp.shapes:
        parts.append(f"{len(resp.shapes)} shape{'' if len(resp.shapes) == 1 else 's'}")
    if resp.sampler_paths:
        parts.append(f"paths {convert.path_names(resp.sampler_paths)}")
    if resp.kv_cache_tokens:
        parts.append(f"KV cache {resp.kv_cache_tokens} tokens")
    text = f"{label} {', '.join(parts)}"
    return f"{text}: {resp.detail}" if resp.detail else text


def format_mismatch(differences: Sequence[str], service_version: str) -> str:
    """One warning: the two decision tables disagree, both versions, and what runs."""
    theirs = service_version or "unknown"
    head = (
        f"the service's required steps differ from this sidecar's decision table "
        f"(service version {theirs}; sidecar warmup_ctl {warmup_ctl.__version__}, "
        f"inference_api {inference_api.__version__}): running the service's steps"
    )
    return "\n".join([head, *(f"  - {d}" for d in differences)])
