"""The whole mesh as `turboserve up` runs it: four services as processes, a CPU worker with
torch, and a real HTTP/SSE client."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import signal
import subprocess
import sys
import urllib.request
from typing import Any

import aiohttp
import pytest
from PIL import Image

from shared.registry import Registry
from shared.states import SessionState
from tests.eventually import eventually, eventually_sync
from tools.launcher import Mesh
from tools.servers import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture
def mesh(infra, isolation, nats_client):  # nats_client: deletes this test's streams afterwards
    m = Mesh(
        nats_url=infra.nats_url,
        redis_url=infra.redis_url,
        port=free_port(),
        workers=1,
        embedded="never",
        env={**isolation, "TURBOSERVE_LOG_LEVEL": "warning", "TURBOSERVE_CHUNK_PERIOD_S": "0.2"},
        quiet=True,
    )
    m.start(ready_timeout=120)
    yield m
    m.stop()


async def read_sse(resp: aiohttp.ClientResponse, want: int, timeout: float = 90.0) -> list[dict]:
    """Parse SSE events (event/id/data) until ``want`` events or an end event. Lifecycle
    events (``event: state``) are left out: how many come depends on the placement."""
    events: list[dict] = []
    current: dict = {}
    async with asyncio.timeout(timeout):
        async for raw in resp.content:
            line = raw.decode().rstrip("\n")
            if not line:
                # not the "retry:" preamble
                if ("event" in current or "data" in current) and current.get("event") != "state":
                    events.append(current)
                    if len(events) >= want or current.get("event") == "end":
                        return events
                current = {}
                continue
            if line.startswith(":"):
                continue
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "data" and "data" in current:  # an event's lines, joined as SSE says
                value = current["data"] + "\n" + value
            current[field] = value
    return events


async def test_session_streams_end_to_end(mesh, redis_client, isolation):
    import orjson

    registry = Registry(redis_client, isolation["TURBOSERVE_REDIS_NAMESPACE"])
    async with aiohttp.ClientSession(mesh.gateway_url) as http:
        resp = await http.post(
            "/v1/sessions", json={"prompt": "a paper boat on a river", "seed": 11}
        )
        assert resp.status == 201
        session = await resp.json()
        sid = session["id"]
        auth = {"Authorization": f"Bearer {session['token']}"}  # the session's own token

        async with http.get(session["stream_url"], headers=auth) as stream:
            assert stream.status == 200
            assert stream.headers["Content-Type"].startswith("text/event-stream")
            events = [e for e in await read_sse(stream, want=4) if e.get("event") == "chunk"]
        assert len(events) >= 3
        seqs = [int(e["id"]) for e in events]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
        assert seqs[0] == 0
        data = orjson.loads(events[0]["data"])
        assert data["seq"] == 0 and data["session_id"] == sid and data["encoding"] == "jpeg/base64"
        assert data["timing"]["gen_ms"] > 0 and data["timing"]["batch"] >= 1
        image = Image.open(io.BytesIO(base64.b64decode(data["frames"][0])))
        assert image.format == "JPEG" and image.size == (data["width"], data["height"])

        # Reconnecting with Last-Event-ID resumes after what the client has.
        async with http.get(
            session["stream_url"], headers={**auth, "Last-Event-ID": str(seqs[-1])}
        ) as again:
            resumed = [e for e in await read_sse(again, want=1) if e.get("event") == "chunk"]
        assert int(resumed[0]["id"]) == seqs[-1] + 1

        state = await (await http.get(f"/v1/sessions/{sid}", headers=auth)).json()
        assert state["state"] == "executing" and state["worker_id"]

        resp = await http.delete(f"/v1/sessions/{sid}", headers=auth)
        assert resp.status == 200

        async def terminated() -> bool:
            state = (await registry.get_session(sid)).state
            assert state is SessionState.TERMINATED, f"the session is {state}"
            return True

        await eventually(terminated, 20, "the session terminated")
        record = await registry.get_session(sid)
        assert record.last_seq >= seqs[-1]
        assert sid not in await registry.placement()

        # A stream of a closed session ends at once.
        async with http.get(
            session["stream_url"], headers={**auth, "Last-Event-ID": str(record.last_seq)}
        ) as closed:
            tail = await read_sse(closed, want=1, timeout=10)
        assert tail[-1]["event"] == "end"


async def test_bad_requests_get_stable_codes(mesh):
    async with aiohttp.ClientSession(mesh.gateway_url) as http:
        resp = await http.post(
            "/v1/sessions", data=b"{not json", headers={"Content-Type": "application/json"}
        )
        assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_json"
        resp = await http.post("/v1/sessions", json={"prompt": ""})
        assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_request"
        resp = await http.post("/v1/sessions", json={"prompt": "x" * 5000})
        body = await resp.json()
        assert resp.status == 400 and body["error"]["code"] == "prompt_too_long"
        assert body["error"]["details"] == {"length": 5000, "limit": 2000}
        resp = await http.post("/v1/sessions", json=["a list"])
        assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_json"
        for path in ("/v1/sessions/0123456789abcdef", "/v1/sessions/bad.id/stream"):
            resp = await http.get(path)
            assert (
                resp.status == 404 and (await resp.json())["error"]["code"] == "session_not_found"
            )
        resp = await http.delete("/v1/sessions/missing")
        assert resp.status == 404
        resp = await http.get("/v1/nothing")
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "not_found"
        resp = await http.put("/v1/sessions")
        assert resp.status == 405 and (await resp.json())["error"]["code"] == "method_not_allowed"
        assert (await http.get("/healthz")).status == 200


async def test_garbage_to_worker_is_dropped_and_it_keeps_serving(mesh, nats_client, isolation):
    from shared.wire import Subjects

    subjects = Subjects(isolation["TURBOSERVE_SUBJECT_PREFIX"])
    async with aiohttp.ClientSession(mesh.gateway_url) as http:
        first = await (await http.post("/v1/sessions", json={"prompt": "one"})).json()
        first_auth = {"Authorization": f"Bearer {first['token']}"}

        async def first_placed() -> dict[str, Any] | None:
            rec = await (await http.get(f"/v1/sessions/{first['id']}", headers=first_auth)).json()
            return rec if rec["worker_id"] else None

        rec = await eventually(first_placed, 60, "the first session on a worker")
        worker_id = rec["worker_id"]
        for junk in (
            b"garbage",
            b"{}",
            b'{"type":"worker_cmd","kind":"assign","worker_id":"../x"}',
        ):
            await nats_client.publish(subjects.worker_cmd(worker_id), junk)
            await nats_client.publish(subjects.session_events, junk)
            await nats_client.publish(subjects.provisioner_cmd, junk)
        # Valid commands the engine must refuse (a second SUSPEND, a RESUME of a running
        # session): logged and dropped, never fatal.
        from shared.wire import WorkerCmdKind, WorkerCommand, encode

        for kind in (
            WorkerCmdKind.SUSPEND,
            WorkerCmdKind.SUSPEND,
            WorkerCmdKind.RESUME,
            WorkerCmdKind.RESUME,
        ):
            cmd = WorkerCommand(
                kind=kind, worker_id=worker_id, epoch=rec["epoch"], session_id=first["id"]
            )
            await nats_client.publish(subjects.worker_cmd(worker_id), encode(cmd))
        await nats_client.flush()
        second = await (await http.post("/v1/sessions", json={"prompt": "two"})).json()
        async with http.get(
            second["stream_url"], headers={"Authorization": f"Bearer {second['token']}"}
        ) as stream:
            events = [e for e in await read_sse(stream, want=2) if e.get("event") == "chunk"]
        assert [int(e["id"]) for e in events] == [0, 1]
        assert not mesh.exited()
    # SIGTERM: every service drains and exits 0
    assert mesh.stop() == {"gateway": 0, "provisioner": 0, "scheduler": 0}


def test_up_then_sigint_leaves_no_process(infra, isolation, nats_client, tmp_path):
    """`turboserve up` as a user runs it; SIGINT stops every process it started."""
    port = free_port()
    env = {
        **os.environ,
        **isolation,
        "TURBOSERVE_NATS_URL": infra.nats_url,
        "TURBOSERVE_REDIS_URL": infra.redis_url,
        "TURBOSERVE_LOG_LEVEL": "warning",
        "TURBOSERVE_STATE_DIR": str(tmp_path / "state"),
    }
    log = open(tmp_path / "up.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "tools.cli", "up", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:

        def banner_shown() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"turboserve up exited: {(tmp_path / 'up.log').read_text()}")
            return b"Try it" in (tmp_path / "up.log").read_bytes()

        eventually_sync(banner_shown, 120, "the banner", interval=0.2)
        # The banner comes once a worker can take a session, and says so.
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as resp:
            ready = json.loads(resp.read())
        assert resp.status == 200 and ready["workers_ready"] >= 1
        assert "Workers: the first one is ready (" in (tmp_path / "up.log").read_text()

        # gateway, scheduler, provisioner, and the worker the provisioner starts
        def four_processes() -> list[int]:
            children = _descendants(proc.pid)
            assert len(children) >= 4, children
            return children

        children = eventually_sync(four_processes, 60, "four processes under turboserve up")
        # The state file `turboserve ctl` finds it by, the keys in the banner, logs in files.
        state = json.loads((tmp_path / "state" / "up.json").read_text())
        assert state["gateway_url"] == f"http://127.0.0.1:{port}"
        banner = (tmp_path / "up.log").read_text()
        assert f"API key: {state['api_key']}" in banner and state["api_key"]
        assert f"Operator key: {state['operator_key']}" in banner
        assert (tmp_path / "state" / "logs" / "gateway.log").exists()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert not (tmp_path / "state" / "up.json").exists()
        alive = [pid for pid in children if _alive(pid)]
        assert alive == [], f"orphans left: {alive}"
        assert f"curl -N http://127.0.0.1:{port}/v1/sessions/" in (tmp_path / "up.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(
        ["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True, check=True
    ).stdout
    parent_of = {int(a): int(b) for a, b in (line.split() for line in out.strip().splitlines())}
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent_of.items() if pp == p]
        found += kids
        frontier += kids
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie waiting for its reaper is gone for our purpose
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
