"""``?format=fmp4`` on the SSE stream and the WebSocket: the gateway relays each chunk's
fragmented MP4 as the worker encoded it, and a client decodes every fragment on its own (PyAV),
from the first it gets, wherever it joined. ``?format=jpeg`` stays the default."""

from __future__ import annotations

import base64
import io
import struct
import time
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest

from services.gpu_worker.fmp4 import chunk_start_s, decode_fragment, encode_chunk
from shared.wire import Chunk, encode
from tests.eventually import eventually
from tests.gateway.conftest import bearer, create, read_sse

pytestmark = pytest.mark.integration

HEIGHT, WIDTH, PERIOD_S = 48, 80, 0.75


def _frames(seq: int, count: int) -> np.ndarray:
    rng = np.random.default_rng(seq)
    cells = rng.integers(0, 256, (HEIGHT // 8, WIDTH // 8, 3), dtype=np.uint8)
    return np.stack(
        [np.roll(np.repeat(np.repeat(cells, 8, 0), 8, 1), i, axis=1) for i in range(count)]
    )


async def publish(worker, sid: str, seq: int, *, registry=None) -> None:
    """What a worker publishes: one chunk's fragment (9 frames first, 12 after, as Wan); with
    ``registry``, then records its progress as a worker does (a new viewer's live edge)."""
    count = 9 if seq == 0 else 12
    fps = count / PERIOD_S
    encoded = encode_chunk(_frames(seq, count), fps, chunk_start_s(seq, PERIOD_S))
    now = time.time()
    fragment_fields: dict[str, Any] = {
        "fmp4": encoded.data,
        "fmp4_mime": encoded.mime,
        "start_s": encoded.start_s,
        "duration_s": encoded.duration_s,
        "encode_ms": encoded.encode_ms,
    }
    msg = Chunk(
        session_id=sid,
        seq=seq,
        worker_id=worker.worker_id,
        epoch=1,
        width=WIDTH,
        height=HEIGHT,
        fps=fps,
        gen_ms=10.0,
        batch=1,
        due_at=now,
        done_at=now,
        **fragment_fields,
    )
    await worker.own(sid, 1)
    await worker.nc.publish(worker.subjects.chunks(sid), encode(msg))
    if registry is not None:
        assert await registry.record_progress(sid, worker.worker_id, 1, seq)


def check_fragment(data: bytes, header: dict) -> None:
    frames, times = decode_fragment(data)  # alone: no init segment or frame from before
    count = 9 if header["seq"] == 0 else 12
    assert frames.shape == (count, HEIGHT, WIDTH, 3)
    assert times[0] == pytest.approx(header["start_s"], abs=1e-4) == header["seq"] * PERIOD_S
    assert header["duration_s"] == pytest.approx(PERIOD_S)
    assert header["mime"].startswith('video/mp4; codecs="avc1.')


def ws_chunk(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack(">I", data[:4])
    header = orjson.loads(data[4 : 4 + n])
    body = data[4 + n :]
    assert header["fragment_size"] == len(body)
    return header, body


async def _viewers(gw, sid: str, n: int) -> bool:
    return await gw.store.viewers(sid) >= n


async def test_sse_fmp4_delivers_fragments_that_decode_alone_in_seq_order(http, gw, worker):
    s = await create(http)
    sid = s["id"]
    async with http.get(
        s["stream_url"], params={"format": "fmp4"}, headers=bearer(s["token"])
    ) as stream:
        assert stream.status == 200
        await eventually(lambda: _viewers(gw, sid, 1))
        for seq in range(3):
            await publish(worker, sid, seq)
        events = await read_sse(stream, want=3)
    chunks = [orjson.loads(e["data"]) for e in events]
    assert [e["id"] for e in events] == ["0", "1", "2"] and [c["seq"] for c in chunks] == [0, 1, 2]
    for chunk in chunks:
        assert chunk["encoding"] == "fmp4/base64" and "frames" not in chunk
        assert chunk["timing"]["encode_ms"] > 0
        check_fragment(base64.b64decode(chunk["fragment"]), chunk)


async def test_ws_fmp4_delivers_fragments_and_a_mid_stream_joiner_decodes_its_first(
    http, gw, worker
):
    s = await create(http)
    sid = s["id"]
    registry = await _claimed(gw, sid, worker)
    url = f"{gw.url}/v1/sessions/{sid}/ws"
    async with aiohttp.ClientSession() as client:
        async with client.ws_connect(
            url, params={"format": "fmp4"}, headers=bearer(s["token"])
        ) as ws:
            await eventually(lambda: _viewers(gw, sid, 1))
            for seq in range(3):
                await publish(worker, sid, seq, registry=registry)
            got = [ws_chunk((await ws.receive(timeout=10)).data) for _ in range(3)]
        assert [h["seq"] for h, _ in got] == [0, 1, 2]
        for header, body in got:
            assert header["type"] == "chunk" and header["encoding"] == "fmp4"
            check_fragment(body, header)
        # A viewer joining now starts at the live edge (seq 2), then gets what follows.
        async with client.ws_connect(
            url, params={"format": "fmp4"}, headers=bearer(s["token"])
        ) as late:
            header, body = ws_chunk((await late.receive(timeout=10)).data)
            assert header["seq"] == 2
            check_fragment(body, header)
            await publish(worker, sid, 3)
            header, body = ws_chunk((await late.receive(timeout=10)).data)
            assert header["seq"] == 3
            check_fragment(body, header)


async def test_sse_joiner_at_the_live_edge_decodes_its_first_fragment(http, gw, worker):
    s = await create(http)
    sid = s["id"]
    registry = await _claimed(gw, sid, worker)
    for seq in range(4):
        await publish(worker, sid, seq, registry=registry)
    await worker.nc.flush()
    async with http.get(
        s["stream_url"], params={"format": "fmp4"}, headers=bearer(s["token"])
    ) as stream:
        event = (await read_sse(stream, want=1))[0]
    chunk = orjson.loads(event["data"])
    assert chunk["seq"] == 3
    check_fragment(base64.b64decode(chunk["fragment"]), chunk)


async def _claimed(gw, sid: str, worker):
    record = await gw.ctx.registry.claim(sid, worker.worker_id, 0)
    assert record.epoch == 1
    return gw.ctx.registry


async def test_jpeg_stays_the_default_made_here_once_per_chunk_for_all_its_jpeg_viewers(
    http, gw, worker
):
    """The wire carries the fragment alone: JPEG viewers get frames this gateway decodes from
    it, once per chunk however many watch, and nothing is decoded for fMP4 viewers."""
    from PIL import Image

    s = await create(http)
    sid = s["id"]
    jpegs = gw.gateway.hub.jpegs
    async with http.get(
        s["stream_url"], params={"format": "fmp4"}, headers=bearer(s["token"])
    ) as video:
        await eventually(lambda: _viewers(gw, sid, 1))
        made = jpegs.made
        await publish(worker, sid, 0)
        assert [orjson.loads(e["data"])["seq"] for e in await read_sse(video, want=1)] == [0]
        assert jpegs.made == made  # nobody watches JPEG: nothing decoded
        async with (
            http.get(s["stream_url"], headers=bearer(s["token"])) as plain,
            http.get(s["stream_url"], params={"format": "jpeg"}, headers=bearer(s["token"])) as ws,
        ):
            await eventually(lambda: _viewers(gw, sid, 3))
            for seq in (1, 2):
                await publish(worker, sid, seq)
            # The newest chunk (0, from the feed's ring: decoded on demand) then the live ones.
            plain_events = [orjson.loads(e["data"]) for e in await read_sse(plain, want=3)]
            other_events = [orjson.loads(e["data"]) for e in await read_sse(ws, want=3)]
            video_events = [orjson.loads(e["data"]) for e in await read_sse(video, want=2)]
    assert [c["seq"] for c in plain_events] == [0, 1, 2] == [c["seq"] for c in other_events]
    assert [c["encoding"] for c in plain_events] == ["jpeg/base64"] * 3
    assert [c["encoding"] for c in video_events] == ["fmp4/base64"] * 2
    assert jpegs.made == made + 3  # three chunks, two JPEG viewers: each chunk decoded once
    first = plain_events[1]
    assert len(first["frames"]) == 12 and "fragment" not in first
    image = Image.open(io.BytesIO(base64.b64decode(first["frames"][0])))
    assert image.format == "JPEG" and image.size == (WIDTH, HEIGHT)
    assert np.abs(np.asarray(image).astype(int) - _frames(1, 1)[0].astype(int)).mean() < 20


async def test_a_bad_format_is_refused_with_a_stable_code(http, gw):
    s = await create(http)
    for path in (s["stream_url"], s["ws_url"]):
        async with http.get(path, params={"format": "h265"}, headers=bearer(s["token"])) as resp:
            body = await resp.json()
        assert resp.status == 400 and body["error"]["code"] == "invalid_request"
        assert body["error"]["details"] == {
            "field": "format",
            "value": "h265",
            "allowed": ["jpeg", "fmp4"],
        }
    async with aiohttp.ClientSession() as client:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await client.ws_connect(
                f"{gw.url}{s['ws_url']}", params={"format": "gif"}, headers=bearer(s["token"])
            )
    assert refused.value.status == 400
