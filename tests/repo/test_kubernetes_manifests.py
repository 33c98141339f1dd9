"""No cluster can run here: check deploy/kubernetes/ against the Kubernetes schemas
(kubernetes-validate, strict) and against the code it deploys (settings, RBAC, pod template)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from services.provisioner.backends.k8s import API_USE, WORKER_CONTAINER
from shared.settings import (
    GatewaySettings,
    ProvisionerSettings,
    SchedulerSettings,
    SettingsError,
    WorkerSettings,
)

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
K8S_VERSION = "1.37.0"
SETTINGS = {
    "gateway": GatewaySettings,
    "scheduler": SchedulerSettings,
    "provisioner": ProvisionerSettings,
    "worker": WorkerSettings,
}


def _documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


DOCS = _documents()


def _one(kind: str, name: str) -> dict:
    [doc] = [d for _, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


@pytest.mark.parametrize(
    ("file", "doc"), DOCS, ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in DOCS]
)
def test_every_object_is_valid_against_the_schema(file, doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert (
        doc["metadata"].get("namespace", "turboserve") == "turboserve" or doc["kind"] == "Namespace"
    )


def test_invalid_objects_are_caught():
    bad = {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": "x"},
        "template": {"spec": {"containers": [{"name": "worker", "imag": "typo"}]}},
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_kustomization_lists_every_file():
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    files = {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files
    assert kustomization["namespace"] == "turboserve"


def _container_env(spec: dict, config: dict[str, str]) -> dict[str, str]:
    [container] = [c for c in spec["containers"]]
    env = {}
    for source in container.get("envFrom", []):
        assert source["configMapRef"]["name"] == "turboserve-config"
        env.update(config)
    for item in container.get("env", []):
        source = item.get("valueFrom", {})
        if "secretKeyRef" in source:  # what an operator puts in the Secret
            env[item["name"]] = "ops:k8s-key-1"
        else:  # a value, or a fieldRef: the pod's address
            env[item["name"]] = item.get("value", "10.0.0.7")
    return env


@pytest.mark.parametrize("service", sorted(SETTINGS))
def test_environment_names_real_settings_with_valid_values(service):
    config = _one("ConfigMap", "turboserve-config")["data"]
    if service == "worker":
        spec = _one("PodTemplate", "turboserve-worker")["template"]["spec"]
        env = {**_container_env(spec, config), "TURBOSERVE_WORKER_ID": "w-1"}  # the provisioner's
    else:
        spec = _one("Deployment", service)["spec"]["template"]["spec"]
        env = _container_env(spec, config)
        assert spec["containers"][0]["args"] == [service]
    fields = {f.name for f in dataclasses.fields(SETTINGS[service])}
    for var in env:
        assert (
            var.startswith("TURBOSERVE_") and var.removeprefix("TURBOSERVE_").lower() in fields
        ), var
    try:
        SETTINGS[service].from_env(env)
    except SettingsError as exc:  # pragma: no cover - the message is the point
        pytest.fail(f"{service}: {exc}")


def test_probes_use_the_ops_port_the_config_sets():
    port = int(_one("ConfigMap", "turboserve-config")["data"]["TURBOSERVE_METRICS_PORT"])
    specs = [
        _one("Deployment", n)["spec"]["template"]["spec"] for n in ("scheduler", "provisioner")
    ]
    specs.append(_one("PodTemplate", "turboserve-worker")["template"]["spec"])
    for spec in specs:
        [container] = spec["containers"]
        ops = {p["name"]: p["containerPort"] for p in container["ports"]}["ops"]
        assert ops == port
        assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "ops"}


def test_provisioner_rbac_grants_exactly_what_the_backend_calls():
    role = _one("Role", "turboserve-provisioner")
    granted = {
        (res, verb) for rule in role["rules"] for res in rule["resources"] for verb in rule["verbs"]
    }
    assert all(rule["apiGroups"] == [""] for rule in role["rules"])
    assert granted == {(res, verb) for res, verbs in API_USE.items() for verb in verbs}
    binding = _one("RoleBinding", "turboserve-provisioner")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    deployment = _one("Deployment", "provisioner")
    assert (
        deployment["spec"]["template"]["spec"]["serviceAccountName"]
        == binding["subjects"][0]["name"]
    )
    assert (
        deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    )


def test_worker_pod_template_is_what_the_provisioner_expects():
    provisioner = _one("Deployment", "provisioner")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in provisioner["env"]}
    assert env["TURBOSERVE_BACKEND"] == "kubernetes"
    template = _one("PodTemplate", env["TURBOSERVE_K8S_POD_TEMPLATE"])["template"]["spec"]
    [worker] = template["containers"]
    assert worker["name"] == WORKER_CONTAINER and worker["args"] == ["worker"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert template["restartPolicy"] == "Never"
    assert "TURBOSERVE_WORKER_ID" not in {e["name"] for e in worker["env"]}  # the provisioner's


def test_the_gateway_starts_closed():
    """The gateway's API keys come from a Secret it cannot start without."""
    [gateway] = _one("Deployment", "gateway")["spec"]["template"]["spec"]["containers"]
    [keys] = [e for e in gateway["env"] if e["name"] == "TURBOSERVE_API_KEYS"]
    ref = keys["valueFrom"]["secretKeyRef"]
    assert ref["optional"] is False and ref["name"] == "turboserve-api-keys"
    assert "turboserve-api-keys" not in {d["metadata"]["name"] for _, d in DOCS}  # not shipped


def test_schedulers_run_active_and_standby():
    scheduler = _one("Deployment", "scheduler")
    assert scheduler["spec"]["replicas"] == 2
    gateway = _one("Deployment", "gateway")
    assert gateway["spec"]["replicas"] >= 2
    services = {d["metadata"]["name"] for _, d in DOCS if d["kind"] == "Service"}
    assert services == {"nats", "redis", "gateway"}


def test_nats_carries_the_chunks_with_the_limits_the_code_computes():
    """The NATS server loads shared/video.py's limits for the settings the ConfigMap gives
    every process (the default bitrate and sessions)."""
    from shared.settings import CommonSettings
    from shared.video import ChunkRetention, nats_limits_config

    shared_env = _one("ConfigMap", "turboserve-config")["data"]
    settings = CommonSettings.from_env({k: str(v) for k, v in shared_env.items()})
    limits = _one("ConfigMap", "turboserve-nats")["data"]["nats.conf"]
    assert limits == nats_limits_config(ChunkRetention.of(settings))
    nats = _one("StatefulSet", "nats")["spec"]["template"]["spec"]
    [container] = nats["containers"]
    config = container["args"][container["args"].index("--config") + 1]
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "limits"]
    assert config == f"{mount['mountPath']}/nats.conf"
    [volume] = [v for v in nats["volumes"] if v["name"] == "limits"]
    assert volume["configMap"]["name"] == "turboserve-nats"
    # the JetStream memory fits in the container's memory limit
    memory_limit = container["resources"]["limits"]["memory"]
    assert memory_limit.endswith("Gi") and int(memory_limit[:-2]) * 1024**3 > int(
        limits.split("max_memory_store: ")[1].split()[0]
    )
