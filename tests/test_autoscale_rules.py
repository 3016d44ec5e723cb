"""deploy/k8s-autoscale/: the recording rules pass promtool's own checks and unit tests (the
replica counts they ask for under rising and falling load), the KEDA ScaledObject and the HPA
with prometheus-adapter ask for the same counts on the same recorded series, and the objects
validate offline and agree with the rules and the base Deployment."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.test_k8s_manifests import K8S_VERSIONS, one

pytestmark = pytest.mark.deploy

ROOT = Path(__file__).resolve().parents[1]
AUTOSCALE = ROOT / "deploy" / "k8s-autoscale"
RULES = AUTOSCALE / "rules.yml"
RULE_TESTS = AUTOSCALE / "rules.test.yml"
# The slowest cold warmup measured to SERVING (compile mode default, empty compile cache, 2
# cores: 7 min 17 s, deploy/README.md). Scaling down must wait longer than bringing a pod back.
SLOWEST_WARMUP_S = 7 * 60 + 17


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def find_promtool() -> str | None:
    beside = Path(sys.executable).parent / "promtool"  # where scripts/setup.sh test puts it
    return str(beside) if beside.is_file() else shutil.which("promtool")


@pytest.fixture(scope="module")
def promtool() -> str:
    found = find_promtool()
    if found is None:
        pytest.skip(
            "promtool not found beside the venv's python nor on PATH: `scripts/setup.sh test` "
            "copies it there from Debian's prometheus package where apt-get reaches a mirror"
        )
    return found


def run_promtool(promtool: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


# --- the recording rules, under promtool ------------------------------------------------------


def test_rules_pass_promtool_check(promtool: str) -> None:
    result = run_promtool(promtool, "check", "rules", RULES.name, cwd=AUTOSCALE)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rule_exprs())} rules found" in result.stdout


def test_rule_unit_tests_pass(promtool: str) -> None:
    """2 -> 5 replicas as the queue rises (three pods warming are no capacity), back to 2 only
    after the 15 minute window; 3 for a slow p95 time to first token; a vanished replica."""
    result = run_promtool(promtool, "test", "rules", RULE_TESTS.name, cwd=AUTOSCALE)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def mutated_rules(tmp_path: Path, old: str, new: str) -> Path:
    text = RULES.read_text()
    assert old in text
    (tmp_path / RULES.name).write_text(text.replace(old, new))
    (tmp_path / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    return tmp_path


@pytest.mark.parametrize(
    ("old", "new", "caught"),
    [
        # Warming pods counted as capacity: 20 queued over 5 pods reads 4 per replica, not 10.
        (
            "sum by (namespace) (inference_health_serving)",
            "count by (namespace) (inference_health_serving)",
            'expr: "inference:queue_depth_per_replica", time: 14m',
        ),
        # The warming pod's slow first tokens counted: p95 1 s, 4 replicas instead of 3.
        (
            "and on (namespace, pod) (inference_health_serving == 1)",
            "and on (namespace, pod) inference_health_serving",
            'expr: "inference:ttft_p95_seconds", time: 20m',
        ),
        # No scale-down stabilization: 5 drops to 2 as soon as the queue empties.
        ("[15m]", "[30s]", 'expr: "inference:desired_replicas", time: 35m'),
    ],
    ids=["warming-as-capacity", "warming-ttft", "no-stabilization"],
)
def test_rule_unit_tests_catch_a_wrong_rule(
    promtool: str, tmp_path: Path, old: str, new: str, caught: str
) -> None:
    result = run_promtool(
        promtool, "test", "rules", RULE_TESTS.name, cwd=mutated_rules(tmp_path, old, new)
    )
    assert result.returncode != 0
    assert caught in result.stderr, result.stderr  # promtool reports failures on stderr


# --- what the rules and the objects say -------------------------------------------------------


def rule_exprs() -> dict[tuple[str, str], str]:
    """(record, trigger label or "") -> expr."""
    (group,) = load(RULES)["groups"]
    return {
        (r["record"], r.get("labels", {}).get("trigger", "")): r["expr"] for r in group["rules"]
    }


def rule_targets() -> dict[str, float]:
    exprs = rule_exprs()
    trigger = "inference:desired_replicas:trigger"
    queue = re.fullmatch(r"ceil\(inference:queue_depth:sum / ([\d.]+)\)", exprs[trigger, "queue"])
    ttft = re.fullmatch(
        r"ceil\(inference:ttft_p95_replica_seconds / ([\d.]+)\)", exprs[trigger, "ttft"]
    )
    bounds = re.search(r", (\d+), (\d+)\)$", exprs["inference:desired_replicas:raw", ""])
    window = re.fullmatch(
        r"max_over_time\(inference:desired_replicas:raw\[(\d+)m\]\)",
        exprs["inference:desired_replicas", ""],
    )
    assert queue and ttft and bounds and window, exprs
    return {
        "queue": float(queue[1]),
        "ttft": float(ttft[1]),
        "min": int(bounds[1]),
        "max": int(bounds[2]),
        "window_s": int(window[1]) * 60,
    }


def quantity(value: str | int) -> float:
    """A Kubernetes quantity as HPA targets write them: 4, "4", "500m"."""
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def kustomization(path: Path) -> dict[str, Any]:
    return load(path / "kustomization.yaml")


def scaled_object() -> dict[str, Any]:
    return load(AUTOSCALE / "scaledobject.yaml")


def hpa() -> dict[str, Any]:
    return load(AUTOSCALE / "hpa" / "hpa.yaml")


def adapter_rules() -> dict[str, dict[str, Any]]:
    config = yaml.safe_load(load(AUTOSCALE / "prometheus-adapter.yaml")["data"]["config.yaml"])
    return {rule["name"]["as"]: rule for rule in config["externalRules"]}


def namespace() -> str:
    ns = kustomization(AUTOSCALE)["namespace"]
    assert kustomization(AUTOSCALE / "hpa")["namespace"] == ns
    return ns


def keda_metrics() -> list[tuple[str, float]]:
    """(PromQL, per-replica target) of each trigger, as KEDA hands them to its HPA."""
    out = []
    for trigger in scaled_object()["spec"]["triggers"]:
        assert trigger["type"] == "prometheus"
        assert trigger.get("metricType", "AverageValue") == "AverageValue"
        out.append((trigger["metadata"]["query"], float(trigger["metadata"]["threshold"])))
    return out


def hpa_metrics() -> list[tuple[str, float]]:
    """(PromQL prometheus-adapter runs for the HPA's namespace, averageValue) per metric."""
    rules, out = adapter_rules(), []
    for metric in hpa()["spec"]["metrics"]:
        assert metric["type"] == "External"
        target = metric["external"]["target"]
        assert target["type"] == "AverageValue"
        rule = rules[metric["external"]["metric"]["name"]]
        series = re.fullmatch(r"\^(.+)\$", rule["name"]["matches"])[1]  # type: ignore[index]
        query = (
            rule["metricsQuery"]
            .replace("<<.Series>>", series)
            .replace("<<.LabelMatchers>>", f'namespace="{namespace()}"')
            .replace("<<.GroupBy>>", "namespace")
        )
        out.append((query, quantity(target["averageValue"])))
    return out


def test_scalers_use_the_rules_targets_bounds_and_window() -> None:
    targets = rule_targets()
    assert [t for _, t in keda_metrics()] == [targets["queue"], targets["ttft"]]
    assert [t for _, t in hpa_metrics()] == [targets["queue"], targets["ttft"]]
    so, h = scaled_object()["spec"], hpa()["spec"]
    assert (so["minReplicaCount"], so["maxReplicaCount"]) == (targets["min"], targets["max"])
    assert (h["minReplicas"], h["maxReplicas"]) == (targets["min"], targets["max"])
    keda_behavior = so["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert keda_behavior == h["behavior"]
    assert h["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == targets["window_s"]


def test_scale_down_waits_longer_than_a_warmup_and_two_replicas_stay() -> None:
    window = hpa()["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"]
    assert SLOWEST_WARMUP_S < window <= 3600  # 3600: the most the HPA accepts
    assert rule_targets()["min"] >= 2
    assert hpa()["spec"]["behavior"]["scaleUp"]["stabilizationWindowSeconds"] == 0


def scaler_test_file(tmp_path: Path, metrics: list[tuple[str, float]]) -> Path:
    """rules.test.yml's series, with the HPA's arithmetic on these metrics' queries in place of
    each expectation on inference:desired_replicas:raw: max of ceil(value / target), clamped."""
    targets = rule_targets()
    proposals = " or ".join(
        f'label_replace(ceil(({query}) / {target}), "metric", "{i}", "", "")'
        for i, (query, target) in enumerate(metrics)
    )
    hpa_expr = f"clamp(max by (namespace) ({proposals}), {targets['min']}, {targets['max']})"
    spec = load(RULE_TESTS)
    spec["rule_files"] = [str(RULES)]
    asked = 0
    for group in spec["tests"]:
        kept = []
        for case in group["promql_expr_test"]:
            if case["expr"] == "inference:desired_replicas:raw":
                (sample,) = case["exp_samples"]
                labels = sample["labels"].removeprefix("inference:desired_replicas:raw")
                kept.append(
                    {
                        "expr": hpa_expr,
                        "eval_time": case["eval_time"],
                        "exp_samples": [{"labels": labels, "value": sample["value"]}],
                    }
                )
        group["promql_expr_test"] = kept
        asked += len(kept)
    assert asked >= 10
    path = tmp_path / "scalers.test.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.mark.parametrize("scaler", ["keda", "hpa"])
def test_scalers_ask_for_the_rules_replica_counts(
    promtool: str, tmp_path: Path, scaler: str
) -> None:
    metrics = keda_metrics() if scaler == "keda" else hpa_metrics()
    path = scaler_test_file(tmp_path, metrics)
    result = run_promtool(promtool, "test", "rules", path.name, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_scaler_with_another_target_asks_for_other_counts(promtool: str, tmp_path: Path) -> None:
    """The comparison above is not vacuous: a queue target of 5 instead of 4 fails it."""
    (queue, target), ttft = keda_metrics()
    path = scaler_test_file(tmp_path, [(queue, target + 1), ttft])
    result = run_promtool(promtool, "test", "rules", path.name, cwd=tmp_path)
    assert result.returncode != 0
    assert "time: 14m" in result.stderr, result.stderr


# --- the objects, offline ---------------------------------------------------------------------


def recorded() -> set[str]:
    return {record for record, _ in rule_exprs()}


def test_queries_read_recorded_series_of_the_overlays_namespace() -> None:
    for query, _ in keda_metrics():
        series = re.fullmatch(r'([\w:]+)\{namespace="([^"]+)"\}', query)
        assert series, query
        assert series[1] in recorded() and series[2] == namespace()
    for rule in adapter_rules().values():
        name = re.fullmatch(r"\^(.+)\$", rule["name"]["matches"])
        assert name and name[1] in recorded()
        assert rule["seriesQuery"].startswith(name[1] + "{")
        assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}


def test_scaled_object_fields_are_what_keda_accepts() -> None:
    so = scaled_object()
    assert (so["apiVersion"], so["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    for trigger in so["spec"]["triggers"]:
        meta = trigger["metadata"]
        # KEDA's CRD types trigger metadata as map[string]string: a bare 4 is refused.
        assert all(isinstance(v, str) for v in meta.values()), meta
        assert {"serverAddress", "query", "threshold"} <= set(meta)
        assert meta["serverAddress"].startswith(("http://", "https://"))
    assert len({t["name"] for t in so["spec"]["triggers"]}) == len(so["spec"]["triggers"])


def keda_hpa() -> dict[str, Any]:
    """The HPA that KEDA makes from the ScaledObject: its bounds, behavior and one External
    AverageValue metric per trigger."""
    spec = scaled_object()["spec"]
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": spec["advanced"]["horizontalPodAutoscalerConfig"]["name"]},
        "spec": {
            "scaleTargetRef": spec["scaleTargetRef"],
            "minReplicas": spec["minReplicaCount"],
            "maxReplicas": spec["maxReplicaCount"],
            "behavior": spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"],
            "metrics": [
                {
                    "type": "External",
                    "external": {
                        "metric": {"name": f"s{i}-prometheus"},
                        "target": {
                            "type": "AverageValue",
                            "averageValue": t["metadata"]["threshold"],
                        },
                    },
                }
                for i, t in enumerate(spec["triggers"])
            ],
        },
    }


def objects() -> dict[str, dict[str, Any]]:
    return {
        "hpa": hpa(),
        "keda-hpa": keda_hpa(),
        "adapter-config": load(AUTOSCALE / "prometheus-adapter.yaml"),
    }


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", sorted(objects()))
def test_objects_validate_offline(name: str, version: str) -> None:
    kubernetes_validate.validate(objects()[name], version, strict=True)


def test_validator_rejects_a_broken_hpa() -> None:
    broken = copy.deepcopy(hpa())
    broken["spec"]["behavior"]["scaleDown"]["stabilisationWindowSeconds"] = 900
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)


@pytest.mark.parametrize("overlay", [AUTOSCALE, AUTOSCALE / "hpa"], ids=["keda", "hpa"])
def test_overlay_scales_the_base_deployment_and_leaves_it_the_count(overlay: Path) -> None:
    k = kustomization(overlay)
    base = (overlay / k["resources"][0]).resolve()
    assert base == ROOT / "deploy" / "k8s"
    for resource in k["resources"][1:]:
        assert (overlay / resource).is_file()
    deployment = one("Deployment")
    (patch,) = k["patches"]
    assert patch["target"] == {"kind": "Deployment", "name": deployment["metadata"]["name"]}
    assert yaml.safe_load(patch["patch"]) == [{"op": "remove", "path": "/spec/replicas"}]
    assert "replicas" in deployment["spec"]  # so the remove applies
    for scaler in (scaled_object(), hpa()):
        ref = scaler["spec"]["scaleTargetRef"]
        assert (ref["apiVersion"], ref["kind"]) == (deployment["apiVersion"], "Deployment")
        assert ref["name"] == deployment["metadata"]["name"]


@pytest.mark.skipif(not shutil.which("kubectl"), reason="kubectl not installed")
@pytest.mark.parametrize("overlay", [AUTOSCALE, AUTOSCALE / "hpa"], ids=["keda", "hpa"])
def test_kubectl_kustomize_builds_the_overlay(overlay: Path) -> None:
    result = subprocess.run(
        ["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    built = {d["kind"]: d for d in yaml.safe_load_all(result.stdout)}
    assert "replicas" not in built["Deployment"]["spec"]
    assert {d["metadata"]["namespace"] for d in built.values()} == {namespace()}
    assert ("ScaledObject" in built) == (overlay == AUTOSCALE)
    assert ("HorizontalPodAutoscaler" in built) == (overlay != AUTOSCALE)
