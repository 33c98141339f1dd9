"""The gateway against the real mesh (`Mesh`, as `turboserve up` runs it: scheduler,
provisioner, a CPU worker with the tiny model, the gateway): steering over a WebSocket, state
events over SSE, the cluster view, lifetimes and admission.

One mesh for the module (starting one takes a while on a small machine): one worker with two
session slots, a pool of at most one worker, short lifetimes. The tests run in file order and
each leaves no session open, so the admission test at the end starts from an empty worker.
"""

from __future__ import annotations

import asyncio
import io
import uuid
from collections.abc import Iterator

import aiohttp
import orjson
import pytest
from PIL import Image

from shared.registry import Registry
from shared.states import SessionState
from tests.eventually import eventually
from tests.gateway.conftest import API_KEY, OPERATOR_KEY, bearer, read_sse
from tests.gateway.test_streams import decode_chunk
from tools.launcher import Mesh
from tools.servers import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

IDLE_AFTER_S = 3.0
CLOSE_AFTER_S = 3.0


@pytest.fixture(scope="module")
def mesh_tag() -> str:
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture(scope="module")
def mesh(infra, mesh_tag) -> Iterator[Mesh]:
    m = Mesh(
        nats_url=infra.nats_url,
        redis_url=infra.redis_url,
        port=free_port(),
        workers=1,
        embedded="never",
        quiet=True,
        env={
            "TURBOSERVE_SUBJECT_PREFIX": mesh_tag,
            "TURBOSERVE_REDIS_NAMESPACE": mesh_tag,
            "TURBOSERVE_LOG_LEVEL": "warning",
            "TURBOSERVE_CHUNK_PERIOD_S": "0.3",
            "TURBOSERVE_API_KEYS": f"alice:{API_KEY}",
            "TURBOSERVE_OPERATOR_KEY": OPERATOR_KEY,
            "TURBOSERVE_MAX_WORKERS": "1",
            "TURBOSERVE_MAX_SESSIONS": "2",
            "TURBOSERVE_IDLE_AFTER_S": str(IDLE_AFTER_S),
            "TURBOSERVE_CLOSE_AFTER_S": str(CLOSE_AFTER_S),
            "TURBOSERVE_ATTACH_TTL_S": "3",
            "TURBOSERVE_REAP_INTERVAL_S": "0.3",
            "TURBOSERVE_CONTROL_WAIT_S": "20",
        },
    )
    m.start(ready_timeout=180)
    yield m
    m.stop()
    asyncio.run(_clean(infra, mesh_tag))


async def _clean(infra, tag: str) -> None:
    import nats
    import redis.asyncio as aioredis

    from shared.wire import Subjects

    nc = await nats.connect(infra.nats_url)
    subjects = Subjects(tag)
    for stream in (subjects.sessions_stream, subjects.chunks_stream):
        try:
            await nc.jetstream().delete_stream(stream)
        except Exception:  # noqa: BLE001 - may not exist
            pass
    await nc.close()
    client = aioredis.from_url(infra.redis_url, socket_timeout=30)
    keys = [k async for k in client.scan_iter(match=f"{tag}:*", count=500)]
    if keys:
        await client.delete(*keys)
    await client.aclose()


@pytest.fixture
async def registry(infra, mesh_tag):
    import redis.asyncio as aioredis

    client = aioredis.from_url(infra.redis_url, socket_timeout=30)
    yield Registry(client, mesh_tag)
    await client.aclose()


async def wait_state(
    registry: Registry, sid: str, state: SessionState, within_s: float = 60
) -> None:
    async def reached() -> bool:
        record = await registry.get_session(sid)
        assert record is not None and record.state is state, (
            f"the session is {record and record.state}"
        )
        return True

    await eventually(reached, within_s, f"the session {state.value}")


async def next_text(ws, kind: str, within_s: float = 60) -> dict:
    async with asyncio.timeout(within_s):
        while True:
            msg = await ws.receive()
            assert msg.type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY), msg
            if (
                msg.type is aiohttp.WSMsgType.TEXT
                and (body := orjson.loads(msg.data))["type"] == kind
            ):
                return body


async def next_chunk(ws, within_s: float = 60) -> dict:
    async with asyncio.timeout(within_s):
        while True:
            msg = await ws.receive()
            assert msg.type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY), msg
            if msg.type is aiohttp.WSMsgType.BINARY:
                header, frames = decode_chunk(msg.data)
                image = Image.open(io.BytesIO(frames[0]))
                assert image.format == "JPEG" and image.size == (header["width"], header["height"])
                return header


async def test_steer_a_live_session_over_a_websocket(mesh, registry):
    async with aiohttp.ClientSession(mesh.gateway_url) as http:
        resp = await http.post(
            "/v1/sessions", json={"prompt": "a paper boat", "seed": 3}, headers=bearer(API_KEY)
        )
        assert resp.status == 201
        s = await resp.json()
        async with http.ws_connect(s["ws_url"], params={"token": s["token"]}) as ws:
            placed = await next_text(ws, "state")
            assert placed["kind"] == "placed" and placed["next_seq"] == 0
            first = await next_chunk(ws)
            assert first["seq"] == 0 and first["timing"]["gen_ms"] > 0
            assert first["timing"]["steps"] == 4  # the model's full count: no budget asked

            await ws.send_str(
                orjson.dumps({"type": "prompt", "prompt": "a storm", "id": 1}).decode()
            )
            ack = await next_text(ws, "ack")
            assert ack["control"] == "prompt" and ack["confirmed"], ack
            assert ack["next_seq"] >= 1
            assert (await registry.get_session(s["id"])).prompt == "a storm"

            await ws.send_str('{"type": "pause", "id": 2}')
            ack = await next_text(ws, "ack")
            assert ack["control"] == "pause" and ack["confirmed"], ack
            await wait_state(registry, s["id"], SessionState.SUSPENDED)
            paused_at = ack["next_seq"]

            await ws.send_str('{"type": "resume", "id": 3}')
            ack = await next_text(ws, "ack")
            assert ack["control"] == "resume" and ack["confirmed"], ack
            chunk = await next_chunk(ws)
            assert chunk["seq"] >= paused_at  # it goes on where it stopped: no gap, no repeat

            await ws.send_str('{"type": "close", "id": 4}')
            assert (await next_text(ws, "ack"))["state"] == "terminated"
            assert (await next_text(ws, "end"))["reason"] == "closed"
        await wait_state(registry, s["id"], SessionState.TERMINATED)


async def test_sse_state_events_and_the_cluster_view(mesh, registry):
    async with aiohttp.ClientSession(mesh.gateway_url) as http:
        s = await (
            await http.post("/v1/sessions", json={"prompt": "a fox"}, headers=bearer(API_KEY))
        ).json()
        auth = bearer(s["token"])
        async with http.get(s["stream_url"], headers=auth) as stream:
            events = await read_sse(stream, want=3, timeout=90)
            assert [e["event"] for e in events] == ["state", "chunk", "chunk"]
            assert orjson.loads(events[0]["data"])["kind"] == "placed"
            resp = await http.post(
                f"/v1/sessions/{s['id']}/prompt", json={"prompt": "a wolf"}, headers=auth
            )
            body = await resp.json()
            assert (
                resp.status == 200
                and body["confirmed"]
                and body["next_seq"] > int(events[-1]["id"])
            )
            more = await read_sse(stream, want=20, timeout=90, until="state")
            notice = orjson.loads(more[-1]["data"])
            assert notice["kind"] == "prompt" and notice["next_seq"] == body["next_seq"]

            cluster = await (await http.get("/v1/cluster", headers=bearer(OPERATOR_KEY))).json()
            (worker,) = [w for w in cluster["workers"] if w["alive"]]
            assert s["id"] in [x["id"] for x in worker["sessions"]]
            assert (
                worker["status"] == "ready"
                and worker["capacity"] == 2
                and worker["load"] is not None
            )
            assert cluster["pool"]["max_workers"] == 1
            metrics = await (await http.get("/metrics")).text()
            assert 'turboserve_stream_clients{transport="sse"} 1.0' in metrics
        assert (await http.delete(f"/v1/sessions/{s['id']}", headers=auth)).status == 200


async def test_the_encoded_stream_from_a_real_worker_over_sse_and_the_websocket(mesh, registry):
    import base64

    from services.gpu_worker.fmp4 import decode_fragment
    from tests.gateway.test_fmp4_stream import ws_chunk

    async with aiohttp.ClientSession(mesh.gateway_url) as http:
        s = await (
            await http.post("/v1/sessions", json={"prompt": "a kite"}, headers=bearer(API_KEY))
        ).json()
        auth = bearer(s["token"])
        async with (
            http.get(s["stream_url"], params={"format": "fmp4"}, headers=auth) as stream,
            http.ws_connect(s["ws_url"], params={"token": s["token"], "format": "fmp4"}) as ws,
        ):
            events = [
                e for e in await read_sse(stream, want=4, timeout=90) if e["event"] == "chunk"
            ]
            got = []
            async with asyncio.timeout(90):
                while len(got) < 3:
                    msg = await ws.receive()
                    if msg.type is aiohttp.WSMsgType.BINARY:
                        got.append(ws_chunk(msg.data))
        assert (await http.delete(f"/v1/sessions/{s['id']}", headers=auth)).status == 200
    sse = [orjson.loads(e["data"]) for e in events]
    headers = [h for h, _ in got]
    for seqs in ([c["seq"] for c in sse], [h["seq"] for h in headers]):
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # consecutive
    fragments = [(c, base64.b64decode(c["fragment"])) for c in sse] + got
    for header, data in fragments:  # each alone, whichever came first
        frames, times = decode_fragment(data)
        assert frames.shape[0] > 0 and frames.shape[1:3] == (header["height"], header["width"])
        assert times[0] == pytest.approx(header["start_s"], abs=1e-4)
        assert header["timing"]["encode_ms"] > 0 and header["encoding"].startswith("fmp4")
        assert header["timing"]["steps"] == 4


async def test_an_abandoned_session_goes_idle_then_closes(mesh, registry):
    async with aiohttp.ClientSession(mesh.gateway_url) as http:
        s = await (
            await http.post(
                "/v1/sessions", json={"prompt": "nobody watches"}, headers=bearer(API_KEY)
            )
        ).json()
        await wait_state(registry, s["id"], SessionState.EXECUTING)
        # nobody attaches: idle after IDLE_AFTER_S (suspended by the scheduler), closed after
        # CLOSE_AFTER_S more
        await wait_state(registry, s["id"], SessionState.SUSPENDED, within_s=IDLE_AFTER_S + 30)
        await wait_state(registry, s["id"], SessionState.TERMINATED, within_s=CLOSE_AFTER_S + 30)


async def test_admission_refuses_when_the_pool_is_full(mesh, registry):
    async with aiohttp.ClientSession(mesh.gateway_url) as http:
        # the worker is up and holds nothing (the sessions of the tests before are gone)
        async def up_and_empty() -> bool:
            cluster = await (await http.get("/v1/cluster", headers=bearer(OPERATOR_KEY))).json()
            ready = [w for w in cluster["workers"] if w["alive"] and w["status"] == "ready"]
            assert ready and not ready[0]["sessions"] and not cluster["pending"], cluster["workers"]
            return True

        await eventually(up_and_empty, 60, "the worker up and empty")
        created = []
        for _ in range(2):  # the only worker has two slots and the pool cannot grow
            resp = await http.post("/v1/sessions", json={"prompt": "p"}, headers=bearer(API_KEY))
            assert resp.status == 201
            created.append(await resp.json())
        resp = await http.post(
            "/v1/sessions", json={"prompt": "one too many"}, headers=bearer(API_KEY)
        )
        body = await resp.json()
        assert resp.status == 429 and body["error"]["code"] == "pool_full", body
        assert int(resp.headers["Retry-After"]) >= 1
        for s in created:
            await http.delete(f"/v1/sessions/{s['id']}", headers=bearer(s["token"]))
