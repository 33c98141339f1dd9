"""Docker cannot run here: check compose.yaml and the Dockerfile by reading them.

``interpolate`` does what compose does to the file's values (``${VAR:?}``, ``${VAR:-default}``,
``$$``), so the values can be checked as the containers will see them."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from shared.security import ROLES, nats_authorization, redis_users
from shared.settings import (
    CommonSettings,
    GatewaySettings,
    ProvisionerSettings,
    SchedulerSettings,
    WorkerSettings,
)
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


# What an operator sets before `docker compose up` (docs/security.md): the ten passwords and
# the gateway's API keys.
SECRETS = {
    f"{server}_{role.upper()}_PASSWORD": f"{server.lower()}-{role}-pw"
    for server in ("NATS", "REDIS")
    for role in ROLES
} | {"TURBOSERVE_API_KEYS": "ops:compose-key-1"}
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


def test_names_every_service(compose):
    assert set(compose["services"]) == {"nats", "redis", *SETTINGS}


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
def test_environment_names_real_settings(compose, name):
    env = compose["services"][name]["environment"]
    fields = {f.name for f in dataclasses.fields(SETTINGS[name])}
    for var in env:
        assert var.startswith("TURBOSERVE_"), var
        assert var.removeprefix("TURBOSERVE_").lower() in fields, f"{name}: {var} is no setting"
    # each service connects as its own user, with a password the operator must set
    upper = name.upper()
    assert env["TURBOSERVE_NATS_URL"] == f"nats://{name}:${{NATS_{upper}_PASSWORD:?}}@nats:4222"
    assert env["TURBOSERVE_REDIS_URL"] == (
        f"redis://{name}:${{REDIS_{upper}_PASSWORD:?}}@redis:6379/0"
    )
    with pytest.raises(KeyError, match=f"NATS_{upper}_PASSWORD"):
        interpolate(env["TURBOSERVE_NATS_URL"], {})
    # the values as the container sees them must pass the service's own validation
    settings = SETTINGS[name].from_env({k: interpolate(str(v), SECRETS) for k, v in env.items()})
    assert settings.nats_url == f"nats://{name}:nats-{name}-pw@nats:4222"
    assert f"nats-{name}-pw" not in str(settings)  # and are masked when printed


def test_the_gateway_starts_closed(compose):
    """Compose refuses to start the gateway without API keys, and the keys reach it."""
    env = compose["services"]["gateway"]["environment"]
    with pytest.raises(KeyError, match="TURBOSERVE_API_KEYS"):
        interpolate(env["TURBOSERVE_API_KEYS"], {})
    settings = GatewaySettings.from_env({k: interpolate(str(v), SECRETS) for k, v in env.items()})
    assert settings.api_key_map() == {"ops": "compose-key-1"}


def test_provisioner_starts_workers_with_the_workers_credentials(compose):
    env = compose["services"]["provisioner"]["environment"]
    assert env["TURBOSERVE_WORKER_NATS_URL"] == "nats://worker:${NATS_WORKER_PASSWORD:?}@nats:4222"
    assert env["TURBOSERVE_WORKER_REDIS_URL"] == (
        "redis://worker:${REDIS_WORKER_PASSWORD:?}@redis:6379/0"
    )


def compose_auth(compose: dict) -> tuple[str, str]:
    """The NATS authorization and the Redis users compose.yaml holds, uninterpolated."""
    configs = compose["configs"]
    return configs["nats_auth"]["content"], configs["redis_users"]["content"]


def test_auth_configs_are_the_generated_ones(compose):
    """compose.yaml carries shared/security.py's output for its prefix and namespace, with
    each password a required variable and every other "$" escaped."""
    common = compose["x-turboserve-env"]
    marks = {role: f"@{role}@" for role in ROLES}
    nats = nats_authorization(Subjects(common["TURBOSERVE_SUBJECT_PREFIX"]), marks)
    redis = "\n".join(redis_users(common["TURBOSERVE_REDIS_NAMESPACE"], marks)) + "\n"
    nats = nats.replace("$", "$$")
    for role in ROLES:
        nats = nats.replace(f"@{role}@", f"${{NATS_{role.upper()}_PASSWORD:?}}")
        redis = redis.replace(f"@{role}@", f"${{REDIS_{role.upper()}_PASSWORD:?}}")
    assert compose_auth(compose) == (nats, redis)
    as_deployed = interpolate(compose_auth(compose)[0], SECRETS)
    assert '"$JS.API.STREAM.CREATE.ts_SESSIONS"' in as_deployed
    assert 'password: "nats-gateway-pw"' in as_deployed


def test_servers_load_the_auth_configs(compose):
    nats, redis = compose["services"]["nats"], compose["services"]["redis"]
    limits, auth = nats["configs"]
    assert (limits["source"], auth["source"]) == ("nats_limits", "nats_auth")
    assert nats["command"][nats["command"].index("--config") + 1] == limits["target"]
    included = compose["configs"]["nats_limits"]["content"].splitlines()[-1]
    assert included == f"include ./{Path(auth['target']).name}"
    assert Path(auth["target"]).parent == Path(limits["target"]).parent
    [redis_config] = redis["configs"]
    assert redis_config["source"] == "redis_users"
    assert redis["command"][:2] == ["redis-server", redis_config["target"]]


def test_nats_carries_the_chunks_with_the_limits_the_code_computes(compose):
    """max_payload and the JetStream memory are shared/video.py's for the default bitrate and
    sessions, so the chunk stream's resume window fits and a chunk fits one message."""
    env = compose["x-turboserve-env"]
    settings = CommonSettings.from_env({k: str(v) for k, v in env.items()})
    content = compose["configs"]["nats_limits"]["content"]
    assert content == nats_limits_config(ChunkRetention.of(settings)) + "include ./auth.conf\n"
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
