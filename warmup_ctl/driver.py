"""The driver: warm, reseed, mark SERVING; then watch for a restart and do it again.

One warm cycle, for one service process (one boot id):
  1. wait for the admin port and the models (Describe, retried with backoff);
  2. take the plan from Describe: its required steps, in its order, with their done flags
     and reasons, and its skipped steps; log them as the plan table. The service plans (its
     MarkServing enforces that list); the sidecar re-plans only as a cross-check, and a
     disagreement is one warning naming both versions, never a change to what runs;
  3. run each required Warmup step not yet done (per-step deadline, retries with backoff);
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

from inference_api import convert
from inference_api.stubs.inference.v1 import admin_pb2
from warmup_ctl import plan
from warmup_ctl.admin import AdminClient, WarmupFailed, public_health, rpc_error
from warmup_ctl.config import Config
from warmup_ctl.report import Todo, format_mismatch, format_plan, format_result, step_label

log = logging.getLogger("warmup_ctl")


@dataclass(frozen=True)
class Outcome:
    """How a warm cycle ended."""

    # The process it warmed (or tried to); None when no process answered.
    boot_id: str | None
    serving: bool
    reason: str = ""


def todo_from_describe(desc: admin_pb2.DescribeResponse) -> list[Todo]:
    """The Warmup steps Describe requires (PROFILE, COMPILE, SAMPLER), in its order, each
    with its done flag. Raises ConversionError on a step this sidecar cannot read."""
    todo = [Todo(convert.step_from_pb(pb), pb.done) for pb in desc.required_steps]
    return [t for t in todo if t.step.kind in convert.WARMUP_RPC_STEPS]


async def _run_steps(client: AdminClient, todo: Sequence[Todo]) -> None:
    n = len(todo) + 2
    for k, item in enumerate(todo, 1):
        label = step_label(k, n, item.step)
        if item.done:
            log.info("%s already done in this process", label)
            continue
        log.info("%s ...", label)
        resp = await client.warmup(convert.warmup_request(item.step), label)
        log.info("%s", format_result(label, resp))


async def _warm_boot(cfg: Config, client: AdminClient, desc: admin_pb2.DescribeResponse) -> None:
    """Run, reseed and mark one loaded, not yet serving process. Raises WarmupFailed."""
    try:
        todo = todo_from_describe(desc)
        skipped = convert.steps_from_pb(desc.skipped_steps)
    except convert.ConversionError as e:
        raise WarmupFailed(f"cannot read the steps Describe requires: {e}") from e
    log.info("%s", format_plan(desc.boot_id, todo, skipped, desc.seed, len(desc.models)))
    _cross_check(desc, todo)

    await _run_steps(client, todo)
    n = len(todo) + 2
    reseeded = await client.reseed(desc.seed)
    log.info("step %d/%d: RESEED seed %d", n - 1, n, reseeded.seed)
    marked = await _mark_serving(client, desc.boot_id)
    if marked.boot_id and marked.boot_id != desc.boot_id:
        raise WarmupFailed(
            f"the service restarted during warmup (boot {desc.boot_id} -> {marked.boot_id})"
        )
    if not marked.serving:
        raise WarmupFailed("MarkServing answered serving=false")
    log.info("step %d/%d: MARK_SERVING done", n, n)


async def _mark_serving(client: AdminClient, boot_id: str) -> admin_pb2.MarkServingResponse:
    """MarkServing; when it is refused because an attempt whose reply was lost already
    marked this boot (the service refuses a second MarkServing on a SERVING service), ask
    Describe and take that as done."""
    try:
        return await client.mark_serving()
    except WarmupFailed as failed:
        try:
            desc = await client.describe()
        except grpc.aio.AioRpcError as e:  # the service went away (killed, restarting)
            raise WarmupFailed(f"{failed}; Describe then: {rpc_error(e)}") from e
        if desc.boot_id != boot_id or not desc.serving:
            raise
        log.info("MarkServing: boot %s is SERVING already (a reply was lost)", boot_id)
        return admin_pb2.MarkServingResponse(serving=True, boot_id=boot_id)


def _cross_check(desc: admin_pb2.DescribeResponse, todo: Sequence[Todo]) -> None:
    """Warn when this sidecar's own table disagrees with the service's; never fails: the
    service plans, and a profile this sidecar cannot read only means it cannot check."""
    try:
        profiles = convert.profiles_from_describe(desc)
    except convert.ConversionError as e:
        differences = [f"the sidecar cannot read the model profiles ({e}); not cross-checked"]
    else:
        differences = plan.cross_check(profiles, [t.step for t in todo])
    if differences:
        log.warning("%s", format_mismatch(differences, desc.version))


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
    health = await public_health(cfg)
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
