"""The warmup driver's retry, backoff, failure and watch behaviour.

A small grpc.aio WarmupAdmin server on port 0 stands in for the service: it records every
call and injects failures (a test double; the end-to-end tests run the real service).
It enforces MarkServing's precondition the way DESIGN.md says the service does.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from inference_svc._pb.inference.v1 import admin_pb2, admin_pb2_grpc
from warmup_ctl import convert, driver, plan
from warmup_ctl.config import Config, parse_args
from warmup_ctl.plan import CompilationMode, LogprobsMode, ModelKind, ModelProfile, StepKind

pytestmark = pytest.mark.timeout(60)

MINILM = ModelProfile(
    "minilm", ModelKind.EMBEDDING, False, False, CompilationMode.DEFAULT,
    buckets=(("embed", 2, 16), ("embed", 8, 64)),
)  # fmt: skip
SMOLLM = ModelProfile(
    "smollm2", ModelKind.GENERATIVE, True, False, CompilationMode.DEFAULT, LogprobsMode.RAW,
    buckets=(("prefill", 2, 16), ("decode", 2, 1)),
)  # fmt: skip
PROFILES = (MINILM, SMOLLM)
# Warmup steps plan() gives PROFILES, in order.
EXPECTED = [
    ("COMPILE", "minilm"),
    ("PROFILE", "smollm2"),
    ("COMPILE", "smollm2"),
    ("SAMPLER", "smollm2"),
]
SEED = 4242


class FakeAdmin(admin_pb2_grpc.WarmupAdminServicer):
    """Records calls; fails steps on demand; refuses MarkServing like the real service."""

    def __init__(self, profiles: tuple[ModelProfile, ...] = PROFILES) -> None:
        self.boot_id = uuid.uuid4().hex[:8]
        self.profiles = profiles
        self.required = [s for s in plan.plan(profiles).steps]
        self.calls: list[tuple[str, ...]] = []
        self.loading_polls = 0  # Describe answers models_loaded=false this many times
        self.failures: dict[tuple[str, str], int] = {}  # (step, model) -> failures left; -1 always
        self.fail_code = grpc.StatusCode.INTERNAL
        self.step_delay = 0.0
        self.done: set[tuple[str, str]] = set()
        self.reseeded = False
        self.serving = False
        self.health = health.aio.HealthServicer()
        self.describe_hook: Callable[[admin_pb2.DescribeResponse], None] = lambda resp: None

    def warmups(self) -> list[tuple[str, str]]:
        return [(c[1], c[2]) for c in self.calls if c[0] == "Warmup"]

    def names(self) -> list[str]:
        return [c[0] for c in self.calls if c[0] != "Describe"]

    async def Describe(self, request, context):
        self.calls.append(("Describe",))
        loaded = self.loading_polls <= 0
        self.loading_polls -= 1
        required = [
            convert.step_to_pb(s, done=(s.kind.name, s.model) in self.done) for s in self.required
        ]
        resp = admin_pb2.DescribeResponse(
            boot_id=self.boot_id,
            models=[convert.profile_to_pb(p) for p in self.profiles] if loaded else [],
            required_steps=required if loaded else [],
            seed=SEED,
            serving=self.serving,
            models_loaded=loaded,
        )
        self.describe_hook(resp)
        return resp

    async def Warmup(self, request, context):
        key = (admin_pb2.WarmupStepKind.Name(request.step).split("_KIND_")[1], request.model)
        self.calls.append(("Warmup", *key))
        await asyncio.sleep(self.step_delay)
        left = self.failures.get(key, 0)
        if left:
            self.failures[key] = left - 1 if left > 0 else left
            await context.abort(self.fail_code, f"injected failure of {key[0]} {key[1]}")
        self.done.add(key)
        self.reseeded = False
        return admin_pb2.WarmupResponse(
            model=request.model, step=request.step, seconds=0.01, compile_events=1,
            sampler_paths=request.sampler_paths, detail="fake",
        )  # fmt: skip

    async def Reseed(self, request, context):
        self.calls.append(("Reseed", str(request.seed)))
        self.reseeded = True
        return admin_pb2.ReseedResponse(seed=request.seed)

    async def MarkServing(self, request, context):
        self.calls.append(("MarkServing",))
        missing = [
            f"{s.kind.name} {s.model}"
            for s in self.required
            if s.kind in convert.WARMUP_RPC_STEPS and (s.kind.name, s.model) not in self.done
        ]
        if missing or not self.reseeded:
            why = f"missing steps {missing}" if missing else "no Reseed after the last Warmup"
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        self.serving = True
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        return admin_pb2.MarkServingResponse(serving=True, boot_id=self.boot_id)


async def start(fake: FakeAdmin, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    admin_pb2_grpc.add_WarmupAdminServicer_to_server(fake, server)
    health_pb2_grpc.add_HealthServicer_to_server(fake.health, server)
    await fake.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(port: int, **kw: object) -> Config:
    fast = dict(
        once=True, connect_timeout=5.0, step_timeout=2.0, retries=2, poll_interval=0.05,
        backoff_initial=0.01, backoff_max=0.05, rpc_timeout=1.0,
    )  # fmt: skip
    fast.update(kw)
    return Config(admin=f"127.0.0.1:{port}", public=f"127.0.0.1:{port}", **fast)  # type: ignore[arg-type]


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeAdmin, int]]:
    f = FakeAdmin()
    server, port = await start(f)
    yield f, port
    await server.stop(None)


@pytest.fixture(autouse=True)
def _logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="warmup_ctl")


async def test_warms_every_step_then_reseeds_then_marks(fake, caplog) -> None:
    f, port = fake
    assert await driver.run(config(port)) == 0
    assert f.warmups() == EXPECTED
    assert f.names()[-2:] == ["Reseed", "MarkServing"]
    assert ("Reseed", str(SEED)) in f.calls
    log = caplog.text
    assert "warmup plan for boot" in log and "skipped: no KV cache to size" in log
    assert "step 1/6: COMPILE minilm 0.0 s, 1 compile event" in log
    assert "step 4/6: SAMPLER smollm2 ..." in log
    assert "SERVING: boot" in log and "public health SERVING" in log


async def test_waits_for_the_admin_port_with_backoff(caplog) -> None:
    port = free_port()
    task = asyncio.create_task(driver.run(config(port)))
    await asyncio.sleep(0.4)
    assert not task.done()
    f = FakeAdmin()
    server, _ = await start(f, port)
    try:
        assert await asyncio.wait_for(task, 10) == 0
    finally:
        await server.stop(None)
    assert f.names()[-1] == "MarkServing"
    retries = [r for r in caplog.records if "waiting for the service" in r.getMessage()]
    assert len(retries) >= 2 and all(r.levelno == logging.WARNING for r in retries)
    assert "UNAVAILABLE" in retries[0].getMessage()


async def test_retries_describe_while_models_load(fake, caplog) -> None:
    f, port = fake
    f.loading_polls = 3
    assert await driver.run(config(port)) == 0
    assert [c[0] for c in f.calls[:4]] == ["Describe"] * 4
    assert "models still loading" in caplog.text


async def test_gives_up_when_the_service_never_answers(caplog) -> None:
    cfg = config(free_port(), connect_timeout=0.3)
    assert await asyncio.wait_for(driver.run(cfg), 10) == 1
    assert "was not ready within 0.3 s" in caplog.text
    assert "giving up (--once)" in caplog.text


async def test_a_step_failing_then_succeeding_is_retried(fake, caplog) -> None:
    f, port = fake
    f.failures[("COMPILE", "smollm2")] = 2
    assert await driver.run(config(port, retries=2)) == 0
    assert f.warmups().count(("COMPILE", "smollm2")) == 3
    assert f.names()[-1] == "MarkServing"
    assert "step 3/6: COMPILE smollm2 failed: INTERNAL: injected failure" in caplog.text
    assert "retry 2/2" in caplog.text


async def test_a_step_that_keeps_failing_leaves_the_service_not_serving(fake, caplog) -> None:
    f, port = fake
    f.failures[("SAMPLER", "smollm2")] = -1
    assert await driver.run(config(port, retries=2)) == 1
    assert f.warmups().count(("SAMPLER", "smollm2")) == 3
    assert "MarkServing" not in f.names() and "Reseed" not in f.names()
    assert not f.serving
    last = caplog.records[-1]
    assert last.levelno == logging.ERROR
    msg = last.getMessage()
    assert "giving up (--once)" in msg and "SAMPLER smollm2 failed after 3 attempts" in msg
    assert "injected failure" in msg and "NOT_SERVING" in msg


async def test_invalid_argument_is_not_retried(fake) -> None:
    f, port = fake
    f.failures[("COMPILE", "minilm")] = -1
    f.fail_code = grpc.StatusCode.INVALID_ARGUMENT
    assert await driver.run(config(port, retries=3)) == 1
    assert f.warmups() == [("COMPILE", "minilm")]


async def test_step_deadline(fake, caplog) -> None:
    f, port = fake
    f.step_delay = 0.3
    assert await driver.run(config(port, step_timeout=0.1, retries=1)) == 1
    assert f.warmups() == [("COMPILE", "minilm")] * 2
    assert "DEADLINE_EXCEEDED" in caplog.text and "--step-timeout" in caplog.text


async def test_runs_the_union_with_the_services_required_steps(fake, caplog) -> None:
    f, port = fake
    extra = plan.Step(StepKind.PROFILE, "minilm", reason="the service wants it")
    f.required.insert(0, extra)
    assert await driver.run(config(port)) == 0
    assert f.warmups() == [("PROFILE", "minilm"), *EXPECTED]
    assert "the service requires PROFILE minilm, the local plan does not" in caplog.text


async def test_steps_already_done_are_not_rerun(fake, caplog) -> None:
    f, port = fake
    f.done.add(("COMPILE", "minilm"))
    assert await driver.run(config(port)) == 0
    assert f.warmups() == EXPECTED[1:]
    assert "step 1/6: COMPILE minilm already done in this process" in caplog.text


async def test_already_serving_needs_nothing(fake, caplog) -> None:
    f, port = fake
    f.serving = True
    assert await driver.run(config(port)) == 0
    assert f.names() == []
    assert "already SERVING" in caplog.text


async def test_a_profile_it_cannot_read_fails_with_the_reason(fake, caplog) -> None:
    f, port = fake

    def unknown_mode(resp: admin_pb2.DescribeResponse) -> None:
        resp.models[0].compilation_mode = 9  # a value this sidecar does not know

    f.describe_hook = unknown_mode
    assert await driver.run(config(port)) == 1
    assert "model 'minilm': compilation_mode: got unknown value 9" in caplog.text
    assert f.names() == []


async def test_watch_warms_a_restarted_service_again(caplog) -> None:
    first = FakeAdmin()
    server, port = await start(first)
    task = asyncio.create_task(driver.run(config(port, once=False)))
    try:
        await wait_until(lambda: first.serving)
        await server.stop(None)
        second = FakeAdmin()
        server, _ = await start(second, port)
        await wait_until(lambda: second.serving)
        assert second.warmups() == EXPECTED
        assert "lost the service" in caplog.text or "the service restarted" in caplog.text
        # Still watching, not warming the same process again.
        await asyncio.sleep(0.2)
        assert second.names().count("MarkServing") == 1
        assert not task.done()
    finally:
        task.cancel()
        await server.stop(None)
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_watch_mode_keeps_a_failed_boot_not_serving_until_it_restarts(caplog) -> None:
    f = FakeAdmin()
    f.failures[("COMPILE", "minilm")] = -1
    server, port = await start(f)
    task = asyncio.create_task(driver.run(config(port, once=False, retries=0)))
    try:
        await wait_until(lambda: "warming again when it restarts" in caplog.text)
        await asyncio.sleep(0.2)
        assert f.warmups() == [("COMPILE", "minilm")]
        assert not f.serving and not task.done()
        f.boot_id, f.failures = "restarted", {}
        await wait_until(lambda: f.serving)
    finally:
        task.cancel()
        await server.stop(None)


async def wait_until(cond, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.02)


def test_merge_unions_sampler_paths_and_warns() -> None:
    processed = ModelProfile(
        "smollm2", ModelKind.GENERATIVE, True, True, CompilationMode.DEFAULT,
        LogprobsMode.PROCESSED,
    )  # fmt: skip
    local = plan.plan([processed])
    theirs = plan.Step(StepKind.SAMPLER, "smollm2", (plan.SamplerPath.SEEDED,), "svc")
    required = [convert.step_to_pb(s) for s in local.steps if s.kind is not StepKind.SAMPLER]
    required.append(convert.step_to_pb(theirs))
    todo, warnings = driver.merge(local, required, ["smollm2"])
    assert [t.step.kind for t in todo] == [StepKind.COMPILE, StepKind.SAMPLER]
    P = plan.SamplerPath
    assert todo[-1].step.sampler_paths == (P.GREEDY, P.RANDOM, P.LOGPROBS, P.SEEDED)
    assert len(warnings) == 1 and "warming both" in warnings[0]


def test_merge_warns_about_a_step_the_service_does_not_require() -> None:
    local = plan.plan([MINILM])
    todo, warnings = driver.merge(local, [], ["minilm"])
    assert [(t.step.kind, t.service_only) for t in todo] == [(StepKind.COMPILE, False)]
    assert warnings == ["the local plan has COMPILE minilm, the service does not require it"]


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


def test_sigterm_stops_the_sidecar_cleanly() -> None:
    """A subprocess waiting for a service that is not there exits 0 on SIGTERM."""
    args = [
        "--admin",
        f"127.0.0.1:{free_port()}",
        "--backoff-initial",
        "0.1",
        "--backoff-max",
        "0.2",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "warmup_ctl", *args],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 30
        while "waiting for the service" not in proc.stderr.readline():
            assert time.monotonic() < deadline and proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "stopped by SIGTERM" in err
