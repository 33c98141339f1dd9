"""Docker cannot run here: check compose.yaml and the Dockerfile by reading them.

``interpolate`` does what compose does to the file's values (``${VAR:?}``, ``${VAR:-default}``,
``$$``), so the values can be checked as the containers will see them."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from shared.callout import IssuerKey
from shared.enrol import ENROL_USER
from shared.security import (
    GATEWAY,
    OPERATOR,
    PROVISIONER,
    ROLES,
    SCHEDULER,
    nats_authorization,
    redis_users,
)
from shared.settings import (
    CommonSettings,
    GatewaySettings,
    ProvisionerSettings,
    SchedulerSettings,
    WorkerSettings,
)
from shared.tls import generate, nats_tls_config
from shared.video import (
    NATS_DEFAULT_MAX_PAYLOAD,
    ChunkRetention,
    chunk_wire_bytes,
    nats_limits_config,
)
from shared.wire import Subjects

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {
    "gateway": GatewaySettings,
    "scheduler": SchedulerSettings,
    "worker": WorkerSettings,
    "provisioner": ProvisionerSettings,
}


# NATS's users in compose: the services but the workers, each of which enrols and is a user of
# its own through the auth callout, and the enrol user. Redis: every role.
NATS_USERS = (GATEWAY, SCHEDULER, PROVISIONER, OPERATOR, ENROL_USER)
CALLOUT_KEY = IssuerKey.generate()
# What an operator sets before `docker compose up` (docs/security.md): the ten passwords, the
# callout's key (`turboserve callout-key`) and the gateway's API keys.
SECRETS = (
    {f"NATS_{role.upper()}_PASSWORD": f"nats-{role}-pw" for role in NATS_USERS}
    | {f"REDIS_{role.upper()}_PASSWORD": f"redis-{role}-pw" for role in ROLES}
    | {
        "TURBOSERVE_API_KEYS": "ops:compose-key-1",
        "TURBOSERVE_CALLOUT_KEY": CALLOUT_KEY.text(),
        "NATS_CALLOUT_ISSUER": CALLOUT_KEY.public_nkey,
    }
)
_VARIABLE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's interpolation of one value; a missing required variable raises KeyError."""

    def value(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if env.get(name):
            return env[name]
        if op in (":-", "-"):
            return arg
        if op in (":?", "?"):
            raise KeyError(f"required variable {name} is missing a value")
        return ""

    return _VARIABLE.sub(value, text)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """A set of certificates where the containers have theirs (``/tls``): the settings check
    that the files exist."""
    directory = tmp_path_factory.mktemp("tls")
    generate(directory)
    return directory


def as_deployed(env: dict, certs: Path) -> dict[str, str]:
    """A service's environment as its container sees it, with /tls at ``certs``."""
    return {k: interpolate(str(v), SECRETS).replace("/tls/", f"{certs}/") for k, v in env.items()}


def test_names_every_service(compose):
    assert set(compose["services"]) == {"certs", "nats", "redis", *SETTINGS}


def test_infrastructure(compose):
    nats, redis = compose["services"]["nats"], compose["services"]["redis"]
    assert nats["image"].startswith("nats:") and "--jetstream" in nats["command"]
    assert redis["image"].startswith("redis:")
    assert "healthcheck" in nats and "healthcheck" in redis


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_service_image_command_and_dependencies(compose, name):
    svc = compose["services"][name]
    assert svc["image"] == "turboserve:latest"
    assert (
        svc["build"]["dockerfile"] == "Dockerfile"
        and (ROOT / svc["build"]["context"] / "Dockerfile").exists()
    )
    assert svc["command"] == [name]
    assert svc["depends_on"] == {
        "nats": {"condition": "service_healthy"},
        "redis": {"condition": "service_healthy"},
    }
    assert "container_name" not in svc, "a fixed container name prevents --scale"


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_environment_names_real_settings(compose, name, certs):
    env = compose["services"][name]["environment"]
    fields = {f.name for f in dataclasses.fields(SETTINGS[name])}
    for var in env:
        assert var.startswith("TURBOSERVE_"), var
        assert var.removeprefix("TURBOSERVE_").lower() in fields, f"{name}: {var} is no setting"
    # each service connects as its own user, with a password the operator must set; a worker
    # enrols first, as the enrol user
    nats_user = ENROL_USER if name == "worker" else name
    upper = name.upper()
    assert env["TURBOSERVE_NATS_URL"] == (
        f"tls://{nats_user}:${{NATS_{nats_user.upper()}_PASSWORD:?}}@nats:4222"
    )
    assert env["TURBOSERVE_REDIS_URL"] == (
        f"rediss://{name}:${{REDIS_{upper}_PASSWORD:?}}@redis:6379/0"
    )
    with pytest.raises(KeyError, match=f"NATS_{nats_user.upper()}_PASSWORD"):
        interpolate(env["TURBOSERVE_NATS_URL"], {})
    # the values as the container sees them must pass the service's own validation
    settings = SETTINGS[name].from_env(as_deployed(compose["x-turboserve-env"] | env, certs))
    assert settings.nats_url == f"tls://{nats_user}:nats-{nats_user}-pw@nats:4222"
    assert settings.tls is not None and settings.tls.ca_file == f"{certs}/ca.crt"
    assert f"nats-{nats_user}-pw" not in str(settings)  # and are masked when printed
    if name == "worker":
        assert isinstance(settings, WorkerSettings) and settings.enrol


def test_the_gateway_starts_closed(compose, certs):
    """Compose refuses to start the gateway without API keys, and the keys reach it."""
    env = compose["services"]["gateway"]["environment"]
    with pytest.raises(KeyError, match="TURBOSERVE_API_KEYS"):
        interpolate(env["TURBOSERVE_API_KEYS"], {})
    settings = GatewaySettings.from_env(as_deployed(env, certs))
    assert settings.api_key_map() == {"ops": "compose-key-1"}


def test_provisioner_answers_the_callout_and_gives_each_worker_its_own_user(compose, certs):
    """The provisioner holds the callout's key (compose refuses to start without it), and a
    worker it starts gets the bare NATS address: its user is made for it at launch."""
    env = compose["services"]["provisioner"]["environment"]
    assert env["TURBOSERVE_WORKER_NATS_URL"] == "tls://nats:4222"
    assert env["TURBOSERVE_WORKER_REDIS_URL"] == (
        "rediss://worker:${REDIS_WORKER_PASSWORD:?}@redis:6379/0"
    )
    with pytest.raises(KeyError, match="TURBOSERVE_CALLOUT_KEY"):
        interpolate(env["TURBOSERVE_CALLOUT_KEY"], {})
    settings = ProvisionerSettings.from_env(as_deployed(compose["x-turboserve-env"] | env, certs))
    assert IssuerKey.from_text(settings.callout_key).public_nkey == CALLOUT_KEY.public_nkey


def compose_auth(compose: dict) -> tuple[str, str]:
    """The NATS authorization and the Redis users compose.yaml holds, uninterpolated."""
    configs = compose["configs"]
    return configs["nats_auth"]["content"], configs["redis_users"]["content"]


def test_auth_configs_are_the_generated_ones(compose):
    """compose.yaml carries shared/security.py's output for its prefix and namespace, with
    each password a required variable and every other "$" escaped."""
    common = compose["x-turboserve-env"]
    issuer = IssuerKey.generate().public_nkey
    nats = nats_authorization(
        Subjects(common["TURBOSERVE_SUBJECT_PREFIX"]),
        {role: f"@{role}@" for role in NATS_USERS},
        issuer,
    )
    redis = "\n".join(
        redis_users(common["TURBOSERVE_REDIS_NAMESPACE"], {role: f"@{role}@" for role in ROLES})
    )
    nats = nats.replace("$", "$$").replace(issuer, "${NATS_CALLOUT_ISSUER:?}")
    for role in NATS_USERS:
        nats = nats.replace(f"@{role}@", f"${{NATS_{role.upper()}_PASSWORD:?}}")
    for role in ROLES:
        redis = redis.replace(f"@{role}@", f"${{REDIS_{role.upper()}_PASSWORD:?}}")
    assert compose_auth(compose) == (nats, redis + "\n")
    as_deployed = interpolate(compose_auth(compose)[0], SECRETS)
    assert '"$JS.API.STREAM.CREATE.ts_SESSIONS"' in as_deployed
    assert 'password: "nats-gateway-pw"' in as_deployed
    assert f'issuer: "{CALLOUT_KEY.public_nkey}"' in as_deployed
    assert 'user: "worker"' not in as_deployed  # no shared worker user on NATS


def test_servers_load_the_auth_configs(compose):
    nats, redis = compose["services"]["nats"], compose["services"]["redis"]
    limits, auth, tls = nats["configs"]
    assert (limits["source"], auth["source"], tls["source"]) == (
        "nats_limits",
        "nats_auth",
        "nats_tls",
    )
    assert nats["command"][nats["command"].index("--config") + 1] == limits["target"]
    included = compose["configs"]["nats_limits"]["content"].splitlines()[-2:]
    assert included == [f"include ./{Path(c['target']).name}" for c in (auth, tls)]
    assert (
        Path(auth["target"]).parent == Path(tls["target"]).parent == Path(limits["target"]).parent
    )
    [redis_config] = redis["configs"]
    assert redis_config["source"] == "redis_users"
    assert redis["command"][:2] == ["redis-server", redis_config["target"]]


def test_nats_carries_the_chunks_with_the_limits_the_code_computes(compose, certs):
    """max_payload and the JetStream memory are shared/video.py's for the default bitrate and
    sessions, so the chunk stream's resume window fits and a chunk fits one message."""
    settings = CommonSettings.from_env(as_deployed(compose["x-turboserve-env"], certs))
    content = compose["configs"]["nats_limits"]["content"]
    assert content == (
        nats_limits_config(ChunkRetention.of(settings))
        + "include ./auth.conf\ninclude ./tls.conf\n"
    )
    retention = ChunkRetention.of(settings)
    assert retention.memory_store_bytes > retention.max_bytes
    assert chunk_wire_bytes(settings.video_bitrate, 0.75) < NATS_DEFAULT_MAX_PAYLOAD


def test_worker_reserves_a_gpu(compose):
    devices = compose["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]


def test_gateway_port_range_allows_scaling(compose):
    gw = compose["services"]["gateway"]
    assert gw["environment"]["TURBOSERVE_HOST"] == "0.0.0.0"
    [mapping] = gw["ports"]
    assert re.fullmatch(r"\$\{TURBOSERVE_GATEWAY_PORTS:-\d+-\d+\}:8080", mapping)


def test_dockerfile_installs_project_and_runs_turboserve():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11", text, re.M)
    assert 'ENTRYPOINT ["turboserve"]' in text
    assert re.search(r'pip install (\.|"\.\[[a-z0-9,]+\]")', text)
    assert "cpu" not in re.findall(r'ARG TORCH_SPEC="([^"]*)"', text)[0]  # users have GPUs


def test_workers_are_reachable_for_migration_and_infra_ports_stay_local(compose):
    assert compose["services"]["worker"]["environment"]["TURBOSERVE_HANDOFF_HOST"] == "auto"
    for name in ("nats", "redis"):
        assert all(p.startswith("127.0.0.1:") for p in compose["services"][name]["ports"])


def test_tls_is_required_by_nats_and_redis_with_the_certs_step_first(compose):
    """The certs step writes the files before NATS and Redis start; both then take TLS only,
    with a client certificate, and every service mounts the files and names them."""
    services = compose["services"]
    assert services["certs"]["command"] == ["certs", "/tls"]
    assert services["certs"]["volumes"] == ["tls:/tls"]
    tls = Path("/tls")
    for name in ("nats", "redis"):
        assert services[name]["depends_on"]["certs"] == {
            "condition": "service_completed_successfully"
        }
        assert "tls:/tls:ro" in services[name]["volumes"]
    assert compose["configs"]["nats_tls"]["content"] == nats_tls_config(
        tls / "server.crt", tls / "server.key", tls / "ca.crt"
    )
    command = services["redis"]["command"]

    def arg(flag: str) -> str:
        return str(command[command.index(flag) + 1])

    assert arg("--port") == "0"  # no plain-text port at all
    assert arg("--tls-port") == "6379"
    assert arg("--tls-auth-clients") == "yes"
    assert (arg("--tls-cert-file"), arg("--tls-key-file"), arg("--tls-ca-cert-file")) == (
        "/tls/server.crt",
        "/tls/server.key",
        "/tls/ca.crt",
    )
    common = compose["x-turboserve-env"]
    assert (
        common["TURBOSERVE_TLS_CA_FILE"],
        common["TURBOSERVE_TLS_CERT_FILE"],
        common["TURBOSERVE_TLS_KEY_FILE"],
    ) == ("/tls/ca.crt", "/tls/client.crt", "/tls/client.key")
    for name in SETTINGS:
        assert "tls:/tls:ro" in services[name]["volumes"], name
    assert "tls" in compose["volumes"]
    assert re.search(r"chown turboserve:turboserve /tls", (ROOT / "Dockerfile").read_text())
