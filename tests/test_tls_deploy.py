"""TLS deployments: deploy/docker/compose.tls.yml over docker-compose.yml, and the
deploy/k8s-tls kustomize overlay over deploy/k8s. The files name the flags' real environment
variables, mount what they name, and the patched Deployment still validates offline."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from inference_api import names
from inference_svc.config import build_parser
from tests.cmdline import flag
from tests.test_k8s_manifests import K8S_VERSIONS, one
from warmup_ctl import config as sidecar_config

pytestmark = pytest.mark.deploy

ROOT = Path(__file__).resolve().parents[1]
OVERLAY = ROOT / "deploy" / "k8s-tls"
SERVICE_ENV = {"INFERENCE_SVC_TLS_CERT_FILE", "INFERENCE_SVC_TLS_KEY_FILE"}


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def test_the_env_names_are_the_flags_own() -> None:
    helptext = build_parser().format_help()
    for env in SERVICE_ENV:
        assert env in helptext
    assert sidecar_config.ENV_PUBLIC_TLS_CA == "WARMUP_CTL_PUBLIC_TLS_CA"


# --- compose ---------------------------------------------------------------------------------


def test_compose_override_serves_tls_and_every_checker_trusts_the_ca() -> None:
    base = load(ROOT / "docker-compose.yml")["services"]
    tls = load(ROOT / "deploy" / "docker" / "compose.tls.yml")
    over = tls["services"]
    server_env = over["server"]["environment"]
    assert set(server_env) == SERVICE_ENV
    check = over["inference"]["healthcheck"]["test"]
    assert (
        check[: len(base["inference"]["healthcheck"]["test"])]
        == (base["inference"]["healthcheck"]["test"])
    )
    used = {
        "inference": flag(check, "--tls-ca"),
        "warmup-ctl": over["warmup-ctl"]["environment"]["WARMUP_CTL_PUBLIC_TLS_CA"],
        "client": over["client"]["environment"]["INFERENCE_TLS_CA"],
        "server": server_env["INFERENCE_SVC_TLS_CERT_FILE"],
    }
    for service, path in used.items():
        secret = path.removeprefix("/run/secrets/")
        assert secret in over[service]["secrets"], service
        assert secret in tls["secrets"]
    assert "tls_key" in over["server"]["secrets"]


@pytest.mark.skipif(not shutil.which("docker-compose"), reason="docker-compose not installed")
def test_compose_accepts_the_override_with_dev_certificates(tmp_path: Path) -> None:
    subprocess.run(
        ["bash", "deploy/tls/make-dev-certs.sh", str(tmp_path)], cwd=ROOT, check=True,
        capture_output=True, timeout=60,
    )  # fmt: skip
    files = ["-f", "docker-compose.yml", "-f", "deploy/docker/compose.tls.yml"]
    result = subprocess.run(
        ["docker-compose", *files, "config"], cwd=ROOT, capture_output=True, text=True,
        timeout=60, env={"PATH": "/usr/bin:/bin", "TLS_DIR": str(tmp_path)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    merged = yaml.safe_load(result.stdout)["services"]
    secrets = merged["server"]["secrets"]
    server_secrets = {s["source"] if isinstance(s, dict) else s for s in secrets}
    assert {"admin_token", "tls_cert", "tls_key"} <= server_secrets  # merged, not replaced


# --- Kubernetes ------------------------------------------------------------------------------


def merge(base: Any, patch: Any) -> Any:
    """Strategic merge as kubectl applies it to these fields: maps merge, null deletes, lists
    of named objects (containers, env, volumes) and of mounts merge by key; others replace."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = merge(base[key], value) if key in base else value
        return out
    if isinstance(base, list) and isinstance(patch, list) and patch and isinstance(patch[0], dict):
        key = "name" if "name" in patch[0] else "mountPath"
        merged = {item[key]: item for item in base}
        for item in patch:
            merged[item[key]] = merge(merged[item[key]], item) if item[key] in merged else item
        patched = [merged[item[key]] for item in patch if item[key] not in {b[key] for b in base}]
        return patched + [merged[item[key]] for item in base]
    return patch


def tls_deployment() -> dict[str, Any]:
    kustomization = load(OVERLAY / "kustomization.yaml")
    assert kustomization["resources"] == ["../k8s"]
    (patch,) = kustomization["patches"]
    return merge(one("Deployment"), load(OVERLAY / patch["path"]))


def containers(deployment: dict[str, Any]) -> dict[str, dict[str, Any]]:
    spec = deployment["spec"]["template"]["spec"]
    return {c["name"]: c for c in spec["containers"] + spec["initContainers"]}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_tls_overlay_validates_offline(version: str) -> None:
    kubernetes_validate.validate(tls_deployment(), version, strict=True)


def test_tls_overlay_probes_speak_tls_and_ask_the_same_names() -> None:
    base, tls = containers(one("Deployment")), containers(tls_deployment())
    svc = tls["inference"]
    mounts = {m["name"]: m["mountPath"] for m in svc["volumeMounts"]}
    env = {e["name"]: e.get("value") for e in svc["env"]}
    for name in SERVICE_ENV:
        assert env[name].startswith(mounts["tls"] + "/")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "grpc" not in svc[probe]  # the kubelet's grpc probe cannot speak TLS
        cmd = svc[probe]["exec"]["command"]
        assert cmd[:2] == ["inference-cli", "health"]
        assert flag(cmd, "--addr") == f"127.0.0.1:{names.DEFAULT_PORT}"
        assert flag(cmd, "--service") == base["inference"][probe]["grpc"]["service"]
        assert flag(cmd, "--tls-ca").startswith(mounts["tls"] + "/")
        assert float(flag(cmd, "--timeout")) < svc[probe]["timeoutSeconds"]
    assert (
        svc["startupProbe"]["failureThreshold"]
        == base["inference"]["startupProbe"]["failureThreshold"]
    )
    sidecar = tls["warmup-ctl"]
    ca = {e["name"]: e["value"] for e in sidecar["env"]}["WARMUP_CTL_PUBLIC_TLS_CA"]
    assert ca.startswith({m["name"]: m["mountPath"] for m in sidecar["volumeMounts"]}["tls"])
    assert {m["name"] for m in sidecar["volumeMounts"]} == {"tls", "admin-token"}
    volumes = {v["name"]: v for v in tls_deployment()["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "inference-svc-tls"
    assert {"admin-token", "compile-cache", "tmp"} <= set(volumes)


@pytest.mark.skipif(not shutil.which("kubectl"), reason="kubectl not installed")
def test_kubectl_kustomize_builds_the_same_deployment() -> None:
    result = subprocess.run(
        ["kubectl", "kustomize", str(OVERLAY)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    (built,) = [d for d in yaml.safe_load_all(result.stdout) if d["kind"] == "Deployment"]
    ours, theirs = containers(tls_deployment()), containers(built)
    for name in ours:
        for field in ("env", "volumeMounts"):
            key = "name" if field == "env" else "mountPath"
            assert sorted(ours[name][field], key=lambda x: x[key]) == sorted(
                theirs[name][field], key=lambda x: x[key]
            )
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert ours[name].get(probe) == theirs[name].get(probe)
