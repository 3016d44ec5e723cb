"""deploy/k8s-precompile: a Job fills a shared compile cache with the service's own flags and
thread count; the Deployment reads it read-only where the service looks for kept artifacts."""

from __future__ import annotations

import operator
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.cmdline import flag
from tests.test_k8s_manifests import K8S_VERSIONS, one
from tests.test_tls_deploy import containers, merge

pytestmark = pytest.mark.deploy

ROOT = Path(__file__).resolve().parents[1]
OVERLAY = ROOT / "deploy" / "k8s-precompile"


def load(name: str) -> Any:
    return yaml.safe_load((OVERLAY / name).read_text())


def deployment() -> dict[str, Any]:
    kustomization = load("kustomization.yaml")
    (patch,) = kustomization["patches"]
    return merge(one("Deployment"), load(patch["path"]))


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_overlay_objects_validate_offline(version: str) -> None:
    assert load("kustomization.yaml")["resources"][0] == "../k8s"
    for doc in (deployment(), load("precompile-job.yaml"), load("compile-cache-pvc.yaml")):
        kubernetes_validate.validate(doc, version, strict=True)


def given(args: list[str], name: str) -> str | None:
    """A flag's value in a command line, or None when it is left at its default."""
    try:
        return flag(args, name)
    except AssertionError:
        return None


def test_job_compiles_what_the_service_loads() -> None:
    job = load("precompile-job.yaml")["spec"]["template"]["spec"]
    (pre,) = job["containers"]
    svc = containers(deployment())["inference"]
    assert pre["command"][:2] == ["inference-svc", "precompile"]
    # The key: the same compilation mode and the same thread count (OMP from the CPU request).
    for key_flag in ("--compilation-mode", "--compile-backend", "--freeze-weights"):
        assert given(pre["command"], key_flag) == given(svc["command"], key_flag), key_flag
    # Neither names a backend: both run the image's (INFERENCE_SVC_COMPILE_BACKEND=aoti),
    # as compose's server does.
    assert given(svc["command"], "--compile-backend") is None
    assert "INFERENCE_SVC_COMPILE_BACKEND=aoti" in (ROOT / "Dockerfile").read_text()
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert not any("--compile-backend" in arg for arg in compose["services"]["server"]["command"])
    assert pre["resources"]["requests"]["cpu"] == svc["resources"]["requests"]["cpu"]
    threads = {e["name"]: e for e in pre["env"]}["OMP_NUM_THREADS"]
    assert threads == {e["name"]: e for e in svc["env"]}["OMP_NUM_THREADS"]
    # The same user: inductor's C++ kernels are keyed on a per-user header directory.
    pod = deployment()["spec"]["template"]["spec"]
    assert job["securityContext"]["runAsUser"] == pod["securityContext"]["runAsUser"]
    # Where the Job writes is where the service looks, on the same claim.
    cache = flag(pre["command"], "--compile-cache-dir")
    pre_mounts = {m["mountPath"]: m["name"] for m in pre["volumeMounts"]}
    svc_mounts = {m["mountPath"]: m for m in svc["volumeMounts"]}
    assert svc_mounts[cache]["readOnly"] is True
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for spec in (job, deployment()["spec"]["template"]["spec"])
        for v in spec["volumes"]
        if "persistentVolumeClaim" in v
    }
    pvc = load("compile-cache-pvc.yaml")
    assert claims[pre_mounts[cache]] == claims[svc_mounts[cache]["name"]] == pvc["metadata"]["name"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    # The image's default cache directory is this one (env in the Dockerfile).
    assert f"INFERENCE_SVC_COMPILE_CACHE_DIR={cache}" in (ROOT / "Dockerfile").read_text()


@pytest.mark.skipif(not shutil.which("kubectl"), reason="kubectl not installed")
def test_kubectl_kustomize_builds_the_overlay() -> None:
    result = subprocess.run(
        ["kubectl", "kustomize", str(OVERLAY)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    built = {d["kind"]: d for d in yaml.safe_load_all(result.stdout)}
    assert {"Job", "PersistentVolumeClaim", "Deployment"} <= set(built)
    theirs = containers(built["Deployment"])["inference"]["volumeMounts"]
    ours = containers(deployment())["inference"]["volumeMounts"]
    path = operator.itemgetter("mountPath")
    assert sorted(theirs, key=path) == sorted(ours, key=path)
