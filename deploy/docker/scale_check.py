"""The compose profile `scale` under load, checked from the host (deploy/docker/scale-e2e.sh
runs it once the containers are up; run with the test venv: PYTHONPATH=. .venv/bin/python).

1. waits for the three replicas' healthchecks (no server restarted on the way: they convert
   the model into one cache volume at once), then for Envoy's slow start window to pass;
2. 32 closed-loop clients (harness/load.py: Embed, Generate, GenerateStream) through Envoy's
   published port; each replica's share of the calls, read from its own /metrics (through
   `docker exec`, the ports are not published), within 0.75-1.33 of the mean;
3. SIGKILL to one replica's service process while streams are open on it: no Embed fails,
   the streams it cut end UNAVAILABLE (inference_api/resets.py) within 1 s;
4. compose restarts the killed server, its sidecar warms it, Envoy sends it calls again.

    python deploy/docker/scale_check.py --envoy 127.0.0.1:8080 --project inference-svc-scale
Exit 0 and "scale: PASS" when every check held.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections import Counter

import grpc

from harness.load import Load
from harness.replicas import rpc_counts
from inference_api.resets import CUT_DETAILS

REPLICAS = ("scale-1", "scale-2", "scale-3")
SHARE = (0.75, 1.33)
SLOW_START_S = 60  # deploy/envoy/envoy.yaml's slow_start_window


def log(msg: str) -> None:
    print(f"scale: {msg}", file=sys.stderr, flush=True)


class Compose:
    def __init__(self, project: str) -> None:
        self.project = project
        self._cids: dict[str, str] = {}

    def cid(self, service: str) -> str:
        """Its container's id, asked once: a restart keeps the container (and its id)."""
        if not self._cids.get(service):
            out = subprocess.run(
                ["docker-compose", "-p", self.project, "-f", "docker-compose.yml", "ps", "-q",
                 service],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            self._cids[service] = out.stdout.strip()
        return self._cids[service]

    def health(self, service: str) -> str:
        cid = self.cid(service)
        if not cid:
            return "absent"
        out = subprocess.run(
            ["docker", "inspect", "--format", "{{.State.Health.Status}}", cid],
            capture_output=True, text=True,
        )  # fmt: skip
        return out.stdout.strip() or "unknown"

    def metrics(self, replica: str) -> str:
        """A replica's /metrics, read inside its namespace (the port is not published)."""
        code = (
            "import urllib.request; print(urllib.request.urlopen("
            "'http://127.0.0.1:9100/metrics', timeout=5).read().decode())"
        )
        out = subprocess.run(
            ["docker", "exec", self.cid(f"{replica}-server"), "python", "-c", code],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        return out.stdout if out.returncode == 0 else ""

    def kill_server(self, replica: str) -> None:
        """SIGKILL to the service process inside the container, as the kernel's OOM killer
        would send it: compose's restart policy brings it back (it leaves a container
        stopped with `docker kill` stopped)."""
        code = (
            "import os, pathlib, signal\n"
            "for p in pathlib.Path('/proc').glob('[0-9]*'):\n"
            "    argv = (p / 'cmdline').read_bytes().split(b'\\0')\n"
            "    if int(p.name) != os.getpid() and any(b'inference-svc' in a for a in argv[:2]):\n"
            "        os.kill(int(p.name), signal.SIGKILL)\n"
        )
        subprocess.run(
            ["docker", "exec", self.cid(f"{replica}-server"), "python", "-c", code], check=True
        )

    def restarts(self, service: str) -> int:
        out = subprocess.run(
            ["docker", "inspect", "--format", "{{.RestartCount}}", self.cid(service)],
            capture_output=True, text=True,
        )  # fmt: skip
        return int(out.stdout.strip() or 0)

    def serving(self, replica: str) -> bool:
        """Its server's own word (the namespace's healthcheck runs every 10 s, 3 tries)."""
        return "inference_health_serving 1.0" in self.metrics(replica)

    def calls(self, replica: str) -> int:
        return sum(rpc_counts(self.metrics(replica)).values())

    def in_flight(self, replica: str) -> Counter[str]:
        return rpc_counts(self.metrics(replica), metric="inference_requests_in_flight")


def wait_healthy(c: Compose, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while (states := {r: c.health(r) for r in REPLICAS}) and set(states.values()) != {"healthy"}:
        if time.monotonic() > deadline:
            raise SystemExit(f"scale: FAIL: not healthy in {timeout:.0f} s: {states}")
        time.sleep(2)


def shares(c: Compose, seconds: float) -> tuple[list[int], list[float]]:
    before = [c.calls(r) for r in REPLICAS]
    time.sleep(seconds)
    calls = [c.calls(r) - b for r, b in zip(REPLICAS, before, strict=True)]
    mean = sum(calls) / len(calls)
    return calls, [round(n / mean, 2) if mean else 0.0 for n in calls]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--envoy", required=True, help="Envoy's published gRPC address")
    ap.add_argument("--project", required=True, help="the docker-compose project name")
    ap.add_argument("--timeout", type=float, default=900, help="seconds to wait for healthy")
    args = ap.parse_args()
    c, failures = Compose(args.project), []

    t = time.monotonic()
    wait_healthy(c, args.timeout)
    log(f"3 replicas healthy after {time.monotonic() - t:.0f} s; waiting {SLOW_START_S} s "
        "(Envoy's slow start window)")  # fmt: skip
    crashed = {r: n for r in REPLICAS if (n := c.restarts(f"{r}-server"))}
    if crashed:  # e.g. replicas converting the model into the shared cache at once
        failures.append(f"servers restarted before SERVING: {crashed}")
    load = Load(args.envoy, clients=32)
    load.start()
    time.sleep(SLOW_START_S)

    calls, ratios = shares(c, 10)
    log(f"10 s under 32 clients: calls per replica {calls}, share of the mean {ratios}")
    if not all(SHARE[0] <= r <= SHARE[1] for r in ratios):
        failures.append(f"shares {ratios} outside {SHARE}")

    victim = REPLICAS[1]
    deadline = time.monotonic() + 30
    while c.in_flight(victim)["GenerateStream"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    open_streams = c.in_flight(victim)["GenerateStream"]
    restarts = c.restarts(f"{victim}-server")
    killed_at = time.monotonic()
    c.kill_server(victim)
    dead_at = time.monotonic()  # the process died between killed_at and now
    time.sleep(3)
    cut = [
        x for x in load.since(killed_at - 30, "GenerateStream")
        if x.end is not None and x.end >= killed_at and x.code != grpc.StatusCode.OK
    ]  # fmt: skip
    embed_failed = load.failed(killed_at - 1, "Embed")
    log(f"kill -9 of {victim}'s service with {open_streams} streams open on it: streams cut "
        f"{[(x.code.name, round(x.end - dead_at, 2)) for x in cut]} s after `docker exec` "
        f"returned (it took {dead_at - killed_at:.2f} s), "
        f"Embed failed {len(embed_failed)}")  # fmt: skip
    if embed_failed:
        failures.append(f"{len(embed_failed)} Embed failed: {embed_failed[0].details}")
    if not cut:
        failures.append("no stream cut by the kill")
    bad = [x for x in cut if x.code != grpc.StatusCode.UNAVAILABLE or x.end - dead_at > 1.0]
    bad += [x for x in cut if not x.details.startswith(CUT_DETAILS)]
    if bad:
        failures.append(f"streams cut otherwise: {[(x.code, x.details) for x in bad]}")

    deadline = time.monotonic() + args.timeout
    while not (c.restarts(f"{victim}-server") > restarts and c.serving(victim)):
        if time.monotonic() > deadline:
            raise SystemExit(f"scale: FAIL: {victim}-server not SERVING again")
        time.sleep(0.5)
    back = time.monotonic() - killed_at
    before = c.calls(victim)
    time.sleep(15)
    got = c.calls(victim) - before
    log(f"{victim}-server restarted by compose, warmed by its sidecar: SERVING {back:.0f} s "
        f"after the kill, then {got} calls in 15 s (Envoy's slow start)")  # fmt: skip
    if got == 0:
        failures.append(f"{victim} got no call after its restart")
    load.stop()
    for f in failures:
        log(f"FAIL: {f}")
    log("PASS" if not failures else "FAIL")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
