"""The warmup driver's retry, backoff, failure and watch behaviour, and scripts/run.sh.

A small grpc.aio WarmupAdmin server on port 0 (tests/warmup_fakes.py) stands in for the
service: it records every call and injects failures. The end-to-end tests run the real one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest

import inference_api
import warmup_ctl
from harness.procs import free_port
from inference_api import plan
from inference_api.plan import (
    SamplerPath,
    StepKind,
)
from inference_api.stubs.inference.v1 import admin_pb2
from tests.warmup_fakes import EXPECTED, SEED, FakeAdmin, start
from warmup_ctl import driver
from warmup_ctl.config import Config

pytestmark = [pytest.mark.rpc, pytest.mark.timeout(60)]
ROOT = Path(__file__).resolve().parent.parent
Fake = tuple[FakeAdmin, int]  # the fixture: a started double and its port


def config(port: int, **kw: object) -> Config:
    fast = dict(
        once=True, connect_timeout=5.0, step_timeout=2.0, retries=2, poll_interval=0.05,
        backoff_initial=0.01, backoff_max=0.05, rpc_timeout=1.0,
    )  # fmt: skip
    fast.update(kw)
    return Config(admin=f"127.0.0.1:{port}", public=f"127.0.0.1:{port}", **fast)  # type: ignore[arg-type]


@pytest.fixture
async def fake() -> AsyncIterator[Fake]:
    f = FakeAdmin()
    server, port = await start(f)
    yield f, port
    await server.stop(None)


@pytest.fixture(autouse=True)
def _logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="warmup_ctl")


async def test_warms_every_step_then_reseeds_then_marks(
    fake: Fake, caplog: pytest.LogCaptureFixture
) -> None:
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
    assert "decision table" not in log  # both sides plan alike: no cross-check warning


async def test_waits_for_the_admin_port_with_backoff(caplog: pytest.LogCaptureFixture) -> None:
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


async def test_retries_describe_while_models_load(
    fake: Fake, caplog: pytest.LogCaptureFixture
) -> None:
    f, port = fake
    f.loading_polls = 3
    assert await driver.run(config(port)) == 0
    assert [c[0] for c in f.calls[:4]] == ["Describe"] * 4
    assert "models still loading" in caplog.text


async def test_gives_up_when_the_service_never_answers(caplog: pytest.LogCaptureFixture) -> None:
    cfg = config(free_port(), connect_timeout=0.3)
    assert await asyncio.wait_for(driver.run(cfg), 10) == 1
    assert "was not ready within 0.3 s" in caplog.text
    assert "giving up (--once)" in caplog.text


async def test_a_step_failing_then_succeeding_is_retried(
    fake: Fake, caplog: pytest.LogCaptureFixture
) -> None:
    f, port = fake
    f.failures[("COMPILE", "smollm2")] = 2
    assert await driver.run(config(port, retries=2)) == 0
    assert f.warmups().count(("COMPILE", "smollm2")) == 3
    assert f.names()[-1] == "MarkServing"
    assert "step 3/6: COMPILE smollm2 failed: INTERNAL: injected failure" in caplog.text
    assert "retry 2/2" in caplog.text


async def test_a_step_that_keeps_failing_leaves_the_service_not_serving(
    fake: Fake, caplog: pytest.LogCaptureFixture
) -> None:
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


async def test_invalid_argument_is_not_retried(fake: Fake) -> None:
    f, port = fake
    f.failures[("COMPILE", "minilm")] = -1
    f.fail_code = grpc.StatusCode.INVALID_ARGUMENT
    assert await driver.run(config(port, retries=3)) == 1
    assert f.warmups() == [("COMPILE", "minilm")]


async def test_step_deadline(fake: Fake, caplog: pytest.LogCaptureFixture) -> None:
    f, port = fake
    f.step_delay = 0.3
    assert await driver.run(config(port, step_timeout=0.1, retries=1)) == 1
    assert f.warmups() == [("COMPILE", "minilm")] * 2
    assert "DEADLINE_EXCEEDED" in caplog.text and "--step-timeout" in caplog.text


@pytest.mark.parametrize(("version", "shown"), [("0.3.0", "0.3.0"), ("", "unknown")])
async def test_runs_exactly_the_services_steps_and_warns_once_naming_both_versions(
    fake: Fake, caplog: pytest.LogCaptureFixture, version: str, shown: str
) -> None:
    """A service whose decision table differs (another version): its list is what runs."""
    f, port = fake
    f.version = version
    extra = plan.Step(StepKind.PROFILE, "minilm", reason="the service wants it")
    greedy = plan.Step(StepKind.SAMPLER, "smollm2", (SamplerPath.GREEDY,), "greedy only")
    # Drops COMPILE minilm (the first step), adds PROFILE minilm, warms one sampler path.
    f.required = [extra, *(greedy if s.kind is StepKind.SAMPLER else s for s in f.required[1:])]
    assert await driver.run(config(port)) == 0
    # In the service's order; COMPILE minilm (only the sidecar's table has it) is not run.
    assert f.warmups() == [("PROFILE", "minilm"), *EXPECTED[1:]]
    assert "step 4/6: SAMPLER smollm2 0.0 s, 1 compile event, paths greedy: fake" in caplog.text
    assert f.serving
    [msg] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"service version {shown}" in msg
    assert f"warmup_ctl {warmup_ctl.__version__}" in msg
    assert f"inference_api {inference_api.__version__}" in msg
    assert "running the service's steps" in msg
    assert "PROFILE minilm" in msg and "COMPILE minilm" in msg and "SAMPLER smollm2" in msg


async def test_plan_table_shows_the_services_skipped_steps_with_reasons(
    fake: Fake, caplog: pytest.LogCaptureFixture
) -> None:
    f, port = fake
    f.skipped = [plan.Step(StepKind.PROFILE, "minilm", reason="the service's own reason")]
    assert await driver.run(config(port)) == 0
    table = next(r.getMessage() for r in caplog.records if "warmup plan for boot" in r.getMessage())
    assert "6 step(s), 1 skipped" in table
    assert "skipped: the service's own reason" in table
    # The table is Describe's: the sidecar's own skip reasons are not in it.
    assert "embedding model: no sampler" not in table
    assert [ln.split()[0] for ln in table.splitlines()[2:]] == [*"123456", "-"]


async def test_steps_already_done_are_not_rerun(
    fake: Fake, caplog: pytest.LogCaptureFixture
) -> None:
    f, port = fake
    f.gate.record_warmup(plan.Step(StepKind.COMPILE, "minilm"))
    assert await driver.run(config(port)) == 0
    assert f.warmups() == EXPECTED[1:]
    assert "step 1/6: COMPILE minilm already done in this process" in caplog.text


async def test_a_lost_mark_serving_reply_is_not_a_failure(
    fake: Fake, caplog: pytest.LogCaptureFixture
) -> None:
    f, port = fake
    f.lose_mark_replies = 1  # marked, reply lost; the retry is refused: already SERVING
    assert await driver.run(config(port)) == 0
    assert f.names().count("MarkServing") == 2 and f.serving
    assert "SERVING already (a reply was lost)" in caplog.text


async def test_a_service_killed_during_mark_serving_does_not_stop_the_sidecar(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """MarkServing fails and the service is gone when the sidecar asks Describe why: the
    sidecar reports a failed warmup (and, without --once, waits for the restart); it used
    to die of the Describe error."""

    class Killed(FakeAdmin):
        async def MarkServing(self, request, context):  # type: ignore[no-untyped-def]
            self.calls.append(("MarkServing",))
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(server.stop(None)))
            await context.abort(grpc.StatusCode.UNAVAILABLE, "injected: killed")

    server, port = await start(Killed())
    assert await driver.run(config(port)) == 1
    assert "MarkServing failed" in caplog.text and "Describe then: UNAVAILABLE" in caplog.text


async def test_already_serving_needs_nothing(fake: Fake, caplog: pytest.LogCaptureFixture) -> None:
    f, port = fake
    f.serve_now()
    assert await driver.run(config(port)) == 0
    assert f.names() == []
    assert "already SERVING" in caplog.text


async def test_a_profile_it_cannot_read_only_skips_the_cross_check(
    fake: Fake, caplog: pytest.LogCaptureFixture
) -> None:
    f, port = fake

    def unknown_mode(resp: admin_pb2.DescribeResponse) -> None:
        resp.models[0].compilation_mode = 9  # a value this sidecar does not know

    f.describe_hook = unknown_mode
    assert await driver.run(config(port)) == 0
    assert "model 'minilm': compilation_mode: got unknown value 9" in caplog.text
    assert "not cross-checked" in caplog.text
    assert f.warmups() == EXPECTED and f.serving


async def test_a_step_it_cannot_read_fails_with_the_reason(
    fake: Fake, caplog: pytest.LogCaptureFixture
) -> None:
    f, port = fake

    def unknown_step(resp: admin_pb2.DescribeResponse) -> None:
        if resp.required_steps:
            resp.required_steps[0].step = 9  # a step this sidecar does not know

    f.describe_hook = unknown_step
    assert await driver.run(config(port)) == 1
    assert "cannot read the steps Describe requires" in caplog.text
    assert "step: got unknown value 9" in caplog.text
    assert f.names() == []


async def test_watch_warms_a_restarted_service_again(caplog: pytest.LogCaptureFixture) -> None:
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


async def test_watch_mode_keeps_a_failed_boot_not_serving_until_it_restarts(
    caplog: pytest.LogCaptureFixture,
) -> None:
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


async def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.02)


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


def test_run_script_starts_both_reports_serving_and_stops_both(tmp_path: Path) -> None:
    """scripts/run.sh with the fake service: plan and progress shown, banner, clean Ctrl-C."""
    fake = f"{sys.executable} {ROOT / 'tests' / 'warmup_fakes.py'}"
    ctl = f"{sys.executable} -m warmup_ctl"
    env = {**os.environ, "RUN_SKIP_SETUP": "1", "RUN_SVC": fake, "RUN_CTL": ctl,
           "WARMUP_CTL_ARGS": "--backoff-initial 0.05 --backoff-max 0.2"}  # fmt: skip
    # Started as from a terminal: SIGINT neither blocked nor ignored. A child inherits both
    # from this test process, and a shell cannot trap a signal it was started ignoring; the
    # script's INT trap never ran in two CI runs of the whole suite (passes alone).
    clean = (
        "import os, signal, sys; signal.pthread_sigmask(signal.SIG_SETMASK, []); "
        "signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp('bash', sys.argv[1:])"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", clean, "bash", str(ROOT / "scripts" / "run.sh"),
         "--compilation-mode", "default"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    # A reader thread, so a script that stops writing fails this test with what it wrote
    # (a blocking readline here would only end at pytest's timeout, with no output).
    eof = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        lines.extend(iter(proc.stdout.readline, ""))  # up to EOF: every writer is gone
        eof.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + 30
        while not any("=== SERVING on 127.0.0.1:" in x for x in lines):
            assert time.monotonic() < deadline and not eof.is_set(), "".join(lines)
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends the script
        assert eof.wait(30), "no EOF 30 s after Ctrl-C:\n" + "".join(lines)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = "".join(lines)
    assert proc.returncode == 130, text
    assert "warmup | " in text and "warmup plan for boot" in text
    assert "step 1/6: COMPILE minilm" in text and "svc    | fake service listening" in text
    assert "inference-cli embed --addr 127.0.0.1:" in text
    assert "svc    | fake service stopping" in text
    # No orphans: nothing is left in the script's process group.
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)
