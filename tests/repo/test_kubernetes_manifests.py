"""No cluster can run here: check deploy/kubernetes/ against the Kubernetes schemas
(kubernetes-validate, strict) and against the code it deploys (settings, RBAC, pod template)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from services.provisioner.backends.k8s import API_USE, WORKER_CONTAINER
from shared.callout import IssuerKey
from shared.enrol import ENROL_USER
from shared.security import (
    CALLOUT_ISSUER_VAR,
    GATEWAY,
    OPERATOR,
    PROVISIONER,
    SCHEDULER,
    env_password,
    nats_authorization_from_env,
    url_user,
)
from shared.settings import (
    GatewaySettings,
    ProvisionerSettings,
    SchedulerSettings,
    SettingsError,
    WorkerSettings,
)
from shared.tls import generate, nats_tls_config
from shared.wire import Subjects

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


# NATS's users on Kubernetes: the services but the workers (each pod enrols and is a user of its
# own through the auth callout), and the enrol user.
NATS_USERS = (GATEWAY, SCHEDULER, PROVISIONER, OPERATOR, ENROL_USER)
CALLOUT_KEY = IssuerKey.generate()


def secret_value(secret: str, key: str) -> str:
    """What an operator puts in each Secret (docs/security.md)."""
    if secret == "turboserve-api-keys":
        return "ops:k8s-key-1"
    assert secret == "turboserve-nats", secret
    if key == "TURBOSERVE_CALLOUT_KEY":
        return CALLOUT_KEY.text()
    if key == CALLOUT_ISSUER_VAR:
        return CALLOUT_KEY.public_nkey
    [role] = [r for r in NATS_USERS if env_password(r) == key]
    return f"k8s-{role}-pw"


def _container_env(spec: dict, config: dict[str, str]) -> dict[str, str]:
    """A container's environment as Kubernetes makes it: the ConfigMap, then ``env`` in order
    (a Secret's value, a field, ``$(VAR)`` of an earlier one expanded), ``env`` winning."""
    [container] = [c for c in spec["containers"]]
    env = {}
    for source in container.get("envFrom", []):
        assert source["configMapRef"]["name"] == "turboserve-config"
        env.update(config)
    for item in container.get("env", []):
        source = item.get("valueFrom", {})
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            assert ref.get("optional") is not True, item["name"]  # no Secret, no start
            env[item["name"]] = secret_value(ref["name"], ref["key"])
        elif "value" in item:
            env[item["name"]] = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], item["value"]
            )
        else:  # a fieldRef: the pod's address
            env[item["name"]] = "10.0.0.7"
    return env


def _helpers(spec: dict) -> set[str]:
    """The variables a container sets only for others to use (``$(NATS_PASSWORD)``)."""
    [container] = [c for c in spec["containers"]]
    values = " ".join(str(e.get("value", "")) for e in container.get("env", []))
    return {
        e["name"]
        for e in container.get("env", [])
        if not e["name"].startswith("TURBOSERVE_") and f"$({e['name']})" in values
    }


@pytest.mark.parametrize("service", sorted(SETTINGS))
def test_environment_names_real_settings_with_valid_values(service, tmp_path):
    config = _one("ConfigMap", "turboserve-config")["data"]
    if service == "worker":
        spec = _one("PodTemplate", "turboserve-worker")["template"]["spec"]
        env = {**_container_env(spec, config), "TURBOSERVE_WORKER_ID": "w-1"}  # the provisioner's
    else:
        spec = _one("Deployment", service)["spec"]["template"]["spec"]
        env = _container_env(spec, config)
        assert spec["containers"][0]["args"] == [service]
    fields = {f.name for f in dataclasses.fields(SETTINGS[service])}
    for var in set(env) - _helpers(spec):
        assert (
            var.startswith("TURBOSERVE_") and var.removeprefix("TURBOSERVE_").lower() in fields
        ), var
    generate(tmp_path)  # the Secret's files, where the pod has them (the settings check them)
    env = {k: v.replace("/tls/", f"{tmp_path}/") for k, v in env.items()}
    try:
        settings = SETTINGS[service].from_env(env)
    except SettingsError as exc:  # pragma: no cover - the message is the point
        pytest.fail(f"{service}: {exc}")
    # each connects to NATS as its own user (a worker: as the enrol user, to enrol)
    user = ENROL_USER if service == "worker" else service
    assert url_user(settings.nats_url) == user
    assert settings.nats_url == f"tls://{user}:k8s-{user}-pw@nats:4222"
    if isinstance(settings, WorkerSettings):
        assert settings.enrol
    if isinstance(settings, ProvisionerSettings):
        assert IssuerKey.from_text(settings.callout_key).public_nkey == CALLOUT_KEY.public_nkey


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


def test_nats_carries_the_chunks_with_the_limits_the_code_computes(tmp_path):
    """The NATS server loads shared/video.py's limits for the settings the ConfigMap gives
    every process (the default bitrate and sessions)."""
    from shared.settings import CommonSettings
    from shared.video import ChunkRetention, nats_limits_config

    shared_env = _one("ConfigMap", "turboserve-config")["data"]
    generate(tmp_path)
    settings = CommonSettings.from_env(
        {k: str(v).replace("/tls/", f"{tmp_path}/") for k, v in shared_env.items()}
    )
    limits = _one("ConfigMap", "turboserve-nats")["data"]["nats.conf"]
    tls = Path("/tls")
    assert limits.startswith(
        nats_limits_config(ChunkRetention.of(settings))
        + "# shared/tls.py (nats_tls_config) for the Secret turboserve-tls at /tls.\n"
        + nats_tls_config(tls / "server.crt", tls / "server.key", tls / "ca.crt")
    )
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


def test_nats_redis_and_every_pod_take_the_tls_secret():
    """Every pod mounts the Secret turboserve-tls at /tls (none starts without it); Redis takes
    TLS only, with client certificates; the services connect over tls:// and rediss://."""
    config = _one("ConfigMap", "turboserve-config")["data"]
    assert config["TURBOSERVE_NATS_URL"].startswith("tls://")
    assert config["TURBOSERVE_REDIS_URL"].startswith("rediss://")
    specs = {
        name: _one(kind, name)["spec"]["template"]["spec"]
        for kind, name in (
            ("Deployment", "gateway"),
            ("Deployment", "scheduler"),
            ("Deployment", "provisioner"),
            ("Deployment", "redis"),
            ("StatefulSet", "nats"),
        )
    }
    specs["worker"] = _one("PodTemplate", "turboserve-worker")["template"]["spec"]
    for name, spec in specs.items():
        [volume] = [v for v in spec["volumes"] if v["name"] == "tls"]
        assert volume["secret"] == {"secretName": "turboserve-tls"}, name
        assert volume["secret"].get("optional") is not True, name
        mounts = [m for c in spec["containers"] for m in c.get("volumeMounts", [])]
        assert {"name": "tls", "mountPath": "/tls", "readOnly": True} in mounts, name
    args = specs["redis"]["containers"][0]["args"]
    assert args[args.index("--port") + 1] == "0"
    assert args[args.index("--tls-auth-clients") + 1] == "yes"


def test_nats_has_a_user_per_service_and_sends_workers_to_the_callout():
    """The NATS config is shared/security.py's, with the passwords and the issuer read from
    the pod's environment, and the pod's environment is exactly those, from the Secret
    turboserve-nats: the config itself holds no secret."""
    config = _one("ConfigMap", "turboserve-config")["data"]
    conf = _one("ConfigMap", "turboserve-nats")["data"]["nats.conf"]
    auth = nats_authorization_from_env(Subjects(config["TURBOSERVE_SUBJECT_PREFIX"]), NATS_USERS)
    assert conf.endswith(auth)
    assert 'user: "worker"' not in conf and "k8s-" not in conf
    [container] = _one("StatefulSet", "nats")["spec"]["template"]["spec"]["containers"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    wanted = {*(env_password(r) for r in NATS_USERS), CALLOUT_ISSUER_VAR}
    assert set(refs) == wanted
    assert all(ref == {"name": "turboserve-nats", "key": var} for var, ref in refs.items())
    assert set(re.findall(r"(?:password|issuer): \$([A-Z_]+)", auth)) == wanted
