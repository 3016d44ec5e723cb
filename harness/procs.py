"""The service and the warmup sidecar as real processes, for tests and benchmarks alike.

`inference-svc` starts on port 0 with --port-file (so parallel runs never collide), its output
in a log file; `warmup-ctl` likewise. Every child stops with SIGTERM, then SIGKILL.

    with running_service(["--lm-model", "none"], log_dir) as svc:   # warmed by --once
        stub = InferenceStub(grpc.insecure_channel(svc.target))

    svc = ServiceProc(log_dir, args)          # listening, not yet SERVING
    ctl = sidecar(log_dir, svc)               # the sidecar watching it
    wait_serving(svc, timeout=120, ctl=ctl)   # seconds from start to SERVING
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
HEALTH_NAME = "inference.v1.Inference"
SERVING = health_pb2.HealthCheckResponse.SERVING
POLL_S = 0.2  # between health checks


class ProcError(AssertionError):
    """A child exited, or did not get where it should, in time (an AssertionError, so pytest
    shows it as a failed expectation; a benchmark reports it like any other error)."""


def free_port() -> int:
    """A port nothing listens on now (for tests that need fixed ports across restarts)."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` different ports nothing listens on now (all held open together while chosen, so
    no two are the same; free_port called twice may return one port twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Proc:
    """A child process with its output in a log file; stopped with SIGTERM, then SIGKILL.

    ``own_session``: the child gets its own session, so a Ctrl-C reaches only the caller,
    which then stops its children in order.
    """

    def __init__(
        self,
        argv: Sequence[str],
        log: Path,
        env: dict[str, str] | None = None,
        own_session: bool = False,
    ) -> None:
        self.log = log
        self.started = time.monotonic()
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        log.parent.mkdir(parents=True, exist_ok=True)
        self._out = log.open("w")
        self.popen = subprocess.Popen(
            list(argv), stdout=self._out, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT,
            start_new_session=own_session,
        )  # fmt: skip

    @property
    def pid(self) -> int:
        return self.popen.pid

    def exited(self) -> int | None:
        """The exit status, or None while it runs."""
        return self.popen.poll()

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.text().splitlines()[-n:])

    def wait_for_log(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.text())
            if found:
                return found
            if self.exited() is not None:
                raise ProcError(f"{self.log.name} exited {self.exited()}:\n{self.tail()}")
            time.sleep(POLL_S)
        raise ProcError(f"no {pattern!r} in {self.log.name} after {timeout} s:\n{self.tail()}")

    def wait(self, timeout: float) -> int:
        """Its exit status once it exits by itself; ProcError after ``timeout`` seconds."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            msg = f"{self.log.name} still running after {timeout} s:\n{self.tail()}"
            raise ProcError(msg) from None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._out.close()
        return self.popen.returncode


class ServiceProc(Proc):
    """``inference-svc ARGS`` on port 0 (ARGS may name fixed ports: later flags win),
    started and listening; its log is ``log_dir/NAME.log``.

    ``program`` replaces the ``inference-svc`` command (e.g. a wrapper that runs its main).
    ``host``: the address it was told to listen on (``--host`` among ARGS), for ``target``.
    """

    def __init__(
        self,
        log_dir: Path,
        args: Sequence[str],
        name: str = "svc",
        program: Sequence[str] | None = None,
        env: dict[str, str] | None = None,
        own_session: bool = False,
        listen_timeout: float = 300,
        host: str = "127.0.0.1",
    ) -> None:
        self.host = host
        self.port_file = log_dir / f"{name}.ports.json"
        self.port_file.unlink(missing_ok=True)
        argv = [*(program or [str(BIN / "inference-svc")]), "--port", "0", "--admin-port", "0",
                "--port-file", str(self.port_file), *args]  # fmt: skip
        super().__init__(argv, log_dir / f"{name}.log", env, own_session)
        try:
            ports = self.wait_ports(listen_timeout)
        except BaseException:
            self.stop()
            raise
        self.port, self.admin_port = int(ports["port"]), int(ports["admin_port"])
        self.metrics_port: int | None = ports.get("metrics_port")
        self.boot_id: str = ports.get("boot_id", "")
        self.warm_s: float | None = None  # start to SERVING, once known (running_service)

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def admin_target(self) -> str:
        return f"127.0.0.1:{self.admin_port}"

    def wait_ports(self, timeout: float = 300) -> dict:
        """What the service wrote to its --port-file (port, admin_port, metrics_port, boot_id)."""
        deadline = time.monotonic() + timeout
        while not self.port_file.exists():
            if self.exited() is not None or time.monotonic() > deadline:
                raise ProcError(f"service did not listen:\n{self.tail()}")
            time.sleep(0.1)
        return json.loads(self.port_file.read_text())

    def log_times(self, pattern: str) -> list[datetime]:
        """Timestamps of the log lines matching ``pattern``."""
        stamps = []
        for line in self.text().splitlines():
            if re.search(pattern, line):
                stamps.append(datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f"))
        return stamps


def health_status(port: int, name: str = HEALTH_NAME, host: str = "127.0.0.1") -> int | None:
    """grpc.health.v1 status of ``name`` on ``host:port``, or None when nothing answers."""
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        try:
            req = health_pb2.HealthCheckRequest(service=name)
            return health_pb2_grpc.HealthStub(channel).Check(req, timeout=5).status
        except grpc.RpcError:
            return None


def wait_serving(svc: ServiceProc, timeout: float, ctl: Proc | None = None) -> float:
    """Seconds from the service's start until its health says SERVING; ProcError when it
    exits first, when ``ctl`` (a sidecar) exits non-zero first, or after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if health_status(svc.port, host=svc.host) == SERVING:
            return time.monotonic() - svc.started
        if svc.exited() is not None:
            raise ProcError(f"service exited {svc.exited()}:\n{svc.tail()}")
        if ctl is not None and ctl.exited() not in (None, 0):
            raise ProcError(f"warmup-ctl exited {ctl.exited()}:\n{ctl.tail()}")
        time.sleep(POLL_S)
    raise ProcError(f"not SERVING after {timeout} s:\n{svc.tail()}")


def sidecar(
    log_dir: Path,
    svc: ServiceProc,
    *extra: str,
    name: str = "ctl",
    env: dict[str, str] | None = None,
    own_session: bool = False,
) -> Proc:
    """``warmup-ctl`` for ``svc`` (``--once`` among ``extra`` warms it once and exits)."""
    argv = [
        str(BIN / "warmup-ctl"),
        "--admin", svc.admin_target,
        "--public", svc.target,
        "--poll-interval", "0.5",
        *extra,
    ]  # fmt: skip
    return Proc(argv, log_dir / f"{name}.log", env, own_session)


@contextmanager
def running_service(
    args: Sequence[str], log_dir: Path, timeout: float = 1800, name: str = "svc"
) -> Iterator[ServiceProc]:
    """``inference-svc ARGS`` warmed to SERVING by ``warmup-ctl --once``; stopped after."""
    svc = ServiceProc(log_dir, args, name=name)
    try:
        ctl = sidecar(log_dir, svc, "--once", name=f"{name}-ctl")
        try:
            status = ctl.wait(timeout)
        finally:
            ctl.stop()
        if status != 0:
            raise ProcError(f"warmup-ctl --once exited {status}:\n{ctl.tail()}\n{svc.tail()}")
        svc.warm_s = wait_serving(svc, timeout=60)
        yield svc
    finally:
        svc.stop()
