"""Faults with the sidecar watching (real processes, tiny models, mode NONE with an automatic
KV cache, so each process runs a PROFILE step): the service SIGKILLed at random moments
(loading, warming, SERVING) and restarted on the same ports, 12 times; the sidecar killed and
restarted too. Health and Describe are watched together the whole time: no process is ever
SERVING before it has run its steps, and each one the sidecar sees is warmed and ends SERVING."""

from __future__ import annotations

import random
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness.procs import ServiceProc, free_ports, sidecar, wait_serving
from inference_api import convert
from inference_api.plan import StepKind
from inference_api.stubs.inference.v1 import admin_pb2 as apb
from inference_api.stubs.inference.v1 import admin_pb2_grpc
from tests.conftest import tiny_args

pytestmark = [pytest.mark.proc, pytest.mark.e2e]
SERVING = health_pb2.HealthCheckResponse.SERVING
KILLS = 12  # 3 aimed at each state, 3 at random moments


class Watcher(threading.Thread):
    """Polls health, then Describe, of whatever process answers; records every violation:
    health SERVING while Describe (same process) says a required step has not run."""

    def __init__(self, port: int, admin_port: int) -> None:
        super().__init__(daemon=True)
        # 12 kills in a row grow a channel's reconnect backoff (up to 2 min by default), and
        # an RPC made during it fails at once with the last "connection refused": keep it short
        opts = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.max_reconnect_backoff_ms", 250)]
        self.health = health_pb2_grpc.HealthStub(
            grpc.insecure_channel(f"127.0.0.1:{port}", options=opts)
        )
        self.admin = admin_pb2_grpc.WarmupAdminStub(
            grpc.insecure_channel(f"127.0.0.1:{admin_port}", options=opts)
        )
        self.stopped = threading.Event()
        self.violations: list[str] = []
        self.serving_boots: set[str] = set()
        self.checks = 0

    def state(self) -> str:
        """What the process at the address is doing now: down, loading, warming, serving."""
        try:
            d = self.admin.Describe(apb.DescribeRequest(), timeout=1)
        except grpc.RpcError:
            return "down"
        return "serving" if d.serving else ("warming" if d.models_loaded else "loading")

    def run(self) -> None:
        request = health_pb2.HealthCheckRequest(service="inference.v1.Inference")
        while not self.stopped.is_set():
            try:
                before = self.admin.Describe(apb.DescribeRequest(), timeout=1)
                status = self.health.Check(request, timeout=1).status
                after = self.admin.Describe(apb.DescribeRequest(), timeout=1)
            except grpc.RpcError:
                time.sleep(0.02)
                continue
            self.checks += 1
            if status != SERVING or before.boot_id != after.boot_id:
                continue  # not serving, or another process answered in between
            self.serving_boots.add(after.boot_id)
            steps = convert.steps_from_pb(after.required_steps)
            undone = [
                f"{s.kind.name} {s.model}"
                for s, pb in zip(steps, after.required_steps, strict=True)
                if s.kind is not StepKind.MARK_SERVING and not pb.done
            ]
            if not after.serving or undone:
                self.violations.append(f"boot {after.boot_id}: SERVING with {undone} not run")


def test_kills_at_random_moments_never_serve_a_cold_process(
    tmp_path: Path, tiny_embed_dir, tiny_lm_dir
) -> None:
    port, admin_port = free_ports(2)
    args = [*tiny_args(tiny_embed_dir, tiny_lm_dir), "--port", str(port)]
    args += ["--admin-port", str(admin_port)]  # the later flags win: fixed ports
    rng = random.Random(20261203)
    svc = ServiceProc(tmp_path, args, name="svc-0")
    fast = ("--poll-interval", "0.2", "--backoff-initial", "0.05", "--backoff-max", "0.5")
    ctl = sidecar(tmp_path, svc, *fast)
    watcher = Watcher(port, admin_port)
    watcher.start()
    hit: Counter[str] = Counter()
    try:
        for k in range(1, KILLS + 1):
            if k % 4 in (0, 1, 2):  # aim: 0 at the warmup, 1 at SERVING, 2 at the loading
                early = {0: ("loading", "down"), 1: ("loading", "down", "warming")}
                deadline = time.monotonic() + 30
                while watcher.state() in early.get(k % 4, ("down",)):
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.005)
            else:
                time.sleep(rng.uniform(0.0, 6.0))  # listening -> SERVING takes ~4 s here
            hit[watcher.state()] += 1
            svc.stop(signal.SIGKILL)
            svc = ServiceProc(tmp_path, args, name=f"svc-{k}")
            if k == KILLS // 2:  # the sidecar too, at a random moment of a warm cycle
                time.sleep(rng.uniform(0.0, 1.5))
                ctl.stop(signal.SIGKILL)
                ctl = sidecar(tmp_path, svc, *fast, name="ctl-restarted")
        wait_serving(svc, timeout=120)
        last = watcher.admin.Describe(apb.DescribeRequest(), timeout=10, wait_for_ready=True)
        assert last.boot_id == svc.boot_id
        time.sleep(0.5)
    finally:
        watcher.stopped.set()
        watcher.join(timeout=10)
        svc.stop()
        ctl.stop()
    print(f"kills by state: {dict(hit)}; {watcher.checks} health+Describe checks")
    assert not watcher.violations, watcher.violations[:5]
    assert hit["serving"] and hit["loading"] and hit["warming"], hit
    assert svc.boot_id in watcher.serving_boots
    assert "Traceback" not in ctl.text(), ctl.tail()
