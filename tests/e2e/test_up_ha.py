"""`turboserve up --ha` as a user runs it: three NATS nodes as one JetStream cluster, a Redis
primary with two replicas and three sentinels, the mesh on top of them; a session streams
through a real HTTP/SSE client, and SIGINT stops every process it started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import aiohttp
import nats
import pytest

from shared.runner import redis_client
from shared.settings import nats_servers
from shared.tls import TlsFiles, nats_tls_kwargs
from shared.wire import Subjects
from tests.e2e.test_mesh import _alive, _descendants, read_sse
from tests.eventually import eventually_sync
from tools.servers import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture
def up_ha(tmp_path):
    """``turboserve up --ha`` as a process, once its banner is out: (process, log, state)."""
    port = free_port()
    env = {
        **os.environ,
        "TURBOSERVE_LOG_LEVEL": "warning",
        "TURBOSERVE_STATE_DIR": str(tmp_path / "state"),
        "TURBOSERVE_CHUNK_PERIOD_S": "0.2",
    }
    log_path = tmp_path / "up.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tools.cli", "up", "--ha", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:

        def banner_shown() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"turboserve up --ha exited: {log_path.read_text()}")
            return b"Try it" in log_path.read_bytes()

        eventually_sync(banner_shown, 180, "the banner", interval=0.2)
        yield proc, log_path, json.loads((tmp_path / "state" / "up.json").read_text())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_up_ha_runs_the_mesh_on_clustered_brokers(up_ha):
    proc, log_path, state = up_ha
    banner = log_path.read_text()
    assert "NATS: a 3-node JetStream cluster started here" in banner
    assert "Redis: a primary, 2 replicas and 3 sentinels started here" in banner
    assert len(nats_servers(state["nats_url"])) == 3
    assert state["redis_url"].startswith("redis+sentinel://")
    tls = TlsFiles(state["tls_ca_file"], state["tls_cert_file"], state["tls_key_file"])

    # Every stream of the mesh has three replicas, one leader and two current followers.
    nc = await nats.connect(
        servers=nats_servers(state["nats_url"]), **nats_tls_kwargs(state["nats_url"], tls)
    )
    try:
        js = nc.jetstream()
        subjects = Subjects(state["subject_prefix"])
        for name in (subjects.sessions_stream, subjects.chunks_stream):
            info = await js.stream_info(name)
            assert info.config.num_replicas == 3, name
            assert info.cluster is not None and info.cluster.leader
            assert len(info.cluster.replicas or []) == 2
    finally:
        await nc.close()

    # The services' Redis is the primary the sentinels name, with both replicas attached.
    redis = redis_client(state["redis_url"], None)
    try:
        replication = await redis.info("replication")
        assert replication["role"] == "master"
        assert replication["connected_slaves"] == 2
    finally:
        await redis.aclose()

    async with aiohttp.ClientSession(state["gateway_url"]) as http:
        resp = await http.post(
            "/v1/sessions",
            json={"prompt": "a lighthouse at dusk", "seed": 5},
            headers={"Authorization": f"Bearer {state['api_key']}"},
        )
        assert resp.status == 201, await resp.text()
        session = await resp.json()
        auth = {"Authorization": f"Bearer {session['token']}"}
        async with http.get(session["stream_url"], headers=auth) as stream:
            events = [e for e in await read_sse(stream, want=3) if e.get("event") == "chunk"]
    assert [int(e["id"]) for e in events] == [0, 1, 2]

    children = _descendants(proc.pid)
    assert len(children) >= 13  # nine brokers, three services and a worker
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=90) == 0
    assert "sentinel1, redis3, redis2, redis1, nats3, nats2, nats1" in log_path.read_text()
    assert [pid for pid in children if _alive(pid)] == []
