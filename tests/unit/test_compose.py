"""Docker cannot run here: check compose.yaml and the Dockerfile by reading them."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from shared.settings import GatewaySettings, ProvisionerSettings, SchedulerSettings, WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {"gateway": GatewaySettings, "scheduler": SchedulerSettings, "worker": WorkerSettings,
            "provisioner": ProvisionerSettings}


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
    assert svc["build"]["dockerfile"] == "Dockerfile" and (ROOT / svc["build"]["context"] / "Dockerfile").exists()
    assert svc["command"] == [name]
    assert svc["depends_on"] == {"nats": {"condition": "service_healthy"},
                                 "redis": {"condition": "service_healthy"}}
    assert "container_name" not in svc, "a fixed container name prevents --scale"


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_environment_names_real_settings(compose, name):
    env = compose["services"][name]["environment"]
    fields = {f.name for f in dataclasses.fields(SETTINGS[name])}
    for var in env:
        assert var.startswith("TURBOSERVE_"), var
        assert var.removeprefix("TURBOSERVE_").lower() in fields, f"{name}: {var} is no setting"
    assert env["TURBOSERVE_NATS_URL"] == "nats://nats:4222"
    assert env["TURBOSERVE_REDIS_URL"].startswith("redis://redis:6379")
    # the values must pass the service's own validation
    SETTINGS[name].from_env({k: str(v) for k, v in env.items()})


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
    assert "pip install ." in text
    assert "cpu" not in re.findall(r'ARG TORCH_SPEC="([^"]*)"', text)[0]  # users have GPUs
