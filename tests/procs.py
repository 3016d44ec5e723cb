"""Real processes for end-to-end tests: the service and the sidecar, logs to files."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child process with its output in a log file; stopped with SIGTERM, then SIGKILL."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        self.started = time.monotonic()
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self._out = log.open("w")
        self.popen = subprocess.Popen(
            argv, stdout=self._out, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT
        )

    def text(self) -> str:
        return self.log.read_text()

    def wait_for_log(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.text())
            if found:
                return found
            if self.popen.poll() is not None:
                raise AssertionError(
                    f"{self.log.name} exited {self.popen.returncode}:\n{self.tail()}"
                )
            time.sleep(0.2)
        where = f"{self.log.name} after {timeout} s"
        raise AssertionError(f"no {pattern!r} in {where}:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.text().splitlines()[-n:])

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
    def __init__(self, tmp: Path, args: list[str], name: str = "svc") -> None:
        self.port_file = tmp / f"{name}.ports.json"
        self.port_file.unlink(missing_ok=True)
        argv = [str(BIN / "inference-svc"), "--port-file", str(self.port_file), *args]
        super().__init__(argv, tmp / f"{name}.log")
        ports = self.wait_ports()
        self.port, self.admin_port = ports["port"], ports["admin_port"]
        self.boot_id = ports["boot_id"]

    def wait_ports(self, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while not self.port_file.exists():
            if self.popen.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"service did not listen:\n{self.tail()}")
            time.sleep(0.1)
        return json.loads(self.port_file.read_text())

    def log_times(self, pattern: str) -> list[datetime]:
        """Timestamps of the log lines matching ``pattern``."""
        stamps = []
        for line in self.text().splitlines():
            if re.search(pattern, line):
                stamps.append(datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f"))
        return stamps


def sidecar(tmp: Path, svc: ServiceProc, *extra: str, name: str = "ctl") -> Proc:
    argv = [
        str(BIN / "warmup-ctl"),
        "--admin", f"127.0.0.1:{svc.admin_port}",
        "--public", f"127.0.0.1:{svc.port}",
        "--poll-interval", "0.5",
        *extra,
    ]  # fmt: skip
    return Proc(argv, tmp / f"{name}.log")
