"""SSE and WebSocket delivery: chunks, state notices, resume, lag, end, several replicas."""

from __future__ import annotations

import asyncio
import struct
import time

import aiohttp
import orjson
import pytest

from services.gateway import control
from shared.states import SessionState
from shared.wire import NoticeKind
from tests.eventually import eventually
from tests.gateway.conftest import bearer, create, read_sse, run_gateway

pytestmark = pytest.mark.integration


async def _count(gw, sid: str, n: int) -> bool:
    return await gw.store.viewers(sid) >= n


async def test_sse_relays_chunks_and_state_in_order(http, gw, worker):
    s = await create(http)
    sid = s["id"]
    async with http.get(s["stream_url"], headers=bearer(s["token"])) as stream:
        assert stream.status == 200 and stream.headers["Content-Type"].startswith(
            "text/event-stream"
        )
        await eventually(lambda: _count(gw, sid, 1))
        await worker.notice(sid, NoticeKind.PLACED, 0)
        for seq in range(3):
            await worker.chunk(sid, seq, late_s=0.2 if seq == 2 else 0.0)
        await worker.notice(sid, NoticeKind.MIGRATED, 3, detail="wfake -> wother")
        await worker.chunk(sid, 3)
        events = await read_sse(stream, want=6)
    kinds = [(e["event"], e.get("id")) for e in events]
    assert kinds == [
        ("state", None),
        ("chunk", "0"),
        ("chunk", "1"),
        ("chunk", "2"),
        ("state", None),
        ("chunk", "3"),
    ]
    placed = orjson.loads(events[0]["data"])
    assert placed == {
        **placed,
        "kind": "placed",
        "next_seq": 0,
        "worker_id": "wfake",
        "session_id": sid,
    }
    chunk = orjson.loads(events[3]["data"])
    assert chunk["encoding"] == "jpeg/base64" and len(chunk["frames"]) == 2
    assert chunk["timing"]["latency_ms"] >= 199 and chunk["timing"]["batch"] == 1
    migrated = orjson.loads(events[4]["data"])
    assert migrated["kind"] == "migrated" and migrated["detail"] == "wfake -> wother"


async def test_last_event_id_resumes_after_what_the_client_has(http, gw, worker):
    s = await create(http)
    sid = s["id"]
    await worker.notice(sid, NoticeKind.PLACED, 0)
    for seq in range(5):
        await worker.chunk(sid, seq)
    await worker.notice(sid, NoticeKind.PROMPT, 5)
    await worker.chunk(sid, 5)
    await worker.nc.flush()
    headers = {**bearer(s["token"]), "Last-Event-ID": "2"}
    async with http.get(s["stream_url"], headers=headers) as stream:
        events = await read_sse(stream, want=4)
    # the placed notice (before seq 0) is old news; the prompt notice (from seq 5) is not
    assert [(e["event"], e.get("id")) for e in events] == [
        ("chunk", "3"),
        ("chunk", "4"),
        ("state", None),
        ("chunk", "5"),
    ]
    # the same with the query parameter, through the WebSocket
    async with (
        aiohttp.ClientSession() as client,
        client.ws_connect(
            f"{gw.url}/v1/sessions/{sid}/ws", params={"token": s["token"], "last_event_id": "4"}
        ) as ws,
    ):
        first = await ws.receive(timeout=10)
        assert first.type is aiohttp.WSMsgType.TEXT and orjson.loads(first.data)["kind"] == "prompt"
        second = await ws.receive(timeout=10)
        assert second.type is aiohttp.WSMsgType.BINARY and decode_chunk(second.data)[0]["seq"] == 5


async def test_a_new_stream_starts_at_the_live_edge_unless_it_asks_for_the_backlog(
    http, gw, worker
):
    s = await create(http)
    sid = s["id"]
    record = await gw.ctx.registry.claim(sid, worker.worker_id, 0)
    await worker.notice(sid, NoticeKind.PLACED, 0)
    for seq in range(10):  # as a worker does: publish, then record the progress
        await worker.chunk(sid, seq, epoch=record.epoch)
        assert await gw.ctx.registry.record_progress(sid, worker.worker_id, record.epoch, seq)
    await worker.nc.flush()

    async with http.get(s["stream_url"], headers=bearer(s["token"])) as stream:
        first = await read_sse(stream, want=1)
        await worker.chunk(sid, 10, epoch=record.epoch)
        assert await gw.ctx.registry.record_progress(sid, worker.worker_id, record.epoch, 10)
        second = await read_sse(stream, want=1)
    assert [(e["event"], e.get("id")) for e in first + second] == [("chunk", "9"), ("chunk", "10")]
    async with http.get(
        s["stream_url"], params={"from": "start"}, headers=bearer(s["token"])
    ) as stream:
        events = await read_sse(stream, want=3)
    assert [(e["event"], e.get("id")) for e in events] == [
        ("state", None),
        ("chunk", "0"),
        ("chunk", "1"),
    ]
    # Last-Event-ID wins over both
    headers = {**bearer(s["token"]), "Last-Event-ID": "6"}
    async with http.get(s["stream_url"], params={"from": "live"}, headers=headers) as stream:
        assert (await read_sse(stream, want=1))[0]["id"] == "7"

    async with aiohttp.ClientSession() as client:
        async with client.ws_connect(
            f"{gw.url}/v1/sessions/{sid}/ws", params={"token": s["token"]}
        ) as ws:
            msg = await ws.receive(timeout=10)
            assert decode_chunk(msg.data)[0]["seq"] == 10
        async with client.ws_connect(
            f"{gw.url}/v1/sessions/{sid}/ws", params={"token": s["token"], "from": "start"}
        ) as ws:
            assert orjson.loads((await ws.receive(timeout=10)).data)["kind"] == "placed"
            assert decode_chunk((await ws.receive(timeout=10)).data)[0]["seq"] == 0
    async with http.get(
        s["stream_url"], params={"from": "yesterday"}, headers=bearer(s["token"])
    ) as bad:
        body = await bad.json()
    assert bad.status == 400 and body["error"]["code"] == "invalid_request"


def decode_chunk(data: bytes) -> tuple[dict, list[bytes]]:
    (n,) = struct.unpack(">I", data[:4])
    header = orjson.loads(data[4 : 4 + n])
    frames, offset = [], 4 + n
    for size in header["frame_sizes"]:
        frames.append(data[offset : offset + size])
        offset += size
    assert offset == len(data)
    return header, frames


async def test_websocket_binary_chunks_state_and_controls(http, gw, worker, nats_client):
    events = await nats_client.subscribe(gw.ctx.subjects.session_events)
    s = await create(http)
    sid = s["id"]
    assert (await anext_event(events))["kind"] == "created"
    await gw.ctx.registry.claim(sid, worker.worker_id, 0)  # on a worker: its notices confirm

    async def worker_answers() -> None:
        async for msg in events.messages:
            event = orjson.loads(msg.data)
            if event["kind"] == "prompt":
                await worker.notice(sid, NoticeKind.PROMPT, 7)
            elif event["kind"] == "idle":
                await worker.notice(sid, NoticeKind.SUSPENDED, 7)
            elif event["kind"] == "active":
                await worker.notice(sid, NoticeKind.RESUMED, 7)

    answering = asyncio.create_task(worker_answers())
    try:
        async with (
            aiohttp.ClientSession() as client,
            client.ws_connect(f"{gw.url}/v1/sessions/{sid}/ws", headers=bearer(s["token"])) as ws,
        ):
            await eventually(lambda: _count(gw, sid, 1))
            await worker.chunk(sid, 0, frames=3)
            msg = await ws.receive(timeout=10)
            header, frames = decode_chunk(msg.data)
            assert header["type"] == "chunk" and header["seq"] == 0 and header["fps"] == 16.0
            assert len(frames) == 3 and all(f.startswith(b"\xff\xd8") for f in frames)  # JPEG SOI
            await ws.send_str(
                orjson.dumps({"type": "prompt", "prompt": "a storm", "id": 1}).decode()
            )
            ack = await receive_json(ws, "ack")
            assert ack == {**ack, "control": "prompt", "id": 1, "confirmed": True, "next_seq": 7}
            await ws.send_str('{"type": "pause", "id": "p"}')
            ack = await receive_json(ws, "ack")
            assert ack["control"] == "pause" and ack["confirmed"] and ack["id"] == "p"
            assert (await gw.store.activity(sid)).value == "paused"
            await ws.send_str('{"type": "resume"}')
            assert (await receive_json(ws, "ack"))["confirmed"]
            await ws.send_str('{"type": "jump"}')
            err = await receive_json(ws, "error")
            assert err["error"]["code"] == "invalid_request"
            await ws.send_str("not json")
            assert (await receive_json(ws, "error"))["error"]["code"] == "invalid_json"
            await ws.send_str('{"type": "prompt", "prompt": ""}')
            assert (await receive_json(ws, "error"))["error"]["code"] == "invalid_request"
            await ws.send_str('{"type": "close", "id": 9}')
            ack = await receive_json(ws, "ack")
            assert ack["control"] == "close" and ack["state"] == "terminated"
            assert ack["next_seq"] is None and ack["last_seq"] == -1  # no chunk was recorded
            end = await receive_json(ws, "end")
            assert end["reason"] == "closed"
            assert (await ws.receive(timeout=10)).type in (
                aiohttp.WSMsgType.CLOSE,
                aiohttp.WSMsgType.CLOSED,
            )
    finally:
        answering.cancel()
    record = await gw.ctx.registry.get_session(sid)
    assert record.state is SessionState.TERMINATED and record.prompt == "a storm"


async def anext_event(sub) -> dict:
    msg = await sub.next_msg(timeout=5)
    return orjson.loads(msg.data)


async def receive_json(ws, kind: str) -> dict:
    """The next text message of ``kind`` (chunks and other messages in between are skipped)."""
    async with asyncio.timeout(15):
        while True:
            msg = await ws.receive()
            assert msg.type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY), msg
            if (
                msg.type is aiohttp.WSMsgType.TEXT
                and (body := orjson.loads(msg.data))["type"] == kind
            ):
                return body


async def test_stream_end_ends_every_client_and_a_closed_session_ends_at_once(http, gw, worker):
    s = await create(http)
    sid = s["id"]
    async with (
        http.get(s["stream_url"], headers=bearer(s["token"])) as a,
        http.get(s["stream_url"], headers=bearer(s["token"])) as b,
    ):
        await eventually(lambda: _count(gw, sid, 2))
        assert len(gw.gateway.hub.feeds) == 1  # one subscription for both clients
        await worker.chunk(sid, 0)
        resp = await http.delete(f"/v1/sessions/{sid}", headers=bearer(s["token"]))
        assert resp.status == 200
        for stream in (a, b):
            events = await read_sse(stream, want=5)
            assert [e["event"] for e in events] == ["chunk", "end"]
            assert orjson.loads(events[-1]["data"])["reason"] == "closed"
    await eventually(lambda: not gw.gateway.hub.feeds)  # the feed closed with its last client
    async with http.get(
        s["stream_url"], headers={**bearer(s["token"]), "Last-Event-ID": "0"}
    ) as again:
        events = await read_sse(again, want=1, timeout=10)
    assert events[-1]["event"] == "end"


async def test_stream_of_a_session_terminated_without_stream_end_ends(http, gw, worker):
    """The StreamEnd can be gone (retention) or never sent: the registry ends the stream."""
    s = await create(http)
    sid = s["id"]
    async with http.get(s["stream_url"], headers=bearer(s["token"])) as stream:
        await worker.chunk(sid, 0)
        await eventually(lambda: _count(gw, sid, 1))
        await gw.ctx.registry.transition(sid, SessionState.TERMINATED)
        events = await read_sse(stream, want=5, timeout=15)
    assert [e["event"] for e in events] == ["chunk", "end"]


async def test_a_slow_client_skips_to_the_live_edge_and_never_holds_up_others(
    gw_env, nats_client, redis_client, worker
):
    import os

    async with (
        run_gateway(gw_env, client_queue_chunks=16) as g,
        aiohttp.ClientSession(g.url) as http,
    ):
        s = await create(http)
        sid = s["id"]
        big = os.urandom(190_000)  # ~256 KB per SSE event: the slow client's socket fills up
        video = {"format": "fmp4"}  # relayed as it came (no decode of the random bytes)
        async with (
            http.get(s["stream_url"], params=video, headers=bearer(s["token"])) as fast,
            http.get(s["stream_url"], params=video, headers=bearer(s["token"])) as slow,
        ):
            await eventually(lambda: _count(g, sid, 2))
            feed = g.gateway.hub.feeds[sid]

            async def produce() -> None:
                for seq in range(80):
                    await worker.chunk(sid, seq, frames=3, fmp4=big)
                    await asyncio.sleep(0.02)

            producing = asyncio.create_task(produce())
            # The fast client reads as chunks come; the slow one reads nothing meanwhile.
            fast_events = await read_sse(fast, want=80, timeout=60)
            await producing
            assert [int(e["id"]) for e in fast_events] == list(range(80))  # the fast one got all
            await eventually(lambda: any(v.lags for v in feed.viewers))
            slow_events = await read_sse(slow, want=200, timeout=30, until="lag")
            await worker.chunk(sid, 80)
            slow_events += await read_sse(slow, want=200, timeout=30, until_id="80")
        kinds = [e["event"] for e in slow_events]
        assert "lag" in kinds
        lag = orjson.loads(slow_events[kinds.index("lag")]["data"])
        assert lag["skipped"] >= 1 and lag["last_skipped"] >= lag["first_skipped"]
        seqs = [int(e["id"]) for e in slow_events if e["event"] == "chunk"]
        assert seqs == sorted(seqs) and len(seqs) < 81 and seqs[-1] == 80
        metrics = await (await http.get("/metrics")).text()
        assert 'turboserve_lag_skips_total{transport="sse"}' in metrics
        assert 'turboserve_lag_skips_total{transport="sse"} 0.0' not in metrics


async def test_any_replica_serves_any_session(gw, gw_env, worker):
    """Created on one gateway, watched and steered on another; viewers seen by both."""
    async with run_gateway(gw_env) as other, aiohttp.ClientSession() as client:
        resp = await client.post(
            f"{gw.url}/v1/sessions", json={"prompt": "p"}, headers=bearer("k-test-0123456789abcdef")
        )
        s = await resp.json()
        sid = s["id"]
        async with client.get(
            f"{other.url}/v1/sessions/{sid}/stream", headers=bearer(s["token"])
        ) as stream:
            await eventually(lambda: _count(gw, sid, 1))  # the first replica sees the viewer
            await worker.chunk(sid, 0)
            events = await read_sse(stream, want=1)
            assert events[0]["id"] == "0"
            resp = await client.delete(f"{gw.url}/v1/sessions/{sid}", headers=bearer(s["token"]))
            assert resp.status == 200
            assert (await read_sse(stream, want=3))[-1]["event"] == "end"


async def test_gateway_shutdown_ends_streams_with_a_reason(
    gw_env, nats_client, redis_client, worker
):
    async with run_gateway(gw_env) as g, aiohttp.ClientSession(g.url) as http:
        s = await create(http)
        async with http.get(s["stream_url"], headers=bearer(s["token"])) as stream:
            await eventually(lambda: _count(g, s["id"], 1))
            await worker.chunk(s["id"], 0)
            assert (await read_sse(stream, want=1))[0]["id"] == "0"
            await g.service.stop()
            end = (await read_sse(stream, want=2))[-1]
    assert end["event"] == "end"
    assert orjson.loads(end["data"]) == {
        "session_id": s["id"],
        "last_seq": 0,
        "reason": "gateway_shutdown",
    }


async def test_notice_waiter_ignores_other_kinds(gw, worker, http):
    s = await create(http)
    async with control.notice_waiter(gw.gateway, s["id"], NoticeKind.RESUMED) as waiter:
        await worker.notice(s["id"], NoticeKind.PROMPT, 3)
        await worker.chunk(s["id"], 3)
        await worker.notice(s["id"], NoticeKind.RESUMED, 4)
        notice = await waiter.wait(5)
    assert notice is not None and notice.kind is NoticeKind.RESUMED and notice.next_seq == 4


async def test_a_feed_leaves_no_consumer_behind(http, gw, nats_client):
    s = await create(http)
    js = nats_client.jetstream()
    stream = gw.ctx.subjects.chunks_stream
    async with (
        http.get(s["stream_url"], headers=bearer(s["token"])),
        http.get(s["stream_url"], headers=bearer(s["token"])),
    ):
        await eventually(lambda: _count(gw, s["id"], 2))
        assert (await js.stream_info(stream)).state.consumer_count == 1  # shared by both
    await eventually(lambda: not gw.gateway.hub.feeds)

    async def no_consumer() -> bool:
        return (await js.stream_info(stream)).state.consumer_count == 0

    await eventually(no_consumer)


async def test_a_fenced_owner_and_a_malformed_fragment_never_reach_a_client(http, gw, worker):
    s = await create(http)
    sid = s["id"]
    subject = gw.ctx.subjects.chunks(sid)
    async with http.get(s["stream_url"], headers=bearer(s["token"])) as stream:
        await eventually(lambda: _count(gw, sid, 1))
        await worker.chunk(sid, 0, epoch=2)
        await worker.chunk(sid, 50, epoch=1)  # the owner before: fenced off
        body = orjson.loads(await _encoded_chunk(worker, sid, 1))
        await worker.nc.publish(subject, orjson.dumps({**body, "fmp4": ["QUJD"]}))  # not a string
        await worker.nc.publish(subject, orjson.dumps({**body, "fmp4": "not base64!"}))
        await worker.nc.publish(subject, orjson.dumps({**body, "fmp4": ""}))  # no video
        raw = orjson.dumps(body).replace(b'"fmp4":"', b'"fmp4":"\n')  # would end the event
        await worker.nc.publish(subject, raw)
        await worker.chunk(sid, 1, epoch=2)
        events = await read_sse(stream, want=2)
    assert [int(e["id"]) for e in events] == [0, 1]
    assert all(len(orjson.loads(e["data"])["frames"]) == 2 for e in events)


async def _encoded_chunk(worker, sid: str, seq: int) -> bytes:
    from shared.wire import Chunk, encode

    now = time.time()
    return encode(
        Chunk(
            session_id=sid,
            seq=seq,
            worker_id=worker.worker_id,
            epoch=2,
            width=16,
            height=16,
            fps=16.0,
            gen_ms=1.0,
            batch=1,
            due_at=now,
            done_at=now,
            fmp4=b"\x00\x00\x00\x18ftyp",
        )
    )


async def test_a_deep_resume_gets_a_feed_of_its_own_and_every_chunk(
    gw_env, nats_client, redis_client, worker
):
    from services.gateway.feeds import RING_CHUNKS

    # a queue as long as the burst: the live client must not skip (that is another test)
    async with (
        run_gateway(gw_env, client_queue_chunks=64) as gw,
        aiohttp.ClientSession(gw.url) as http,
    ):
        await _deep_resume(gw, http, worker, RING_CHUNKS)


async def _deep_resume(gw, http, worker, ring_chunks: int) -> None:
    s = await create(http)
    sid = s["id"]
    async with http.get(s["stream_url"], headers=bearer(s["token"])) as live:
        await eventually(lambda: _count(gw, sid, 1))
        for seq in range(30):
            await worker.chunk(sid, seq)
        assert [int(e["id"]) for e in await read_sse(live, want=30)] == list(range(30))
        shared = gw.gateway.hub.feeds[sid]
        assert shared.ring_chunks == ring_chunks  # memory stays bounded
        headers = {**bearer(s["token"]), "Last-Event-ID": "2"}
        async with http.get(s["stream_url"], headers=headers) as late:
            got = await read_sse(late, want=27)
            assert [int(e["id"]) for e in got] == list(range(3, 30))
            assert len(gw.gateway.hub.open) == 2  # the shared feed and the late client's own
            headers = {**bearer(s["token"]), "Last-Event-ID": "27"}
            async with http.get(s["stream_url"], headers=headers) as recent:
                assert [int(e["id"]) for e in await read_sse(recent, want=2)] == [28, 29]
                assert len(gw.gateway.hub.open) == 2  # the ring covered it: shared
    await eventually(lambda: not gw.gateway.hub.open)
