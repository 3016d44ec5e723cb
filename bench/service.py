"""The service as the benchmarks run it: inference-svc as its own process, warmed by
`warmup-ctl --once`, stopped on exit. Shared by the benchmarks in bench/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Running:
    port: int
    admin_port: int
    metrics_port: int | None
    pid: int
    log: Path
    warm_s: float  # from start to SERVING

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


@contextmanager
def running_service(args: list[str], tmp: Path, timeout: float = 1800) -> Iterator[Running]:
    """Start ``inference-svc ARGS`` on free ports, warm it to SERVING, stop it after."""
    port_file, log_path = tmp / "ports.json", tmp / "svc.log"
    port_file.unlink(missing_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    argv = [str(BIN / "inference-svc"), "--port", "0", "--admin-port", "0",
            "--port-file", str(port_file), *args]  # fmt: skip
    start = time.perf_counter()
    with log_path.open("w") as log:
        svc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while not port_file.exists():
                if svc.poll() is not None:
                    raise RuntimeError(f"inference-svc exited: see {log_path}")
                time.sleep(0.1)
            ports = json.loads(port_file.read_text())
            admin, public = f"127.0.0.1:{ports['admin_port']}", f"127.0.0.1:{ports['port']}"
            ctl = [str(BIN / "warmup-ctl"), "--once", "--admin", admin, "--public", public]
            subprocess.run(ctl, check=True, env=env, capture_output=True, timeout=timeout)
            yield Running(
                ports["port"],
                ports["admin_port"],
                ports.get("metrics_port"),
                svc.pid,
                log_path,
                time.perf_counter() - start,
            )
        finally:
            svc.terminate()
            try:
                svc.wait(30)
            except subprocess.TimeoutExpired:
                svc.kill()
                svc.wait()


def save_plot(plot: Callable[[dict, Path], None], results: dict, path: Path) -> None:
    """``plot(results, path)``, or a note when matplotlib is missing."""
    try:
        plot(results, path)
        print(f"\nwrote {path} and {path.with_suffix('.json').name}")
    except ImportError:
        print("\nmatplotlib not installed (pip install '.[bench]'): no plot")
