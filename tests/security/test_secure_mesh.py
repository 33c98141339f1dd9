"""The stack ``turboserve up`` starts when it starts its own NATS and Redis: TLS with client
certificates to both, every service on its own user, and a session still does everything a viewer and an operator do with it (stream,
steer, migrate between workers, close) without one permission violation or one secret in a
log."""

from __future__ import annotations

import asyncio
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from shared.runner import close_context, open_context
from shared.settings import CommonSettings
from shared.wire import WorkerStatus
from tests.eventually import eventually
from tests.gateway.conftest import API_KEY, OPERATOR_KEY, bearer
from tools.ctl import Ctl
from tools.launcher import Mesh
from tools.servers import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TAG = "secmesh"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory) -> Iterator[tuple[Mesh, Path]]:
    logs = tmp_path_factory.mktemp("logs")
    m = Mesh(
        embedded="always",
        secure=True,
        tls=True,
        port=free_port(),
        workers=2,
        quiet=True,
        log_dir=logs,
        env={
            "TURBOSERVE_SUBJECT_PREFIX": TAG,
            "TURBOSERVE_REDIS_NAMESPACE": TAG,
            "TURBOSERVE_LOG_LEVEL": "info",
            "TURBOSERVE_CHUNK_PERIOD_S": "0.3",
            "TURBOSERVE_EMULATE": "",
            "TURBOSERVE_MAX_WORKERS": "2",
            "TURBOSERVE_API_KEYS": f"alice:{API_KEY}",
            "TURBOSERVE_OPERATOR_KEY": OPERATOR_KEY,
            "TURBOSERVE_CONTROL_WAIT_S": "20",
        },
    )
    m.start(ready_timeout=180)
    try:
        yield m, logs
    finally:
        assert m.tmpdir is not None
        shutil.copy(m.tmpdir / "nats.log", logs / "nats-server.log")  # stop() removes it
        shutil.copy(m.tmpdir / "redis.log", logs / "redis-server.log")
        m.stop()


async def chunk_ids(resp: aiohttp.ClientResponse, want: int, timeout: float = 120.0) -> list[int]:
    seqs: list[int] = []
    event = ""
    async with asyncio.timeout(timeout):
        async for raw in resp.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("id: ") and event == "chunk":
                seqs.append(int(line[4:]))
                if len(seqs) >= want:
                    return seqs
    return seqs


async def test_a_session_lives_its_whole_life_on_the_secured_stack(mesh):
    m, logs = mesh
    async with aiohttp.ClientSession(m.gateway_url) as http:
        resp = await http.post(
            "/v1/sessions", json={"prompt": "a kite over dunes", "seed": 4}, headers=bearer(API_KEY)
        )
        assert resp.status == 201, await resp.text()
        session = await resp.json()
        sid, token = session["id"], session["token"]
        async with http.get(f"/v1/sessions/{sid}/stream", headers=bearer(token)) as stream:
            assert await chunk_ids(stream, 2) == [0, 1]
            resp = await http.post(
                f"/v1/sessions/{sid}/prompt", json={"prompt": "a storm"}, headers=bearer(token)
            )
            assert resp.status == 200 and (await resp.json())["confirmed"], await resp.text()
            # the operator moves it to the other worker: worker-to-worker handoff traffic
            assert m.nats_url.startswith("tls://") and m.redis_url.startswith("rediss://")
            assert m.tls_files is not None
            settings = CommonSettings(
                nats_url=m.nats_url,
                redis_url=m.redis_url,
                subject_prefix=TAG,
                redis_namespace=TAG,
                tls_ca_file=m.tls_files.ca_file,
                tls_cert_file=m.tls_files.cert_file,
                tls_key_file=m.tls_files.key_file,
            )
            ctx = await open_context(settings, "test-operator")
            try:
                ctl = Ctl(ctx)

                async def two_ready() -> bool:
                    return (
                        len(
                            [
                                w
                                for w in await ctx.registry.workers()
                                if w.alive and w.status is WorkerStatus.READY
                            ]
                        )
                        >= 2
                    )

                # the second worker may still be booting
                await eventually(two_ready, 120, "the second worker ready", interval=0.2)
                record = await ctx.registry.get_session(sid)
                others = [w.id for w in await ctx.registry.workers() if w.id != record.owner]
                assert len(others) == 1
                report = await ctl.migrate(sid, others[0], wait_s=60)
                assert report["ok"] and report["dst"] == others[0]
            finally:
                await close_context(ctx)
            after = await chunk_ids(stream, 2)
            assert after[0] > 1 and after[1] == after[0] + 1
        resp = await http.delete(f"/v1/sessions/{sid}", headers=bearer(token))
        assert resp.status == 200

        def stopped_at_a_worker() -> bool:
            return any(
                "session_dropped" in line and sid in line and "stopped" in line
                for log in logs.glob("worker-*.log")
                for line in log.read_text(errors="replace").splitlines()
            )

        await eventually(stopped_at_a_worker, 30, "the stop at the worker")
    nats_log = (m.tmpdir / "nats.log").read_text(errors="replace")
    assert not re.findall(r".*(?:Violation|authentication error).*", nats_log)
    secrets = [*m.credentials.nats.values(), *m.credentials.redis.values()]
    for log in logs.glob("*.log"):
        text = log.read_text(errors="replace")
        assert "permissions violation" not in text.lower(), log.name
        assert "NOPERM" not in text, log.name
        assert not [s for s in secrets if s in text], f"a password in {log.name}"
