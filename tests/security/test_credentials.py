"""Services with wrong credentials are refused (exit code 2, one clear line, no secret), and
every place settings or URLs are printed masks the secrets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.security import OPERATOR, with_user
from shared.settings import GatewaySettings, ProvisionerSettings, SettingsError, WorkerSettings
from tests.eventually import eventually_sync
from tests.security.conftest import PREFIX
from tools.launcher import banner

pytestmark = pytest.mark.integration

WRONG = "wrong-secret-4b1d9e"


def _service_env(mesh, name: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURBOSERVE_")}
    return {
        **env,
        **mesh.service_env(name),
        "TURBOSERVE_SUBJECT_PREFIX": PREFIX,
        "TURBOSERVE_REDIS_NAMESPACE": PREFIX,
        "TURBOSERVE_LOG_FORMAT": "json",
        "TURBOSERVE_CONNECT_TIMEOUT_S": "60",
        "TURBOSERVE_PORT": "0",
        "TURBOSERVE_MIN_WORKERS": "0",
        "TURBOSERVE_GPUS": "none",
        **extra,
    }


@pytest.mark.parametrize(
    ("service", "server"),
    [
        ("gateway", "nats"),
        ("scheduler", "nats"),
        ("provisioner", "nats"),
        ("worker", "nats"),
        ("gateway", "redis"),
        ("scheduler", "redis"),
    ],
)
def test_a_service_with_a_wrong_password_stops_at_once_with_exit_2(secure_infra, service, server):
    var = f"TURBOSERVE_{server.upper()}_URL"
    env = _service_env(secure_infra, service)
    env[var] = with_user(secure_infra.secured[server], service, WRONG)
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "tools.cli", service], env=env, capture_output=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr.decode()[-2000:]
    assert time.monotonic() - started < 45  # not after the 60 s connect timeout
    output = (proc.stdout + proc.stderr).decode()
    assert WRONG not in output
    failed = [
        json.loads(line)
        for line in output.splitlines()
        if line.startswith("{") and '"startup_failed"' in line
    ]
    assert len(failed) == 1, output[-2000:]
    assert f"{server} at {server}://{service}:***@" in failed[0]["error"]
    assert f"refused the credentials of user '{service}'" in failed[0]["error"]
    assert var in failed[0]["error"]


def test_a_running_service_logs_its_settings_masked(secure_infra, tmp_path):
    env = _service_env(secure_infra, "provisioner", TURBOSERVE_METRICS_PORT="-1")
    secrets = [
        secure_infra.credentials.nats["provisioner"],
        secure_infra.credentials.redis["provisioner"],
        secure_infra.credentials.redis["worker"],
        secure_infra.credentials.callout.text(),
    ]
    out = open(tmp_path / "provisioner.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "tools.cli", "provisioner"],
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    try:

        def ready() -> bool:
            if proc.poll() is not None:
                pytest.fail((tmp_path / "provisioner.log").read_text()[-2000:])
            return b"provisioner_ready" in (tmp_path / "provisioner.log").read_bytes()

        eventually_sync(ready, 60, "the provisioner ready")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        out.close()
    text = (tmp_path / "provisioner.log").read_text()
    assert not [s for s in secrets if s in text]
    [started] = [json.loads(line) for line in text.splitlines() if '"service_started"' in line]
    settings = started["settings"]
    assert settings["nats_url"].startswith("nats://provisioner:***@")
    assert settings["redis_url"].startswith("redis://provisioner:***@")
    # NATS users per worker, made at each launch: the URL the workers get carries none
    assert "@" not in settings["worker_nats_url"]
    assert settings["callout_key"] == "***"
    assert settings["worker_redis_url"].startswith("redis://worker:***@")


def test_settings_mask_every_url_and_secret():
    secret = "s3cr3t-value"
    worker = ProvisionerSettings.from_env(
        {
            "TURBOSERVE_NATS_URL": f"nats://provisioner:{secret}@nats:4222",
            "TURBOSERVE_REDIS_URL": f"redis://provisioner:{secret}@redis:6379/0",
            "TURBOSERVE_WORKER_NATS_URL": f"nats://worker:{secret}@nats:4222",
            "TURBOSERVE_WORKER_REDIS_URL": f"redis://worker:{secret}@redis:6379/0",
        }
    )
    gateway = GatewaySettings.from_env(
        {
            "TURBOSERVE_NATS_URL": f"nats://{secret}@nats:4222",
            "TURBOSERVE_API_KEYS": f"alice:{secret}",
            "TURBOSERVE_OPERATOR_KEY": secret,
        }
    )
    for settings in (worker, gateway):
        for text in (str(settings), repr(settings), json.dumps(settings.public_dict())):
            assert secret not in text
    assert worker.public_dict()["worker_nats_url"] == "nats://worker:***@nats:4222"
    # a refused value is named masked in the error
    for var in ("TURBOSERVE_NATS_URL", "TURBOSERVE_WORKER_NATS_URL", "TURBOSERVE_WORKER_REDIS_URL"):
        with pytest.raises(SettingsError) as refused:
            ProvisionerSettings.from_env({var: f"http://u:{secret}@somewhere"})
        assert var in str(refused.value) and secret not in str(refused.value)
    with pytest.raises(SettingsError) as refused:
        WorkerSettings.from_env({"TURBOSERVE_REDIS_URL": f"http://u:{secret}@somewhere"})
    assert secret not in str(refused.value)


def test_the_banner_masks_the_urls_and_says_what_is_secured(secure_infra):
    text = banner("http://127.0.0.1:8080", secure_infra, "api-key", "op-key", Path("/tmp/logs"))
    for password in (
        *secure_infra.credentials.nats.values(),
        *secure_infra.credentials.redis.values(),
    ):
        assert password not in text
    assert f"NATS nats://{OPERATOR}:***@127.0.0.1:" in text
    assert "started here, a user per service" in text
    assert "reused" not in text
    assert "Credentials" in repr(secure_infra.credentials)
    assert not [
        p for p in secure_infra.credentials.nats.values() if p in repr(secure_infra.credentials)
    ]


def test_the_banner_says_when_it_reuses_a_server_it_cannot_secure(infra):
    text = banner("http://127.0.0.1:8080", infra, None, None, None)
    for server in ("NATS", "Redis"):
        [line] = [line for line in text.splitlines() if line.startswith(server + " ")]
        if server.lower() in {name for name, _ in infra.procs}:
            assert "started here, open to any local client" in line  # the tests' own servers
        else:
            assert "reused as it is (turboserve up cannot secure a server it did not start" in line


def test_a_traceback_on_the_console_shows_no_local_variable():
    """A logged exception's frames may hold a key or a token: the console shows none."""
    script = (
        "from shared.logging import configure_logging, get_logger\n"
        "configure_logging('info', 'console')\n"
        "def handler():\n"
        f"    token = '{WRONG}'\n"
        "    raise ValueError('boom')\n"
        "try:\n"
        "    handler()\n"
        "except ValueError:\n"
        "    get_logger().error('request_failed', exc_info=True)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )
    output = (proc.stdout + proc.stderr).decode()
    assert "request_failed" in output and "ValueError" in output and "handler" in output
    assert WRONG not in output
