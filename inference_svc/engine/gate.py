"""The serving gate: which warmup steps ran, and whether the service may be SERVING.

MarkServing succeeds only when every step the plan requires ran in this process
and a Reseed came after the last warmup step that ran: the ordering bug (reseed
before warmup) is refused, not merely avoided. A failure (a late compile under
``--on-late-compile fail``) keeps the service unhealthy for the rest of the process.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Sequence

from inference_api.plan import SamplerPath, Step, StepKind
from inference_svc.errors import FailedPrecondition


class ServingGate:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: set[tuple[StepKind, str]] = set()
        self._paths: dict[str, set[SamplerPath]] = defaultdict(set)
        self._reseeded_after_warmup = False
        self._serving = False
        self._failure: str | None = None

    @property
    def serving(self) -> bool:
        """MarkServing succeeded in this process."""
        return self._serving

    @property
    def failure(self) -> str | None:
        """Why the service turned unhealthy after SERVING; None while it has not."""
        return self._failure

    @property
    def healthy(self) -> bool:
        """SERVING and not failed since: what health and Info report."""
        return self._serving and self._failure is None

    def fail(self, reason: str) -> bool:
        """Mark the service unhealthy; True when this is the first failure."""
        with self._lock:
            if self._failure is not None:
                return False
            self._failure = reason
            return True

    def record_warmup(self, step: Step) -> None:
        """A step ran (or found nothing left to do); ``step`` holds the paths it warmed."""
        with self._lock:
            self._done.add((step.kind, step.model))
            self._paths[step.model].update(step.sampler_paths)

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
                return self._serving
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

    def check_rewarm(self, call: str, rewarm: bool) -> None:
        """Reseed and MarkServing on a SERVING service only when the call says it re-warms."""
        if self._serving and not rewarm:
            raise FailedPrecondition(
                f"{call} refused: the service is SERVING, and a stray {call} would change a "
                "live service; set rewarm=true to re-warm on purpose"
            )

    def mark_serving(self, required: Sequence[Step]) -> None:
        self.check(required)
        with self._lock:
            self._serving = True


def _name(step: Step) -> str:
    paths = "+".join(p.value for p in step.sampler_paths)
    suffix = f"[{paths}]" if paths else ""
    return f"{step.kind.name} {step.model}{suffix}"
