"""The serving gate: which warmup steps ran, and whether MarkServing may flip health.

MarkServing succeeds only when every step the plan requires ran in this process
and a Reseed came after the last warmup step that ran: the ordering bug (reseed
before warmup) is refused, not merely avoided.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Sequence

from inference_svc.errors import FailedPrecondition
from warmup_ctl.plan import SamplerPath, Step, StepKind


class ServingGate:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: set[tuple[StepKind, str]] = set()
        self._paths: dict[str, set[SamplerPath]] = defaultdict(set)
        self._reseeded_after_warmup = False
        self.serving = False
        self.failed: str | None = None  # set by --on-late-compile fail

    def record_warmup(self, kind: StepKind, model: str, paths: Sequence[SamplerPath]) -> None:
        """A step ran (or found nothing left to do)."""
        with self._lock:
            self._done.add((kind, model))
            self._paths[model].update(paths)

    def invalidate_reseed(self) -> None:
        """A step used the model or the random state: a Reseed must follow it."""
        with self._lock:
            self._reseeded_after_warmup = False

    def record_reseed(self) -> None:
        with self._lock:
            self._reseeded_after_warmup = True

    def is_done(self, step: Step) -> bool:
        with self._lock:
            if step.kind is StepKind.SAMPLER:
                return set(step.sampler_paths) <= self._paths[step.model]
            if step.kind is StepKind.RESEED:
                return self._reseeded_after_warmup
            if step.kind is StepKind.MARK_SERVING:
                return self.serving
            return (step.kind, step.model) in self._done

    def check(self, required: Sequence[Step]) -> None:
        """Raise FailedPrecondition naming what is missing."""
        missing = [
            s
            for s in required
            if s.kind not in (StepKind.RESEED, StepKind.MARK_SERVING) and not self.is_done(s)
        ]
        if missing:
            names = ", ".join(_name(s) for s in missing)
            raise FailedPrecondition(f"MarkServing refused: required warmup steps not run: {names}")
        if not self._reseeded_after_warmup:
            raise FailedPrecondition(
                "MarkServing refused: no Reseed after the last warmup step "
                "(call Reseed after the last Warmup, then MarkServing)"
            )

    def mark_serving(self, required: Sequence[Step]) -> None:
        self.check(required)
        with self._lock:
            self.serving = True


def _name(step: Step) -> str:
    paths = "+".join(p.value for p in step.sampler_paths)
    suffix = f"[{paths}]" if paths else ""
    return f"{step.kind.name} {step.model}{suffix}"
