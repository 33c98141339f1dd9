"""``POST /v1/sessions/{id}/webrtc`` with a loopback aiortc client: it negotiates, receives a
chunk's worth of frames that decode, steers over the data channel and gets the WebSocket's acks;
the answer refuses what is no offer with a stable code; the gateway's shutdown ends its peers."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection, RTCRtpReceiver, RTCSessionDescription

from services.gateway import webrtc
from services.gateway.chunktrack import VIDEO_CLOCK, FrameClock, annexb_packets
from services.gateway.webrtc import PEERS
from services.gpu_worker.fmp4 import chunk_start_s, encode_chunk
from shared.states import SessionState
from shared.wire import NoticeKind
from tests.eventually import eventually
from tests.gateway.conftest import bearer, create, run_gateway
from tests.gateway.test_fmp4_stream import HEIGHT as F_HEIGHT
from tests.gateway.test_fmp4_stream import WIDTH as F_WIDTH
from tests.gateway.test_fmp4_stream import _frames, publish

pytestmark = pytest.mark.integration

WIDTH, HEIGHT, FRAMES = 64, 48, 6


class Client:
    """A viewer in Python: a recvonly video transceiver and a control channel."""

    def __init__(self, codec: str | None = None) -> None:
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        video = self.pc.addTransceiver("video", direction="recvonly")
        if codec is not None:  # offer this codec only (and its retransmissions)
            capabilities = RTCRtpReceiver.getCapabilities("video")
            assert capabilities is not None
            video.setCodecPreferences(
                [c for c in capabilities.codecs if c.mimeType in (codec, "video/rtx")]
            )
        self.channel = self.pc.createDataChannel("control")
        self.messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.channel.on("message", lambda data: self.messages.put_nowait(orjson.loads(data)))
        self.opened = asyncio.Event()
        self.channel.on("open", self.opened.set)
        self.tracks: asyncio.Queue[Any] = asyncio.Queue()
        self.pc.on("track", self.tracks.put_nowait)

    async def offer(self) -> dict[str, str]:
        await self.pc.setLocalDescription(await self.pc.createOffer())
        return {"type": "offer", "sdp": self.pc.localDescription.sdp}

    async def connect(self, http: aiohttp.ClientSession, url: str, token: str) -> dict[str, Any]:
        resp = await http.post(url, json=await self.offer(), headers=bearer(token))
        body = await resp.json()
        assert resp.status == 200, body
        await self.pc.setRemoteDescription(
            RTCSessionDescription(sdp=body["sdp"], type=body["type"])
        )
        return body

    async def message(self, kind: str, timeout: float = 10.0) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            while True:
                msg = await self.messages.get()
                if msg["type"] == kind:
                    return msg

    async def close(self) -> None:
        await self.pc.close()


@contextlib.asynccontextmanager
async def client(codec: str | None = None) -> Any:
    c = Client(codec)
    try:
        yield c
    finally:
        await c.close()


async def _viewers(gw, sid: str, n: int) -> bool:
    return await gw.store.viewers(sid) >= n


async def test_a_loopback_peer_gets_decoded_frames_and_steers_over_the_data_channel(
    http, gw, worker, nats_client
):
    s = await create(http)
    sid = s["id"]
    await gw.ctx.registry.claim(sid, worker.worker_id, 0)  # on a worker: its notices confirm
    events = await nats_client.subscribe(gw.ctx.subjects.session_events)

    async def worker_answers() -> None:
        async for msg in events.messages:
            if orjson.loads(msg.data)["kind"] == "prompt":
                await worker.notice(sid, NoticeKind.PROMPT, 7)

    answering = asyncio.create_task(worker_answers())
    try:
        async with client() as c:
            answer = await c.connect(http, f"/v1/sessions/{sid}/webrtc", s["token"])
            assert answer["type"] == "answer" and answer["session_id"] == sid
            assert "a=candidate" in answer["sdp"]
            track = await asyncio.wait_for(c.tracks.get(), 10)
            assert track.kind == "video"
            await asyncio.wait_for(c.opened.wait(), 10)
            await eventually(lambda: _viewers(gw, sid, 1))
            for seq in range(3):
                await worker.chunk(
                    sid, seq, frames=FRAMES, width=WIDTH, height=HEIGHT, shade=40 * seq
                )
            frames = [await asyncio.wait_for(track.recv(), 10) for _ in range(FRAMES)]
            assert all((f.width, f.height) == (WIDTH, HEIGHT) for f in frames)
            pts = [f.pts for f in frames]
            assert pts == sorted(pts) and len(set(pts)) == FRAMES
            assert frames[0].to_ndarray(format="rgb24").shape == (HEIGHT, WIDTH, 3)

            c.channel.send(orjson.dumps({"type": "prompt", "prompt": "a storm", "id": 1}).decode())
            ack = await c.message("ack")
            assert ack == {**ack, "control": "prompt", "id": 1, "confirmed": True, "next_seq": 7}
            c.channel.send('{"type": "jump", "id": "j"}')
            err = await c.message("error")
            assert err["id"] == "j" and err["error"]["code"] == "invalid_request"
            c.channel.send('{"type": "close", "id": 9}')
            ack = await c.message("ack")
            assert ack["control"] == "close" and ack["id"] == 9 and ack["state"] == "terminated"
            end = await c.message("end")
            assert end["reason"] == "closed"
            await eventually(lambda: not _peers(gw), timeout=10)  # closed, its viewer gone
            await eventually(lambda: c.pc.connectionState == "closed", timeout=40)
            assert await gw.store.viewers(sid) == 0
    finally:
        answering.cancel()
    record = await gw.ctx.registry.get_session(sid)
    assert record.state is SessionState.TERMINATED and record.prompt == "a storm"


async def _watch(
    gw, http, worker, sid: str, token: str, codec: str | None, fmp4: bool
) -> tuple[dict, list, Any]:
    """Connect a client offering ``codec`` (None: aiortc's all), publish three chunks (with
    their fMP4 fragments or not), receive the first chunk's frames."""
    async with client(codec) as c:
        answer = await c.connect(http, f"/v1/sessions/{sid}/webrtc", token)
        track = await asyncio.wait_for(c.tracks.get(), 10)
        await eventually(lambda: _viewers(gw, sid, 1))
        for seq in range(3):
            if fmp4:
                await publish(worker, sid, seq)
            else:
                await worker.chunk(sid, seq, frames=FRAMES, width=WIDTH, height=HEIGHT)
        want = 9 if fmp4 else FRAMES  # the fMP4 helper's first chunk has 9 frames
        frames = [await asyncio.wait_for(track.recv(), 10) for _ in range(want)]
        (peer,) = _peers(gw)
        return answer, frames, dict(peer.track.chunks)


@pytest.mark.parametrize(
    ("codec", "passed"),
    [
        (None, True),  # H.264 preferred: the worker's packets, not re-encoded
        ("video/VP8", False),  # a VP8 peer: the fragment decoded here, re-encoded
    ],
)
async def test_the_worker_h264_passes_through_where_negotiated_else_it_is_reencoded(
    http, gw, worker, codec, passed
):
    s = await create(http)
    answer, frames, chunks = await _watch(gw, http, worker, s["id"], s["token"], codec, True)
    expected = "video/VP8" if codec == "video/VP8" else "video/H264"
    assert answer["video"] == {"codec": expected, "pass_through": expected == "video/H264"}
    size = (F_WIDTH, F_HEIGHT)
    assert all((f.width, f.height) == size for f in frames)
    assert [f.to_ndarray(format="rgb24").shape for f in frames[:1]] == [(size[1], size[0], 3)]
    pts = [f.pts for f in frames]
    assert pts == sorted(pts) and len(set(pts)) == len(frames)
    # What the viewer sees is the chunk: the worker's frames (random cells), passed through or
    # decoded and re-encoded (VP8 at aiortc's bitrate: a little further from them).
    pictures = np.stack([f.to_ndarray(format="rgb24") for f in frames]).astype(float)
    assert np.abs(pictures - _frames(0, 9)).mean() < (12 if passed else 30)
    assert chunks["passed" if passed else "reencoded"] >= 1
    assert chunks["reencoded" if passed else "passed"] == 0


def _peers(gw) -> set:
    return gw.service._runner.app[PEERS].peers


async def test_what_is_no_offer_is_refused_with_a_stable_code(http, gw):
    s = await create(http)
    url = f"/v1/sessions/{s['id']}/webrtc"
    cases = [
        (b"not json", 400, "invalid_json"),
        (b'{"sdp": "v=0", "extra": 1}', 400, "invalid_request"),
        (b'{"type": "answer", "sdp": "v=0"}', 400, "invalid_offer"),
        (b'{"type": "offer"}', 400, "invalid_offer"),
        (b'{"type": "offer", "sdp": "hello"}', 400, "invalid_offer"),
    ]
    for raw, status, code in cases:
        resp = await http.post(url, data=raw, headers=bearer(s["token"]))
        body = await resp.json()
        assert (resp.status, body["error"]["code"]) == (status, code), (raw, body)
    # An offer with a data channel but no video: nothing to answer it with.
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.createDataChannel("control")
    await pc.setLocalDescription(await pc.createOffer())
    resp = await http.post(
        url, json={"type": "offer", "sdp": pc.localDescription.sdp}, headers=bearer(s["token"])
    )
    await pc.close()
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_offer"
    # Authentication as the stream and the socket: no token 401, another session's 403.
    other = await create(http)
    async with client() as c:
        offer = await c.offer()
        assert (await http.post(url, json=offer)).status == 401
        resp = await http.post(url, json=offer, headers=bearer(other["token"]))
        assert resp.status == 403 and (await resp.json())["error"]["code"] == "forbidden"
        resp = await http.post("/v1/sessions/nope/webrtc", json=offer, headers=bearer(s["token"]))
        assert resp.status == 404
    assert not _peers(gw)


async def test_shutdown_ends_every_peer_and_a_new_offer_to_a_new_gateway_plays_again(
    gw_env, nats_client, redis_client, worker
):
    async with run_gateway(gw_env) as g, aiohttp.ClientSession(g.url) as http:
        s = await create(http)
        sid = s["id"]
        async with client() as c:
            await c.connect(http, f"/v1/sessions/{sid}/webrtc", s["token"])
            await asyncio.wait_for(c.opened.wait(), 10)
            assert len(_peers(g)) == 1
            peers = g.service._runner.app[PEERS]
            await g.service.stop()
            end = await c.message("end")
            assert end["reason"] == "gateway_shutdown"
            assert not peers.peers
    # The restarted gateway knows nothing of the old connection: a new offer starts again.
    async with run_gateway(gw_env) as g, aiohttp.ClientSession(g.url) as http:
        async with client() as c:
            await c.connect(http, f"/v1/sessions/{sid}/webrtc", s["token"])
            track = await asyncio.wait_for(c.tracks.get(), 10)
            await eventually(lambda: _viewers(g, sid, 1))
            await worker.chunk(sid, 0, frames=FRAMES, width=WIDTH, height=HEIGHT)
            frame = await asyncio.wait_for(track.recv(), 10)
            assert (frame.width, frame.height) == (WIDTH, HEIGHT)


def test_the_frame_clock_is_continuous_across_chunks_and_paces_by_each_chunks_fps():
    clock = FrameClock()
    stamps = [clock.stamp(16.0) for _ in range(3)] + [clock.stamp(8.0)]
    assert [p for p, _ in stamps] == [0, 5625, 11250, 16875]
    assert stamps[-1][1] == VIDEO_CLOCK // 8 and clock.next_pts == 16875 + 11250
    assert clock.wait_s(0, 5625, now=100.0) == 0.0  # the first frame anchors the clock
    assert clock.wait_s(5625, 5625, now=100.0) == pytest.approx(0.0625)
    # A frame found late by more than a frame period re-anchors: a pause, not a burst.
    assert clock.wait_s(11250, 5625, now=101.0) == 0.0
    assert clock.wait_s(16875, 11250, now=101.0) == pytest.approx(0.0625)


async def test_a_viewer_that_goes_or_never_connects_is_let_go(http, gw, monkeypatch):
    s = await create(http)
    sid = s["id"]
    url = f"/v1/sessions/{sid}/webrtc"
    async with client() as c:  # goes: it closes its peer connection
        await c.connect(http, url, s["token"])
        await asyncio.wait_for(c.opened.wait(), 10)
        assert len(_peers(gw)) == 1 and await gw.store.viewers(sid) == 1
    await eventually(lambda: not _peers(gw), timeout=10)
    await eventually(lambda: _viewers_are(gw, sid, 0))
    monkeypatch.setattr(webrtc, "CONNECT_S", 0.5)
    async with client() as c:  # never connects: it keeps the answer to itself
        resp = await http.post(url, json=await c.offer(), headers=bearer(s["token"]))
        assert resp.status == 200
        assert len(_peers(gw)) == 1
        await eventually(lambda: not _peers(gw), timeout=10)
    assert await gw.store.viewers(sid) == 0


async def _viewers_are(gw, sid: str, n: int) -> bool:
    return await gw.store.viewers(sid) == n


def test_a_fragment_becomes_annex_b_packets_with_the_parameter_sets_before_the_keyframe():
    fragment = encode_chunk(_frames(3, 12), 16.0, chunk_start_s(3, 0.75)).data
    packets = annexb_packets(fragment)
    assert (
        len(packets) == 12
        and packets[0].is_keyframe
        and not any(p.is_keyframe for p in packets[1:])
    )
    first = bytes(packets[0])
    nal_types = [
        unit[0] & 0x1F for unit in first.split(b"\0\0\1")[1:] if unit
    ]  # 3- or 4-byte codes
    assert {7, 8, 5} <= set(nal_types)  # SPS, PPS, then the IDR slice
    assert nal_types.index(7) < nal_types.index(5) and nal_types.index(8) < nal_types.index(5)
    assert all(bytes(p)[:3] in (b"\0\0\0", b"\0\0\1") for p in packets)  # start codes, not lengths
