"""Prompt, pause and resume over REST with a stand-in worker answering on the wire; admission
control from what the registry says; the cluster view and the metrics."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import orjson
import pytest

from shared.registry import PoolLimits, WorkerRecord
from shared.wire import NoticeKind, WorkerStatus
from tests.gateway.conftest import API_KEY, OPERATOR_KEY, bearer, create, run_gateway

pytestmark = pytest.mark.integration


@contextlib.asynccontextmanager
async def answering_worker(nats_client, gw, worker, answers: dict[str, tuple[NoticeKind, int]]):
    """Answers session events the way scheduler + worker would: ``kind -> (notice, next_seq)``.
    Yields the events it saw."""
    seen: list[dict] = []
    sub = await nats_client.subscribe(gw.ctx.subjects.session_events)

    async def loop() -> None:
        async for msg in sub.messages:
            event = orjson.loads(msg.data)
            seen.append(event)
            if event["kind"] in answers:
                kind, next_seq = answers[event["kind"]]
                await worker.notice(event["session_id"], kind, next_seq)

    task = asyncio.create_task(loop())
    try:
        yield seen
    finally:
        task.cancel()
        await sub.unsubscribe()


async def test_prompt_change_answers_the_seq_it_applies_from(http, gw, worker, nats_client):
    s = await create(http)
    async with answering_worker(
        nats_client, gw, worker, {"prompt": (NoticeKind.PROMPT, 12)}
    ) as seen:
        resp = await http.post(
            f"/v1/sessions/{s['id']}/prompt",
            json={"prompt": "a storm at sea"},
            headers=bearer(s["token"]),
        )
        body = await resp.json()
    assert resp.status == 200
    assert body == {"id": s["id"], "prompt": "a storm at sea", "confirmed": True, "next_seq": 12}
    assert (await gw.ctx.registry.get_session(s["id"])).prompt == "a storm at sea"
    assert [e["kind"] for e in seen] == ["prompt"] and seen[0]["prompt"] == "a storm at sea"


async def test_prompt_change_without_confirmation_is_accepted_with_202(
    gw_env, nats_client, redis_client
):
    async with run_gateway(gw_env, control_wait_s=0.3) as g, aiohttp.ClientSession(g.url) as http:
        s = await create(http)
        started = time.monotonic()
        resp = await http.post(
            f"/v1/sessions/{s['id']}/prompt", json={"prompt": "later"}, headers=bearer(s["token"])
        )
        body = await resp.json()
        assert resp.status == 202 and body["confirmed"] is False and body["next_seq"] is None
        assert "unknown" in body["message"] and time.monotonic() - started < 5
        assert (await g.ctx.registry.get_session(s["id"])).prompt == "later"


async def test_pause_and_resume_flip_activity_and_tell_the_scheduler(http, gw, worker, nats_client):
    s = await create(http)
    await gw.ctx.registry.claim(s["id"], "w1", 0)  # on a worker: its notices confirm
    answers = {"idle": (NoticeKind.SUSPENDED, 4), "active": (NoticeKind.RESUMED, 4)}
    path = f"/v1/sessions/{s['id']}"
    async with answering_worker(nats_client, gw, worker, answers) as seen:
        resp = await http.post(f"{path}/pause", headers=bearer(s["token"]))
        assert resp.status == 200
        assert await resp.json() == {
            "id": s["id"],
            "activity": "paused",
            "confirmed": True,
            "next_seq": 4,
        }
        assert (await gw.store.activity(s["id"])).value == "paused"
        # pausing again changes nothing and sends nothing
        resp = await http.post(f"{path}/pause", headers=bearer(s["token"]))
        assert resp.status in (200, 202) and (await resp.json())["activity"] == "paused"
        resp = await http.post(f"{path}/resume", headers=bearer(s["token"]))
        assert resp.status == 200 and (await resp.json())["next_seq"] == 4
        assert (await gw.store.activity(s["id"])).value == "active"
        body = await (await http.get(path, headers=bearer(s["token"]))).json()
        assert body["activity"] == "active"
    assert [e["kind"] for e in seen] == ["idle", "active"]


async def test_a_session_waiting_for_a_gpu_pauses_at_once_and_its_placement_confirms_a_resume(
    gw_env, nats_client, redis_client, worker
):
    """Pending (on no worker): nothing to suspend, so a pause answers without waiting for a
    notice; a resume is confirmed by the notice of the placement it leads to."""
    async with run_gateway(gw_env, control_wait_s=5.0) as g, aiohttp.ClientSession(g.url) as http:
        s = await create(http)
        path = f"/v1/sessions/{s['id']}"
        started = time.monotonic()
        resp = await http.post(f"{path}/pause", headers=bearer(s["token"]))
        assert resp.status == 202 and (await resp.json())["activity"] == "paused"
        assert time.monotonic() - started < 2.0  # not the 5 s wait for a notice
        answers = {"active": (NoticeKind.PLACED, 0)}
        async with answering_worker(nats_client, g, worker, answers) as seen:
            resp = await http.post(f"{path}/resume", headers=bearer(s["token"]))
            assert resp.status == 200 and (await resp.json())["next_seq"] == 0
        assert [e["kind"] for e in seen] == ["active"]


async def test_admission_refuses_when_the_pool_is_full(http, gw):
    registry = gw.ctx.registry
    await registry.set_pool_limits(PoolLimits(min_workers=1, max_workers=2))
    for wid, held in (("w1", ("a", "b")), ("w2", ("c", "d"))):
        await registry.register_worker(
            WorkerRecord(id=wid, status=WorkerStatus.READY, capacity=2, sessions=held), ttl_s=60
        )
    resp = await http.post("/v1/sessions", json={"prompt": "p"}, headers=bearer(API_KEY))
    body = await resp.json()
    assert resp.status == 429 and body["error"]["code"] == "pool_full"
    assert resp.headers["Retry-After"] == "10" and body["error"]["details"]["max_workers"] == 2
    # a free slot admits one session; the pending one then takes it, and the next is refused
    await registry.register_worker(
        WorkerRecord(id="w2", status=WorkerStatus.READY, capacity=3, sessions=("c", "d")), ttl_s=60
    )
    assert (await create(http))["id"]
    resp = await http.post("/v1/sessions", json={"prompt": "p"}, headers=bearer(API_KEY))
    assert resp.status == 429
    # a pool that may still grow admits
    await registry.set_pool_limits(PoolLimits(min_workers=1, max_workers=3))
    assert (await create(http))["id"]


async def test_cluster_view_for_the_operator(http, gw):
    registry = gw.ctx.registry
    s = await create(http)
    resp = await http.get("/v1/cluster")
    assert resp.status == 401
    resp = await http.get("/v1/cluster", headers=bearer(API_KEY))
    assert resp.status == 403 and (await resp.json())["error"]["code"] == "forbidden"
    body = await (await http.get("/v1/cluster", headers=bearer(OPERATOR_KEY))).json()
    assert body["workers"] == [] and body["pool"] is None and body["scheduler"] is None
    assert body["target"] is None and body["pending"] == [s["id"]] and body["latency"] == []

    rec = await registry.get_session(s["id"])
    await registry.claim(s["id"], "w1", rec.epoch)
    await registry.register_worker(
        WorkerRecord(
            id="w1",
            status=WorkerStatus.READY,
            capacity=4,
            sessions=(s["id"], "x"),
            suspended=("x",),
            gpu_kind="h20",
            emulated="h20",
        ),
        ttl_s=60,
    )
    await registry.set_pool_limits(PoolLimits(min_workers=1, max_workers=4))
    await registry.set_scheduler_status(
        {"rho_max": 0.5, "rho_hat": 0.7, "target_gpus": 2}, ttl_s=60
    )
    await registry.record_cluster_event("migration", session_id=s["id"], src="w0", dst="w1")
    await registry.record_cluster_event("scale_out", count=1)
    now = int(time.time())
    await gw.store.record_latency({("w1", now - 1): 40.0, ("w1", now): 12.5})
    body = await (await http.get("/v1/cluster", headers=bearer(OPERATOR_KEY))).json()
    (card,) = body["workers"]
    assert card["id"] == "w1" and card["status"] == "ready" and card["alive"]
    assert card["sessions"] == [{"id": s["id"], "suspended": False}, {"id": "x", "suspended": True}]
    assert card["load"] == pytest.approx(0.25) and card["emulated"] == "h20"
    assert card["worst_latency_ms"] == 40.0
    assert body["target"] == 0.7 and body["pool"]["max_workers"] == 4
    assert body["scheduler"]["target_gpus"] == 2 and body["pending"] == []
    assert [e["kind"] for e in body["events"]] == ["scale_out", "migration"]
    assert body["latency"] == [[now - 1, 40.0], [now, 12.5]]
    # the scheduler's own utilisation per worker wins when it reports one
    await registry.set_scheduler_status({"rho_hat": 0.7, "rho": {"w1": 0.61}}, ttl_s=60)
    body = await (await http.get("/v1/cluster", headers=bearer(OPERATOR_KEY))).json()
    assert body["workers"][0]["load"] == 0.61


async def test_metrics(http, gw, worker):
    s = await create(http)
    await http.get("/v1/cluster")  # 401
    await http.post("/v1/sessions", data=b"{")  # 401 before the body is read
    async with http.get(s["stream_url"], headers=bearer(s["token"])) as stream:
        await worker.chunk(s["id"], 0, late_s=0.3)
        await worker.chunk(s["id"], 1)
        while True:
            line = await asyncio.wait_for(stream.content.readline(), 10)
            if line.startswith(b"id: 1"):
                break
        text = await (await http.get("/metrics")).text()
        assert 'turboserve_stream_clients{transport="sse"} 1.0' in text
    assert 'turboserve_sessions{state="pending"} 1.0' in text
    assert 'turboserve_session_activity{activity="active"} 1.0' in text
    assert "turboserve_gateway_chunks_total 2.0" in text
    assert "turboserve_deadline_misses_total 1.0" in text
    assert 'turboserve_chunk_latency_seconds_bucket{le="0.25"} 1.0' in text
    assert 'turboserve_refusals_total{code="unauthorized"} 2.0' in text
