"""Video-to-video sessions at the gateway, on the real NATS and Redis: creation and steering of
``input`` and ``strength``, camera frames over the WebSocket and from a WebRTC peer's track
relayed on the session's input subject, and what is refused (with its code) without losing the
socket: a frame that is no image, one over the limit, frames for a text session, a flood."""

from __future__ import annotations

import asyncio
import contextlib
import fractions
import io
import time
from typing import Any

import aiohttp
import av
import numpy as np
import orjson
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription, VideoStreamTrack
from PIL import Image

from services.gateway.inputs import frame_message
from shared.wire import InputFrame, NoticeKind, SessionEvent, decode
from tests.eventually import eventually
from tests.gateway.conftest import bearer, create, run_gateway
from tests.gateway.test_steering_and_admission import answering_worker

pytestmark = pytest.mark.integration


def jpeg(width: int = 64, height: int = 48, shade: int = 100) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (shade, 80, 160)).save(out, format="JPEG")
    return out.getvalue()


@contextlib.asynccontextmanager
async def input_frames(nats_client, gw, sid: str):
    """The frames relayed on the session's input subject, decoded, as they come."""
    got: list[InputFrame] = []

    async def on(msg) -> None:
        got.append(decode(msg.subject, msg.data, InputFrame))

    sub = await nats_client.subscribe(gw.ctx.subjects.session_input(sid), cb=on)
    await nats_client.flush()
    try:
        yield got
    finally:
        await sub.unsubscribe()


async def test_a_video_session_is_created_with_its_input_and_strength(http, gw, nats_client):
    events = await nats_client.subscribe(gw.ctx.subjects.session_events)
    s = await create(http, input="video", strength=0.4)
    assert (s["input"], s["strength"]) == ("video", 0.4)
    default = await create(http, input="video")
    assert default["strength"] == 0.7  # the model's default, shown
    text = await create(http)
    assert (text["input"], text["strength"]) == ("text", None)
    record = await gw.ctx.registry.get_session(s["id"])
    assert (str(record.input), record.strength) == ("video", 0.4)
    assert (await gw.ctx.registry.get_session(default["id"])).strength is None
    seen = []
    async with asyncio.timeout(5):
        async for msg in events.messages:
            seen.append(decode(msg.subject, msg.data, SessionEvent))
            if len(seen) == 3:
                break
    assert [(str(e.input), e.strength) for e in seen] == [
        ("video", 0.4),
        ("video", None),
        ("text", None),
    ]


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"input": "audio"}, 400, "invalid_request"),
        ({"input": 3}, 400, "invalid_request"),
        ({"input": "video", "strength": "high"}, 400, "invalid_request"),
        ({"input": "video", "strength": True}, 400, "invalid_request"),
        ({"input": "video", "strength": 1.5}, 422, "out_of_range"),
        ({"input": "video", "strength": -0.1}, 422, "out_of_range"),
        ({"strength": 0.5}, 400, "invalid_request"),  # a text session has no strength
    ],
)
async def test_a_bad_input_or_strength_is_refused_with_its_code(http, gw, body, status, code):
    resp = await http.post(
        "/v1/sessions", json={"prompt": "a fox", **body}, headers=bearer("k-test-0123456789abcdef")
    )
    assert resp.status == status
    error = (await resp.json())["error"]
    assert error["code"] == code and error["details"]["field"] in ("input", "strength")


async def test_steering_changes_the_strength_with_or_without_a_prompt(
    http, gw, worker, nats_client
):
    s = await create(http, input="video", prompt="as a woodcut")
    text = await create(http)
    path = f"/v1/sessions/{s['id']}/prompt"
    async with answering_worker(
        nats_client, gw, worker, {"prompt": (NoticeKind.PROMPT, 5)}
    ) as seen:
        resp = await http.post(path, json={"strength": 0.25}, headers=bearer(s["token"]))
        body = await resp.json()
        assert resp.status == 200, body
        assert body == {**body, "prompt": "as a woodcut", "strength": 0.25, "next_seq": 5}
        resp = await http.post(
            path, json={"prompt": "as ink", "strength": 0.9}, headers=bearer(s["token"])
        )
        assert resp.status == 200
        resp = await http.post(path, json={"strength": 2}, headers=bearer(s["token"]))
        assert resp.status == 422 and (await resp.json())["error"]["code"] == "out_of_range"
        resp = await http.post(
            f"/v1/sessions/{text['id']}/prompt",
            json={"prompt": "a wolf", "strength": 0.5},
            headers=bearer(text["token"]),
        )
        assert resp.status == 409
        assert (await resp.json())["error"]["code"] == "not_video_session"
        # The same over the socket's control.
        async with http.ws_connect(
            f"/v1/sessions/{s['id']}/ws", params={"token": s["token"]}
        ) as ws:
            await ws.send_str(orjson.dumps({"type": "prompt", "strength": 0.5, "id": 3}).decode())
            ack = await _text(ws, "ack")
            assert ack == {**ack, "id": 3, "strength": 0.5, "prompt": "as ink", "confirmed": True}
    record = await gw.ctx.registry.get_session(s["id"])
    assert (record.prompt, record.strength) == ("as ink", 0.5)
    assert (await gw.ctx.registry.get_session(text["id"])).prompt == "a fox"  # untouched
    assert [(e["prompt"], e["strength"]) for e in seen] == [
        ("as a woodcut", 0.25),
        ("as ink", 0.9),
        ("as ink", 0.5),
    ]


async def _text(ws: aiohttp.ClientWebSocketResponse, kind: str) -> dict[str, Any]:
    async with asyncio.timeout(10):
        while True:
            msg = await ws.receive()
            if msg.type is aiohttp.WSMsgType.TEXT:
                body = orjson.loads(msg.data)
                if body["type"] == kind:
                    return body
            elif msg.type is not aiohttp.WSMsgType.BINARY:
                raise AssertionError(f"the socket ended: {msg}")


async def test_frames_over_the_socket_reach_the_session_subject_in_order(http, gw, nats_client):
    s = await create(http, input="video")
    sid = s["id"]
    async with (
        input_frames(nats_client, gw, sid) as got,
        http.ws_connect(f"/v1/sessions/{sid}/ws", params={"token": s["token"]}) as ws,
    ):
        for seq in range(6):
            await ws.send_bytes(frame_message(seq, 1000.0 + seq, jpeg(shade=20 * seq)))
            await asyncio.sleep(0.02)
        await eventually(lambda: len(got) == 6, 10, "six frames relayed")
    assert [f.seq for f in got] == list(range(6))
    assert [f.captured_at for f in got] == [1000.0 + i for i in range(6)]
    assert all(f.session_id == sid and f.dropped == 0 for f in got)
    assert all(abs(f.received_at - time.time()) < 30 for f in got)
    assert got[3].image == jpeg(shade=60)  # relayed as sent: the worker decodes and resizes


async def test_bad_frames_get_their_codes_and_the_socket_goes_on(http, gw, nats_client):
    s = await create(http, input="video")
    text = await create(http)
    limit = gw.gateway.settings.max_frame_bytes
    async with (
        input_frames(nats_client, gw, s["id"]) as got,
        http.ws_connect(f"/v1/sessions/{s['id']}/ws", params={"token": s["token"]}) as ws,
    ):
        cases = [
            (frame_message(0, 1.0, b"\xff\xd8\xff not a jpeg at all"), "invalid_frame"),
            (frame_message(1, 1.0, b"GIF89a...."), "invalid_frame"),
            (frame_message(2, 1.0, b"\xff\xd8\xff" + b"\0" * (limit + 1)), "frame_too_large"),
            (b"\x00\x00\x00\x05{}", "invalid_request"),  # a header length past the message
            (b"\x00\x00\x00\x02[]" + jpeg(), "invalid_request"),
            (frame_message(-1, 1.0, jpeg()), "invalid_request"),
        ]
        for data, code in cases:
            await ws.send_bytes(data)
            error = await _text(ws, "error")
            assert (error["control"], error["error"]["code"]) == ("frame", code), error
        await ws.send_bytes(frame_message(7, 2.0, jpeg()))  # the socket still takes frames
        await eventually(lambda: len(got) == 1, 10, "the good frame relayed")
        assert got[0].seq == 7
    async with http.ws_connect(
        f"/v1/sessions/{text['id']}/ws", params={"token": text["token"]}
    ) as ws:
        await ws.send_bytes(frame_message(0, 1.0, jpeg()))
        error = await _text(ws, "error")
        assert error["error"]["code"] == "not_video_session" and error["id"] == 0
        await ws.send_str('{"type": "pause", "id": 1}')  # and it still steers
        assert (await _text(ws, "ack"))["id"] == 1
    metrics = await (await http.get("/metrics")).text()
    assert 'turboserve_gateway_input_frames_total{outcome="refused"} 3.0' in metrics
    assert 'turboserve_refusals_total{code="not_video_session"} 1.0' in metrics


async def test_a_flood_is_bounded_and_drops_the_oldest_frames(gw_env, nats_client, redis_client):
    """With NATS's outgoing buffer held past its mark, a lane keeps the newest frames only."""
    async with (
        run_gateway(gw_env, input_buffer_frames=3) as g,
        aiohttp.ClientSession(g.url) as http,
    ):
        s = await create(http, input="video")
        nc = g.ctx.nc
        async with input_frames(nats_client, g, s["id"]) as got:
            async with g.gateway.inputs.lane(await g.ctx.registry.get_session(s["id"])) as lane:
                real = type(nc).pending_data_size
                type(nc).pending_data_size = property(lambda _self: 1 << 30)  # a stalled link
                try:
                    for seq in range(50):
                        lane.accept(seq, float(seq), jpeg())
                    await asyncio.sleep(0.1)
                    assert len(lane.frames) <= 3 and lane.dropped >= 46
                finally:
                    type(nc).pending_data_size = real
                await eventually(lambda: not lane.frames, 10, "the lane emptied")
            await eventually(lambda: len(got) >= 3, 10, "the newest frames relayed")
        seqs = [f.seq for f in got]
        assert seqs[-3:] == [47, 48, 49] and len(seqs) <= 4  # at most one left before the stall
        assert got[-1].dropped == 50 - len(seqs)
        metrics = await (await http.get("/metrics")).text()
        assert f'turboserve_gateway_input_frames_total{{outcome="dropped"}} {50 - len(seqs)}.0' in (
            metrics
        )


class PatternTrack(VideoStreamTrack):
    """A camera in Python: a moving gradient at 30 fps."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    async def recv(self) -> av.VideoFrame:
        pts, time_base = await self.next_timestamp()
        image = np.zeros((120, 160, 3), dtype=np.uint8)
        image[:, :, 0] = (np.arange(160) + 4 * self.count) % 256
        image[:, :, 1] = 90
        self.count += 1
        frame = av.VideoFrame.from_ndarray(image, format="rgb24")
        frame.pts, frame.time_base = pts, time_base or fractions.Fraction(1, 90000)
        return frame


async def test_a_webrtc_peer_sends_its_camera_to_the_session_input(http, gw, nats_client):
    s = await create(http, input="video")
    text = await create(http)
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    camera = PatternTrack()
    pc.addTransceiver(camera, direction="sendrecv")
    try:
        async with input_frames(nats_client, gw, s["id"]) as got:
            await pc.setLocalDescription(await pc.createOffer())
            resp = await http.post(
                f"/v1/sessions/{s['id']}/webrtc",
                json={"type": "offer", "sdp": pc.localDescription.sdp},
                headers=bearer(s["token"]),
            )
            answer = await resp.json()
            assert resp.status == 200, answer
            assert answer["camera"] is True and "a=sendrecv" in answer["sdp"]
            await pc.setRemoteDescription(RTCSessionDescription(answer["sdp"], "answer"))
            await eventually(lambda: len(got) >= 10, 30, "camera frames relayed")
        seqs = [f.seq for f in got]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # consecutive, in order
        picture = Image.open(io.BytesIO(got[-1].image))
        assert (picture.format, picture.size) == ("JPEG", (160, 120))  # the camera's own size
        # At most camera_max_fps (16) of the camera's 30 a second are forwarded.
        span = got[-1].captured_at - got[0].captured_at
        assert len(got) - 1 <= span * gw.gateway.settings.camera_max_fps + 1
    finally:
        await pc.close()
    # A text session's peer is answered sendonly: its camera is not taken.
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver(PatternTrack(), direction="sendrecv")
    try:
        await pc.setLocalDescription(await pc.createOffer())
        resp = await http.post(
            f"/v1/sessions/{text['id']}/webrtc",
            json={"type": "offer", "sdp": pc.localDescription.sdp},
            headers=bearer(text["token"]),
        )
        answer = await resp.json()
        assert resp.status == 200 and answer["camera"] is False
        assert "a=sendonly" in answer["sdp"]
    finally:
        await pc.close()
