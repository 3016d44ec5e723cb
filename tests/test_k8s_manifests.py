"""deploy/k8s/: every manifest validates offline against the Kubernetes schemas, and
the probes, ports and volumes agree with what the service and the image use."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from inference_api import names
from inference_svc.config import build_parser
from tests.cmdline import flag

pytestmark = pytest.mark.deploy

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
# Native sidecars (init containers with restartPolicy: Always) are on by default
# from 1.29 and GA in 1.33; validate against both and the newest schema bundled.
K8S_VERSIONS = ("1.29.0", "1.33.0", kubernetes_validate.latest_version())
NOT_KUBERNETES = {"kustomization.yaml"}  # kustomize's own file, not an API object


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name not in NOT_KUBERNETES)


def load_all() -> list[dict[str, Any]]:
    docs = []
    for path in manifest_files():
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def one(kind: str) -> dict[str, Any]:
    found = [d for d in load_all() if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def services() -> list[dict[str, Any]]:
    return [d for d in load_all() if d["kind"] == "Service"]


def pod_spec() -> dict[str, Any]:
    return one("Deployment")["spec"]["template"]["spec"]


def container(name: str) -> dict[str, Any]:
    spec = pod_spec()
    for c in spec.get("containers", []) + spec.get("initContainers", []):
        if c["name"] == name:
            return c
    raise AssertionError(f"no container {name!r}")


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_manifest_validates_offline(path: Path, version: str) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs, f"{path} is empty"
    for doc in docs:
        # strict: unknown fields (typos) fail too. Raises ValidationError on failure.
        kubernetes_validate.validate(doc, version, strict=True)


def test_validator_rejects_a_broken_manifest() -> None:
    """The check above is not vacuous: a misspelt probe field fails it."""
    doc = one("Deployment")
    doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["servce"] = "x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSIONS[0], strict=True)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == [p.name for p in manifest_files()]


def test_probes_ask_the_names_the_service_registers() -> None:
    svc = container("inference")
    for probe in ("startupProbe", "readinessProbe"):
        assert svc[probe]["grpc"] == {"port": names.DEFAULT_PORT, "service": names.HEALTH_INFERENCE}
    assert svc["livenessProbe"]["grpc"] == {
        "port": names.DEFAULT_PORT,
        "service": names.HEALTH_LIVENESS,
    }
    assert names.HEALTH_INFERENCE in names.GATED_HEALTH_NAMES
    assert names.HEALTH_LIVENESS not in names.GATED_HEALTH_NAMES
    # A cold compile must fit in the startup probe's budget (minutes per graph on 2 cores).
    startup = svc["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 30 * 60


def test_warmup_ctl_is_a_native_sidecar_on_the_admin_port() -> None:
    spec = pod_spec()
    sidecar = container("warmup-ctl")
    assert sidecar in spec["initContainers"]
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["command"][0] == "warmup-ctl"
    svc_args = container("inference")["command"]
    assert svc_args[0] == "inference-svc"
    admin = f"{flag(svc_args, '--admin-host')}:{flag(svc_args, '--admin-port')}"
    assert admin == f"{names.DEFAULT_ADMIN_HOST}:{names.DEFAULT_ADMIN_PORT}"
    assert flag(sidecar["command"], "--admin") == admin
    assert flag(sidecar["command"], "--public") == f"127.0.0.1:{names.DEFAULT_PORT}"
    assert int(flag(svc_args, "--port")) == names.DEFAULT_PORT


def test_admin_port_is_not_exposed() -> None:
    for c in pod_spec()["containers"] + pod_spec()["initContainers"]:
        ports = {p["containerPort"] for p in c.get("ports", [])}
        assert names.DEFAULT_ADMIN_PORT not in ports
    assert container("inference")["ports"] == [
        {"name": "grpc", "containerPort": names.DEFAULT_PORT, "protocol": "TCP"},
        {"name": "metrics", "containerPort": names.DEFAULT_METRICS_PORT, "protocol": "TCP"},
    ]
    for service in services():
        assert [p["port"] for p in service["spec"]["ports"]] == [names.DEFAULT_PORT]


def test_every_container_has_resource_requests() -> None:
    spec = pod_spec()
    for c in spec["containers"] + spec["initContainers"]:
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]), c["name"]


def image_write_dirs() -> dict[str, str]:
    """The Dockerfile's cache directories: the service writes there at run time."""
    found = re.findall(r"^\s*(\w*CACHE_DIR|HF_HOME)=(\S+)", (ROOT / "Dockerfile").read_text(), re.M)
    assert "TORCHINDUCTOR_CACHE_DIR" in dict(found)
    return dict(found)


def test_caches_are_on_volumes_where_the_image_puts_them() -> None:
    """The root file system is read-only: every cache the image names is on a volume."""
    mounts = {m["mountPath"]: m["name"] for m in container("inference")["volumeMounts"]}
    volumes = {v["name"] for v in pod_spec()["volumes"]}
    for env, path in image_write_dirs().items():
        covering = [p for p in mounts if path.startswith(p.rstrip("/") + "/")]
        assert covering, f"{env}={path} is not on a volume: {mounts}"
        assert mounts[covering[0]] in volumes
    assert container("inference")["securityContext"]["readOnlyRootFilesystem"] is True
    assert "/tmp" in mounts


def test_pod_runs_as_the_image_user_and_non_root() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    user = re.search(r"^USER (\d+):(\d+)$", dockerfile, re.MULTILINE)
    assert user, "the Dockerfile's USER is numeric (runAsNonRoot can check it)"
    security = pod_spec()["securityContext"]
    assert security["runAsNonRoot"] is True
    assert (str(security["runAsUser"]), str(security["runAsGroup"])) == user.groups()


def test_service_and_pdb_select_the_pods() -> None:
    labels = one("Deployment")["spec"]["template"]["metadata"]["labels"]
    for selector in (
        *(service["spec"]["selector"] for service in services()),
        one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
        one("Deployment")["spec"]["selector"]["matchLabels"],
    ):
        assert selector.items() <= labels.items()
    for service in services():
        target = service["spec"]["ports"][0]["targetPort"]
        assert target in {p["name"] for p in container("inference")["ports"]}


def test_metrics_port_is_served_and_announced_for_scraping() -> None:
    svc_args = container("inference")["command"]
    assert int(flag(svc_args, "--metrics-port")) == names.DEFAULT_METRICS_PORT
    notes = one("Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert int(notes["prometheus.io/port"]) == names.DEFAULT_METRICS_PORT
    assert notes["prometheus.io/path"] == "/metrics"


def test_service_and_sidecar_read_the_admin_token_from_the_secret() -> None:
    token = "/var/run/secrets/inference-svc/admin-token"
    sidecar = pod_spec()["initContainers"][0]
    assert flag(container("inference")["command"], "--admin-token-file") == token
    assert flag(sidecar["command"], "--admin-token-file") == token
    for c in (container("inference"), sidecar):
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert mounts["admin-token"]["mountPath"] == token.rsplit("/", 1)[0]
        assert mounts["admin-token"]["readOnly"] is True
    volumes = {v["name"]: v for v in pod_spec()["volumes"]}
    secret = one("Secret")
    assert volumes["admin-token"]["secret"]["secretName"] == secret["metadata"]["name"]
    assert "admin-token" in secret["stringData"]


# --- scale-out: client-side balancing, rollouts, stops (docs/scale-out.md) -------------
# The slowest cold start to SERVING measured on 2 cores, mode default, empty compile cache
# (deploy/README.md: docker-compose up to healthy, 4 min 41 s - 7 min 17 s).
SLOWEST_COLD_START_S = 7 * 60 + 17
# The longest Generate: --max-new-tokens (512) at the slowest measured decode step, the p99
# inter-token latency with streams joining (2.38 x 68 ms, bench/README.md), and its first token.
LONGEST_GENERATE_S = 512 * 2.38 * 0.068 + 2


def seconds_flag(name: str) -> float:
    return float(flag(container("inference")["command"], name))


def prestop_sleep_s() -> float:
    command = container("inference")["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return float(command[1])


def test_a_headless_service_answers_with_every_ready_pod() -> None:
    """Clients that balance per call (round_robin over dns:///) resolve this one."""
    by_name = {s["metadata"]["name"]: s["spec"] for s in services()}
    assert by_name["inference-svc"].get("clusterIP") != "None"
    headless = by_name["inference-svc-headless"]
    assert headless["clusterIP"] == "None"
    assert not headless.get("publishNotReadyAddresses", False)  # warming pods stay out
    assert headless["selector"] == by_name["inference-svc"]["selector"]
    assert headless["ports"] == by_name["inference-svc"]["ports"]


def test_a_stopping_pod_leaves_the_endpoints_then_drains_within_its_grace() -> None:
    """preStop keeps serving while the endpoints catch up; SIGTERM then drains calls for
    --grace-period; the kubelet's deadline covers both, and the drain the longest Generate."""
    prestop, drain = prestop_sleep_s(), seconds_flag("--grace-period")
    assert 5 <= prestop <= 30
    assert drain >= LONGEST_GENERATE_S
    grace = pod_spec()["terminationGracePeriodSeconds"]
    assert grace >= prestop + drain + 10, (grace, prestop, drain)


def test_the_service_command_is_made_of_its_own_flags() -> None:
    """A misspelt flag (--max-conection-age) would stop the container at start."""
    parsed = build_parser({}).parse_args(container("inference")["command"][1:])
    assert parsed.max_connection_age == seconds_flag("--max-connection-age")
    assert parsed.grace_period == seconds_flag("--grace-period")


def test_connections_age_out_and_open_streams_outlive_the_age() -> None:
    age, age_grace = (
        seconds_flag("--max-connection-age"),
        seconds_flag("--max-connection-age-grace"),
    )
    assert 30 <= age <= 900  # clients move at least every 15 min, not at every call
    assert age_grace >= seconds_flag("--grace-period") >= LONGEST_GENERATE_S


def test_a_rollout_waits_for_each_new_pod_to_warm() -> None:
    spec = one("Deployment")["spec"]
    startup = container("inference")["startupProbe"]
    window = (
        startup.get("initialDelaySeconds", 0)
        + startup["periodSeconds"] * startup["failureThreshold"]
    )
    assert window >= 4 * SLOWEST_COLD_START_S, window
    assert spec["progressDeadlineSeconds"] > window + 5 * 60  # + scheduling and image pull
    rolling = spec["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 0  # the old pod serves until the new one is Ready
    surge = rolling["maxSurge"]
    replicas = spec["replicas"]
    if isinstance(surge, str):  # a percentage, rounded up
        surge = -(-replicas * int(surge.rstrip("%")) // 100)
    assert replicas >= 2 and 1 <= surge <= replicas
