"""The driver: plan, warm, reseed, mark SERVING; then watch for a restart and do it again.

One warm cycle, for one service process (one boot id):
  1. wait for the admin port and the models (Describe, retried with backoff);
  2. plan locally with plan.plan(), cross-check with Describe.required_steps (warn on any
     difference, run the union: the service's list is what MarkServing enforces);
  3. run each Warmup step (per-step deadline, retries with backoff);
  4. Reseed with Describe.seed, then MarkServing, then log SERVING.
Then the watch: poll Describe every poll interval; a new boot id or a dropped channel
starts a new cycle. A cycle that fails leaves the service NOT_SERVING and logs why.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from inference_svc._pb.inference.v1 import admin_pb2
from warmup_ctl import convert, plan
from warmup_ctl.admin import AdminClient, WarmupFailed, public_health, rpc_error
from warmup_ctl.config import Config
from warmup_ctl.report import Todo, format_plan, format_result, step_label

log = logging.getLogger("warmup_ctl")

_KIND_ORDER = {plan.StepKind.PROFILE: 0, plan.StepKind.COMPILE: 1, plan.StepKind.SAMPLER: 2}


@dataclass(frozen=True)
class Outcome:
    """How a warm cycle ended."""

    # The process it warmed (or tried to); None when no process answered.
    boot_id: str | None
    serving: bool
    reason: str = ""


def merge(
    local: plan.Plan, required: Sequence[admin_pb2.PlannedStep], models: Sequence[str]
) -> tuple[list[Todo], list[str]]:
    """The Warmup steps to run (the union of both lists, in plan order) and the differences.

    RESEED and MARK_SERVING are left out: the driver always runs them, last.
    """
    warnings: list[str] = []
    ours = {(s.kind, s.model): s for s in local.steps if s.kind in convert.WARMUP_RPC_STEPS}
    theirs: dict[tuple[plan.StepKind, str], tuple[plan.Step, bool]] = {}
    for pb in required:
        s = convert.step_from_pb(pb)
        if s.kind in convert.WARMUP_RPC_STEPS:
            theirs[(s.kind, s.model)] = (s, pb.done)
    todo: list[Todo] = []
    for key in [*ours, *(k for k in theirs if k not in ours)]:
        mine, (svc, done) = ours.get(key), theirs.get(key, (None, False))
        label = f"{key[0].name} {key[1]}"
        if mine is None:
            assert svc is not None
            warnings.append(f"the service requires {label}, the local plan does not: running it")
            todo.append(Todo(svc, done, service_only=True))
            continue
        if svc is None:
            warnings.append(f"the local plan has {label}, the service does not require it")
        elif set(svc.sampler_paths) != set(mine.sampler_paths):
            warnings.append(
                f"{label}: the local plan warms paths [{convert.path_names(mine.sampler_paths)}], "
                f"the service requires [{convert.path_names(svc.sampler_paths)}]: warming both"
            )
            extra = tuple(p for p in svc.sampler_paths if p not in mine.sampler_paths)
            mine = plan.Step(mine.kind, mine.model, mine.sampler_paths + extra, mine.reason)
        todo.append(Todo(mine, done))
    order = {name: i for i, name in enumerate(models)}
    todo.sort(
        key=lambda t: (order.get(t.step.model, len(order)), t.step.model, _KIND_ORDER[t.step.kind])
    )
    return todo, warnings


async def _run_steps(client: AdminClient, todo: Sequence[Todo]) -> None:
    n = len(todo) + 2
    for k, item in enumerate(todo, 1):
        label = step_label(k, n, item.step)
        if item.done:
            log.info("%s already done in this process", label)
            continue
        log.info("%s ...", label)
        resp = await client.warmup(convert.step_to_request(item.step), label)
        log.info("%s", format_result(label, resp))


async def _warm_boot(cfg: Config, client: AdminClient, desc: admin_pb2.DescribeResponse) -> None:
    """Plan, run, reseed and mark one loaded, not yet serving process. Raises WarmupFailed."""
    try:
        profiles = convert.profiles_from_describe(desc)
        local = plan.plan(profiles)
        todo, warnings = merge(local, desc.required_steps, [p.name for p in profiles])
    except convert.ConversionError as e:
        raise WarmupFailed(f"cannot plan from Describe: {e}") from e
    log.info("%s", format_plan(desc.boot_id, todo, local.skipped, desc.seed, len(profiles)))
    for w in warnings:
        log.warning("plan differs from the service's required steps: %s", w)

    await _run_steps(client, todo)
    n = len(todo) + 2
    reseeded = await client.reseed(desc.seed)
    log.info("step %d/%d: RESEED seed %d", n - 1, n, reseeded.seed)
    marked = await client.mark_serving()
    if marked.boot_id and marked.boot_id != desc.boot_id:
        raise WarmupFailed(
            f"the service restarted during warmup (boot {desc.boot_id} -> {marked.boot_id})"
        )
    if not marked.serving:
        raise WarmupFailed("MarkServing answered serving=false")
    log.info("step %d/%d: MARK_SERVING done", n, n)


async def warm(cfg: Config, client: AdminClient) -> Outcome:
    """One warm cycle for whichever process answers at the admin address."""
    try:
        desc = await client.wait_ready()
    except WarmupFailed as e:
        return Outcome(None, False, str(e))
    if desc.serving:
        log.info("boot %s is already SERVING: nothing to warm", desc.boot_id)
        return Outcome(desc.boot_id, True)
    try:
        await _warm_boot(cfg, client, desc)
    except WarmupFailed as e:
        reason = f"warmup of boot {desc.boot_id} failed: {e}; the service stays NOT_SERVING"
        return Outcome(desc.boot_id, False, reason)
    health = await public_health(cfg.public, cfg.rpc_timeout)
    log.info(
        "SERVING: boot %s; public health %s; clients can call inference.v1.Inference at %s",
        desc.boot_id,
        health,
        cfg.public,
    )
    return Outcome(desc.boot_id, True)


async def watch(cfg: Config, client: AdminClient, boot_id: str, serving: bool = True) -> None:
    """Returns once the process at the admin address is no longer `boot_id`, or went away."""
    log.info("watching boot %s (Describe every %g s)", boot_id, cfg.poll_interval)
    said_not_serving = not serving
    while True:
        await asyncio.sleep(cfg.poll_interval)
        try:
            desc = await client.describe()
        except grpc.aio.AioRpcError as e:
            log.warning("lost the service at %s (%s); waiting for it", cfg.admin, rpc_error(e))
            return
        if desc.boot_id != boot_id:
            log.warning("the service restarted (boot %s -> %s)", boot_id, desc.boot_id)
            return
        if not desc.serving and not said_not_serving:
            log.info("boot %s reports NOT_SERVING; waiting for a restart", boot_id)
        said_not_serving = not desc.serving


async def run(cfg: Config) -> int:
    """Warm (and, unless cfg.once, keep watching). The exit status: 0 SERVING, 1 failed."""
    client = AdminClient(cfg)
    try:
        while True:
            outcome = await warm(cfg, client)
            if cfg.once:
                if not outcome.serving:
                    log.error("giving up (--once): %s", outcome.reason)
                return 0 if outcome.serving else 1
            if outcome.boot_id is None:
                log.error("%s; still waiting", outcome.reason)
                continue
            if not outcome.serving:
                log.error("%s; warming again when it restarts", outcome.reason)
            await watch(cfg, client, outcome.boot_id, outcome.serving)
    finally:
        await client.close()
