"""The clustered brokers of compose.ha.yaml and deploy/kubernetes-ha/, read (no Docker engine or
API server runs here) and run: their configs are shared/security.py's, every service lists the
three NATS nodes and the sentinels, the Kubernetes objects pass the schemas, and the NATS nodes'
configs, with their host names put on free loopback ports, make a real JetStream cluster with
routes over mutual TLS that takes a stream of three replicas."""

from __future__ import annotations

import copy
import shutil
import subprocess
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from shared.callout import IssuerKey
from shared.enrol import ENROL_USER
from shared.security import (
    CALLOUT_ISSUER_VAR,
    REPLICA_USER,
    ROLES,
    SENTINEL_MASTER,
    SENTINEL_USER,
    env_password,
    nats_cluster_config,
    redis_replica_config,
    redis_replication_users,
    redis_sentinel_config,
    redis_users,
    url_user,
)
from shared.settings import nats_servers, parse_sentinel_url
from shared.tls import DEFAULT_SERVER_NAMES, generate, nats_tls_config
from tests.eventually import eventually, eventually_sync
from tests.repo.test_compose import SECRETS, SETTINGS, as_deployed, interpolate
from tests.repo.test_kubernetes_manifests import K8S_VERSION, _container_env
from tests.server_group import ServerGroup
from tools.servers import free_port, nats_server_binary, probe_nats

ROOT = Path(__file__).resolve().parents[2]
HA = ROOT / "deploy" / "kubernetes-ha"
NODES = (1, 2, 3)
TLS = Path("/tls")
ROUTE_TLS = nats_tls_config(TLS / "server.crt", TLS / "server.key", TLS / "ca.crt")
# compose.ha.yaml's two passwords more, besides compose.yaml's
HA_SECRETS = SECRETS | {"REDIS_REPLICA_PASSWORD": "repl-pw", "REDIS_SENTINEL_PASSWORD": "sent-pw"}
BROKERS = {f"{kind}-{i}" for kind in ("nats", "redis", "sentinel") for i in NODES}


# --- compose ---------------------------------------------------------------------------------


class Override(dict[str, Any]):
    """A value tagged ``!override``: it replaces compose.yaml's instead of merging with it."""


class _ComposeLoader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML is untyped here
    pass


_ComposeLoader.add_constructor(
    "!override", lambda loader, node: Override(loader.construct_mapping(node, deep=True))
)


def merge_compose(base: dict, override: dict) -> dict:
    """``docker compose -f compose.yaml -f compose.ha.yaml``, for what these files use: a
    service's mappings merge key by key, ``!override`` replaces, anything else is replaced."""
    merged = copy.deepcopy(base)
    for section in ("services", "configs", "volumes"):
        for name, value in (override.get(section) or {}).items():
            into = merged.setdefault(section, {})
            if name not in into or section != "services":
                into[name] = value
                continue
            for key, v in value.items():
                if isinstance(v, dict) and not isinstance(v, Override):
                    into[name][key] = {**into[name].get(key, {}), **v}
                else:
                    into[name][key] = dict(v) if isinstance(v, Override) else v
    return merged


@pytest.fixture(scope="module")
def ha_file() -> dict:
    loaded: dict = yaml.load((ROOT / "compose.ha.yaml").read_text(), _ComposeLoader)  # noqa: S506 - SafeLoader's subclass
    return loaded


@pytest.fixture(scope="module")
def merged(ha_file) -> dict:
    return merge_compose(yaml.safe_load((ROOT / "compose.yaml").read_text()), ha_file)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tls")
    generate(directory)
    return directory


def test_the_ha_file_replaces_the_single_brokers(merged, ha_file):
    services = merged["services"]
    assert BROKERS <= set(services)
    for single in ("nats", "redis"):  # compose.yaml's, started only with --profile single
        assert services[single]["profiles"] == ["single"]
    for name in BROKERS:
        assert "profiles" not in services[name], name  # they start with the file
        assert all(p.startswith("127.0.0.1:") for p in services[name].get("ports", []))
    wanted = {
        f"{k}-{i}": {"condition": "service_healthy"} for k in ("nats", "sentinel") for i in NODES
    }
    for name in SETTINGS:
        assert isinstance(ha_file["services"][name]["depends_on"], Override), name
        assert services[name]["depends_on"] == wanted, name


def test_the_ha_configs_are_the_generated_ones(merged):
    """Each node's file is shared/security.py's text, with every password a required variable."""
    configs = merged["configs"]
    for i in NODES:
        routes = [f"nats-route://nats-{j}:6222" for j in NODES if j != i]
        assert configs[f"nats_cluster_{i}"]["content"] == "include ./nats.conf\n" + (
            nats_cluster_config(f"nats-{i}", "0.0.0.0:6222", routes, ROUTE_TLS)
        )
        sentinel = redis_sentinel_config(
            "0.0.0.0", 0, "redis-1", 6379, "${REDIS_SENTINEL_PASSWORD:?}", hostnames=True
        )
        assert configs[f"redis_sentinel_{i}"]["content"] == (
            sentinel + f"sentinel announce-ip sentinel-{i}\n"
        )
    users = redis_users("ts", {r: f"${{REDIS_{r.upper()}_PASSWORD:?}}" for r in ROLES})
    users += redis_replication_users("${REDIS_REPLICA_PASSWORD:?}", "${REDIS_SENTINEL_PASSWORD:?}")
    assert configs["redis_ha_users"]["content"] == "\n".join(users) + "\n"
    # compose.yaml's single Redis keeps its own users, without those of replication
    assert configs["redis_ha_users"]["content"].startswith(configs["redis_users"]["content"])
    assert configs["redis_replica"]["content"] == redis_replica_config(
        "redis-1", 6379, "${REDIS_REPLICA_PASSWORD:?}"
    )
    for name in ("redis_ha_users", "redis_replica", "redis_sentinel_1"):
        with pytest.raises(KeyError, match="REDIS_(REPLICA|SENTINEL)_PASSWORD"):
            interpolate(configs[name]["content"], SECRETS)  # no start without them
        as_run = interpolate(configs[name]["content"], HA_SECRETS)
        assert "repl-pw" in as_run or "sent-pw" in as_run


def _arg(command: list[str], flag: str) -> str:
    return str(command[command.index(flag) + 1])


def test_the_nodes_load_their_configs_with_tls_everywhere(merged):
    services = merged["services"]
    single = services["redis"]["command"]
    for i in NODES:
        nats = services[f"nats-{i}"]
        targets = {c["source"]: c["target"] for c in nats["configs"]}
        assert targets == {
            "nats_limits": "/etc/nats/nats.conf",
            "nats_auth": "/etc/nats/auth.conf",
            "nats_tls": "/etc/nats/tls.conf",
            f"nats_cluster_{i}": "/etc/nats/cluster.conf",
        }
        assert _arg(nats["command"], "--config") == "/etc/nats/cluster.conf"
        assert "--jetstream" in nats["command"] and f"nats-{i}-data:/data" in nats["volumes"]

        redis = services[f"redis-{i}"]
        command = redis["command"]
        targets = {c["source"]: c["target"] for c in redis["configs"]}
        assert command[:4] == [
            "redis-server",
            targets["redis_ha_users"],
            "--include",
            targets["redis_replica"],
        ]
        for flag in ("--port", "--tls-port", "--tls-auth-clients", "--tls-cert-file",
                     "--tls-key-file", "--tls-ca-cert-file"):  # fmt: skip
            assert _arg(command, flag) == _arg(single, flag), flag  # as compose.yaml's Redis
        assert _arg(command, "--tls-replication") == "yes"
        assert _arg(command, "--replica-announce-ip") == f"redis-{i}"
        # redis-1 is the primary (the last replicaof wins), the others its replicas
        assert (command[-3:] == ["--replicaof", "no", "one"]) == (i == 1)
        assert redis["user"] == services["redis"]["user"]

        sentinel = services[f"sentinel-{i}"]
        [config] = sentinel["configs"]
        assert config["source"] == f"redis_sentinel_{i}"
        script = sentinel["command"][-1]
        assert f"cp {config['target']} /tmp/sentinel.conf" in script
        for part in ("--sentinel", "--tls-port 26379", "--tls-auth-clients yes",
                     "--tls-replication yes", "--tls-cert-file /tls/server.crt"):  # fmt: skip
            assert part in script
        assert "tls:/tls:ro" in sentinel["volumes"] and "tls:/tls:ro" in redis["volumes"]


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_every_service_lists_the_three_nodes_and_the_sentinels(merged, name, certs):
    env = merged["x-turboserve-env"] | merged["services"][name]["environment"]
    settings = SETTINGS[name].from_env(as_deployed(env, certs))
    user = ENROL_USER if name == "worker" else name
    assert nats_servers(settings.nats_url) == [
        f"tls://{user}:nats-{user}-pw@nats-{i}:4222" for i in NODES
    ]
    target = parse_sentinel_url(settings.redis_url)
    assert target is not None and target.tls
    assert target.sentinels == tuple((f"sentinel-{i}", 26379) for i in NODES)
    assert (target.master, target.db, target.username, target.password) == (
        SENTINEL_MASTER,
        0,
        name,
        f"redis-{name}-pw",
    )
    assert settings.stream_replicas == 3 and settings.redis_wait_replicas == 1
    if name == "provisioner":
        worker_env = {
            k: interpolate(str(v), SECRETS)
            for k, v in env.items()
            if k.startswith("TURBOSERVE_WORKER")
        }
        assert nats_servers(worker_env["TURBOSERVE_WORKER_NATS_URL"]) == [
            f"tls://nats-{i}:4222" for i in NODES
        ]
        worker = parse_sentinel_url(worker_env["TURBOSERVE_WORKER_REDIS_URL"])
        assert worker is not None and worker.sentinels == target.sentinels
        assert worker.username == "worker"


def test_the_server_certificate_names_every_node():
    """compose's node names and the Kubernetes pods' (a wildcard per headless Service)."""
    for name in BROKERS:
        assert name in DEFAULT_SERVER_NAMES, name
    for svc in ("nats", "redis", "sentinel"):
        assert f"*.{svc}.turboserve.svc" in DEFAULT_SERVER_NAMES


# --- Kubernetes ------------------------------------------------------------------------------


def _load(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _key(doc: dict) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def strategic_merge(base: Any, patch: Any) -> Any:
    """Kustomize's strategic merge, for what urls.yaml patches: mappings merge; a list of
    named entries merges by name, the patch's entries first, in its order, then the others."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = strategic_merge(base[key], value) if key in base else value
        return out
    if isinstance(base, list) and isinstance(patch, list) and all("name" in p for p in patch):
        by_name = {b["name"]: b for b in base}
        head = [strategic_merge(by_name.get(p["name"], {}), p) for p in patch]
        return head + [b for b in base if b["name"] not in {p["name"] for p in patch}]
    return patch


def build() -> list[dict]:
    """``kubectl kustomize deploy/kubernetes-ha``, for what its kustomizations do."""
    ha = yaml.safe_load((HA / "kustomization.yaml").read_text())
    without = yaml.safe_load((HA / "without-brokers" / "kustomization.yaml").read_text())
    [base_dir] = without["resources"]
    base_root = (HA / "without-brokers" / base_dir).resolve()
    base = yaml.safe_load((base_root / "kustomization.yaml").read_text())
    docs = [d for f in base["resources"] for d in _load(base_root / f)]
    deleted = set()
    for item in without["patches"]:
        patch = yaml.safe_load(item["patch"])
        assert patch.pop("$patch") == "delete"
        deleted.add(_key(patch))
    assert deleted <= {_key(d) for d in docs}
    docs = [d for d in docs if _key(d) not in deleted]
    for resource in ha["resources"]:
        if resource != "without-brokers/":
            docs += _load(HA / resource)
    for item in ha["patches"]:
        for patch in _load(HA / item["path"]):
            [i] = [n for n, d in enumerate(docs) if _key(d) == _key(patch)]
            docs[i] = strategic_merge(docs[i], patch)
    for doc in docs:
        if doc["kind"] != "Namespace":
            doc["metadata"]["namespace"] = ha["namespace"]
    return docs


DOCS = build()


def _one(kind: str, name: str) -> dict:
    [doc] = [d for d in DOCS if _key(d) == (kind, name)]
    return doc


def test_the_kustomizations_list_every_file():
    ha = yaml.safe_load((HA / "kustomization.yaml").read_text())
    files = {p.name for p in HA.glob("*.yaml")} - {"kustomization.yaml"}
    listed = {r for r in ha["resources"] if r.endswith(".yaml")} | {
        p["path"] for p in ha["patches"]
    }
    assert listed == files
    assert "without-brokers/" in ha["resources"] and ha["namespace"] == "turboserve"
    without = yaml.safe_load((HA / "without-brokers" / "kustomization.yaml").read_text())
    assert without["resources"] == ["../../kubernetes/"]  # the default deploy, as it is
    assert {p.name for p in (HA / "without-brokers").iterdir()} == {"kustomization.yaml"}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its kustomize) not here")
def test_the_build_is_kustomizes():
    """The objects this file checks are those kustomize makes of the overlay."""
    out = subprocess.run(
        ["kubectl", "kustomize", str(HA)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    built = {_key(d): d for d in yaml.safe_load_all(out) if d}
    assert built == {_key(d): d for d in DOCS}


@pytest.mark.parametrize("doc", DOCS, ids=[f"{k}/{n}" for k, n in map(_key, DOCS)])
def test_every_object_is_valid_against_the_schema(doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_brokers_are_replaced_under_their_names():
    kinds = {_key(d) for d in DOCS}
    assert {("StatefulSet", "nats"), ("StatefulSet", "redis"), ("StatefulSet", "sentinel")} <= kinds
    assert ("Deployment", "redis") not in kinds
    for name in ("nats", "redis", "sentinel"):
        service = _one("Service", name)["spec"]
        assert service["clusterIP"] == "None" and service["publishNotReadyAddresses"] is True
        statefulset = _one("StatefulSet", name)["spec"]
        assert statefulset["replicas"] == 3 and statefulset["serviceName"] == name
        spec = statefulset["template"]["spec"]
        [volume] = [v for v in spec["volumes"] if v["name"] == "tls"]
        assert volume["secret"] == {"secretName": "turboserve-tls"}, name


@pytest.mark.parametrize("service", sorted(SETTINGS))
def test_every_service_lists_the_pods(service, tmp_path):
    config = _one("ConfigMap", "turboserve-config")["data"]
    if service == "worker":
        spec = _one("PodTemplate", "turboserve-worker")["template"]["spec"]
    else:
        spec = _one("Deployment", service)["spec"]["template"]["spec"]
    env = _container_env(spec, config)  # a $(VAR) before its VAR fails here
    generate(tmp_path)
    env = {k: v.replace("/tls/", f"{tmp_path}/") for k, v in env.items()}
    fields = {f"TURBOSERVE_{f.upper()}" for f in SETTINGS[service].__dataclass_fields__}
    settings = SETTINGS[service].from_env(
        {k: v for k, v in env.items() if k in fields} | {"TURBOSERVE_WORKER_ID": "w-1"}
    )
    user = ENROL_USER if service == "worker" else service
    assert url_user(settings.nats_url) == user
    assert nats_servers(settings.nats_url) == [
        f"tls://{user}:k8s-{user}-pw@nats-{i}.nats.turboserve.svc:4222" for i in range(3)
    ]
    target = parse_sentinel_url(settings.redis_url)
    assert target is not None and target.tls and target.master == SENTINEL_MASTER
    assert target.sentinels == tuple(
        (f"sentinel-{i}.sentinel.turboserve.svc", 26379) for i in range(3)
    )
    assert settings.stream_replicas == 3 and settings.redis_wait_replicas == 1


def _node_files() -> dict[str, str]:
    return _one("ConfigMap", "turboserve-nats-cluster")["data"]


def test_each_nats_pod_loads_its_node_file_and_the_default_config():
    names = [f"nats-{i}" for i in range(3)]
    for name in names:
        routes = [f"nats-route://{n}.nats.turboserve.svc:6222" for n in names if n != name]
        assert _node_files()[f"{name}.conf"] == "include ./nats.conf\n" + nats_cluster_config(
            name, "0.0.0.0:6222", routes, ROUTE_TLS
        )
    assert set(_node_files()) == {f"{n}.conf" for n in names}
    spec = _one("StatefulSet", "nats")["spec"]["template"]["spec"]
    [container] = spec["containers"]
    pod_name = {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    assert container["env"][0] == pod_name
    config = _arg(container["args"], "--config")
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "config"]
    assert config == f"{mount['mountPath']}/$(POD_NAME).conf"
    [volume] = [v for v in spec["volumes"] if v["name"] == "config"]
    sources = [s["configMap"]["name"] for s in volume["projected"]["sources"]]
    assert sources == ["turboserve-nats", "turboserve-nats-cluster"]
    assert "nats.conf" in _one("ConfigMap", "turboserve-nats")["data"]  # the default deploy's
    # the users' passwords and the issuer, as the default deploy's NATS takes them
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"][1:]}
    wanted = {*(env_password(r) for r in ("gateway", "scheduler", "provisioner", "operator")),
              env_password(ENROL_USER), CALLOUT_ISSUER_VAR}  # fmt: skip
    assert refs == {var: {"name": "turboserve-nats", "key": var} for var in wanted}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"client": 4222, "cluster": 6222, "monitor": 8222}
    [claim] = _one("StatefulSet", "nats")["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"


def test_redis_and_the_sentinels_load_the_generated_configs():
    data = _one("ConfigMap", "turboserve-redis")["data"]
    primary = "redis-0.redis.turboserve.svc"
    assert (
        data["users.conf"]
        == "\n".join(
            redis_replication_users("${REDIS_REPLICA_PASSWORD}", "${REDIS_SENTINEL_PASSWORD}")
        )
        + "\n"
    )
    assert data["replica.conf"] == redis_replica_config(primary, 6379, "${REDIS_REPLICA_PASSWORD}")
    assert data["sentinel.conf"] == redis_sentinel_config(
        "0.0.0.0", 0, primary, 6379, "${REDIS_SENTINEL_PASSWORD}", hostnames=True
    )
    assert f"user {REPLICA_USER} " in data["users.conf"]
    assert f"auth-user {SENTINEL_MASTER} {SENTINEL_USER}" in data["sentinel.conf"]
    for kind, port in (("redis", 6379), ("sentinel", 26379)):
        spec = _one("StatefulSet", kind)["spec"]["template"]["spec"]
        [container] = spec["containers"]
        assert container["command"] == ["sh", f"/etc/redis/{kind}.sh"]
        script = data[f"{kind}.sh"]
        for part in (f"--tls-port {port}", "--tls-auth-clients yes", "--tls-replication yes"):
            assert part in script, (kind, part)
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
        assert all(ref == {"name": "turboserve-redis", "key": var} for var, ref in refs.items())
        for var in refs:  # every password the script fills in comes from the Secret
            assert f"${{{var}}}" in script
        assert container["ports"] == [{"name": kind, "containerPort": port}]
    assert "--port 0" in data["redis.sh"] and "port 0\n" in data["sentinel.conf"]
    assert "--replicaof no one" in data["redis.sh"]  # redis-0 without a primary named


# --- a real cluster of the generated configs -------------------------------------------------


class NatsNodes(ServerGroup):
    """Three nats-servers of the node files ``files`` (name -> text, host names rewritten to
    free loopback ports), each loading ``common`` (the shared NATS config) beside it."""

    def __init__(
        self, tmp: Path, files: dict[str, str], common: str, hosts: dict[str, str]
    ) -> None:
        super().__init__()
        generate(tmp / "tls")
        routes = {name: free_port() for name in files}
        self.ports: list[int] = []
        env = {
            env_password(r): f"pw-{r}"
            for r in ("gateway", "scheduler", "provisioner", "operator", ENROL_USER)
        }
        env[CALLOUT_ISSUER_VAR] = IssuerKey.generate().public_nkey
        (tmp / "nats.conf").write_text(common.replace("/tls/", f"{tmp}/tls/"))
        for name, text in files.items():
            text = text.replace("/tls/", f"{tmp}/tls/").replace(
                '"0.0.0.0:6222"', f'"127.0.0.1:{routes[name]}"'
            )
            for other, host in hosts.items():
                text = text.replace(
                    f"nats-route://{host}:6222", f"nats-route://127.0.0.1:{routes[other]}"
                )
            assert "6222" not in text, text
            (tmp / f"{name}.conf").write_text(text)
            port = free_port()
            self.ports.append(port)
            self.procs[port] = subprocess.Popen(
                [nats_server_binary(), "--config", str(tmp / f"{name}.conf"), "--jetstream",
                 "--store_dir", str(tmp / f"data-{name}"), "-a", "127.0.0.1", "-p", str(port)],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        self.tls = tmp / "tls"
        self.operator_password = env[env_password("operator")]


async def _a_stream_of_three(nodes: NatsNodes, tls_hostname: str | None = None) -> None:
    import nats

    from shared.tls import TlsFiles, client_context

    files = TlsFiles(
        str(nodes.tls / "ca.crt"), str(nodes.tls / "client.crt"), str(nodes.tls / "client.key")
    )
    for port in nodes.ports:
        eventually_sync(partial(probe_nats, f"nats://127.0.0.1:{port}"), 20, f"node {port}")
    servers = [f"tls://127.0.0.1:{p}" for p in nodes.ports]
    nc = await nats.connect(
        servers, user="operator", password=nodes.operator_password, tls=client_context(files),
        tls_hostname=tls_hostname, connect_timeout=5, max_reconnect_attempts=3,
    )  # fmt: skip
    try:
        js = nc.jetstream()

        async def created() -> bool:
            try:  # the routes connect and the cluster elects its meta leader first
                await js.add_stream(name="probe", subjects=["probe"], num_replicas=3)
            except Exception:  # noqa: BLE001 - not ready yet: asked again
                return False
            return True

        await eventually(created, 40, "a stream of three replicas")
        await js.publish("probe", b"x")
        info = await js.stream_info("probe")
        assert info.config.num_replicas == 3 and info.state.messages == 1
        assert info.cluster is not None and info.cluster.leader is not None
        assert len(info.cluster.replicas or []) == 2  # the leader and two followers
    finally:
        await nc.close()


@pytest.fixture
def stopped() -> Iterator[list[ServerGroup]]:
    groups: list[ServerGroup] = []
    yield groups
    for group in groups:
        group.stop()


@pytest.mark.integration
@pytest.mark.slow
async def test_the_kubernetes_nats_nodes_form_a_jetstream_cluster(tmp_path, stopped):
    """The pods' node files as they are, over routes with mutual TLS; a client checks the
    server certificate against a pod's name (the wildcard *.nats.turboserve.svc)."""
    files = {name.removesuffix(".conf"): text for name, text in _node_files().items()}
    common = _one("ConfigMap", "turboserve-nats")["data"]["nats.conf"]
    hosts = {name: f"{name}.nats.turboserve.svc" for name in files}
    nodes = NatsNodes(tmp_path, files, common, hosts)
    stopped.append(nodes)
    await _a_stream_of_three(nodes, tls_hostname="nats-0.nats.turboserve.svc")


@pytest.mark.integration
@pytest.mark.slow
async def test_the_compose_nats_nodes_form_a_jetstream_cluster(merged, tmp_path, stopped):
    configs = merged["configs"]
    files = {f"nats-{i}": configs[f"nats_cluster_{i}"]["content"] for i in NODES}
    # compose's nats.conf includes auth.conf and tls.conf: one file here, interpolated
    auth = interpolate(configs["nats_auth"]["content"], SECRETS)
    common = (
        configs["nats_limits"]["content"].replace("include ./auth.conf\ninclude ./tls.conf\n", "")
        + auth
        + configs["nats_tls"]["content"]
    )
    nodes = NatsNodes(tmp_path, files, common, {name: name for name in files})
    nodes.operator_password = SECRETS["NATS_OPERATOR_PASSWORD"]
    stopped.append(nodes)
    await _a_stream_of_three(nodes, tls_hostname="nats-2")
