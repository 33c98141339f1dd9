"""The tools' settings (``ToolSettings``) and how ``ctl`` finds its mesh through them."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.settings import DEFAULT_NATS_URL, DEFAULT_REDIS_URL, SettingsError, ToolSettings
from tools.ctl import CtlError, resolve_mesh


def test_defaults_are_this_hosts_servers_and_the_home_state_folder() -> None:
    settings = ToolSettings.from_env({})
    assert (settings.nats_url, settings.redis_url) == (DEFAULT_NATS_URL, DEFAULT_REDIS_URL)
    assert settings.state_path == Path.home() / ".turboserve"
    assert (settings.port, settings.min_workers, settings.max_workers) == (8080, 1, 8)


def test_values_come_from_the_environment(tmp_path: Path) -> None:
    settings = ToolSettings.from_env(
        {
            "TURBOSERVE_STATE_DIR": str(tmp_path),
            "TURBOSERVE_PORT": "9000",
            "TURBOSERVE_EMULATE": "H20",
        }
    )
    assert settings.state_path == tmp_path
    assert (settings.port, settings.emulate) == (9000, "H20")


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("TURBOSERVE_PORT", "70000"),
        ("TURBOSERVE_PORT", "http"),
        ("TURBOSERVE_MAX_WORKERS", "0"),
        ("TURBOSERVE_BOOT_TIMEOUT_S", "-1"),
        ("TURBOSERVE_NATS_URL", "http://nats:4222"),
    ],
)
def test_a_bad_value_is_an_error_naming_its_variable(var: str, value: str) -> None:
    with pytest.raises(SettingsError, match=var):
        ToolSettings.from_env({var: value})


def test_keys_are_masked_when_printed() -> None:
    settings = ToolSettings.from_env(
        {"TURBOSERVE_API_KEY": "client-secret-1", "TURBOSERVE_OPERATOR_KEY": "operator-secret-2"}
    )
    assert settings.api_key == "client-secret-1"
    assert "secret" not in str(settings)


def test_given_tells_a_set_variable_from_a_default() -> None:
    env = {"TURBOSERVE_NATS_URL": "nats://nats:4222", "TURBOSERVE_REDIS_URL": "", "OTHER": "x"}
    assert ToolSettings.given(env) == {"nats_url"}


def test_ctl_talks_to_the_mesh_the_environment_names(tmp_path: Path) -> None:
    env = {
        "TURBOSERVE_NATS_URL": "nats://nats.example:4222",
        "TURBOSERVE_REDIS_URL": "redis://redis.example:6379/0",
        "TURBOSERVE_STATE_DIR": str(tmp_path),
        "TURBOSERVE_SUBJECT_PREFIX": "px",
    }
    mesh = resolve_mesh(env=env)
    assert mesh.settings.nats_url == "nats://nats.example:4222"
    assert mesh.settings.subject_prefix == "px"
    assert "from TURBOSERVE_NATS_URL and TURBOSERVE_REDIS_URL" in mesh.source
    flagged = resolve_mesh(redis_url="redis://other:6379/0", env=env)
    assert flagged.settings.redis_url == "redis://other:6379/0"
    assert "--redis-url" in flagged.source


def test_ctl_never_falls_back_to_a_default_address(tmp_path: Path) -> None:
    with pytest.raises(CtlError, match="no mesh to talk to"):
        resolve_mesh(env={"TURBOSERVE_STATE_DIR": str(tmp_path)})
