"""``POST /v1/sessions/{id}/webrtc``: a session as a WebRTC peer (aiortc).

The client posts an SDP offer (``{"type": "offer", "sdp": "..."}``, with the session token as
for the stream and the socket) that receives video and, to steer, opens a data channel; the
answer is ``{"type": "answer", "sdp": "...", "session_id", "video"}``. Then:

- the video track carries the session's chunks from the live edge on (:mod:`chunktrack`): the
  worker's H.264 passed through to a peer that offers H.264 (preferred), re-encoded to VP8 for
  one that does not; the answer's ``video`` says which (``codec``, ``pass_through``);
- a video session's peer may send its camera (:mod:`camera`): the gateway's transceiver is then
  ``sendrecv``, and the frames of the track it receives go to the session's input like the
  WebSocket's frame messages; the answer's ``camera`` says whether the gateway takes them (a
  text session's peer gets a ``sendonly`` answer: its video is not received);
- the data channel carries the WebSocket's controls and answers (:mod:`steering`: ``prompt``,
  ``pause``, ``resume``, ``close`` with ``id`` and ``ack``/``error``), and the WebSocket's text
  messages ``state``, ``lag`` and ``end``;
- the peer connection closes when the session ends (``end`` first, on the channel), when the
  viewer goes (ICE fails or the client closes), when it never connects within
  :data:`CONNECT_S`, and on gateway shutdown (``end`` with ``gateway_shutdown``).

ICE: host candidates only, no STUN or TURN server is configured, so a peer must reach the
gateway's own addresses (one host, or one flat network). A peer connection is this process's
state: after a gateway restart the client posts a new offer (to any replica) and starts again
at the live edge; nothing of the old connection can be resumed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web
from aiortc import (
    RTCConfiguration,
    RTCDataChannel,
    RTCPeerConnection,
    RTCRtpCodecCapability,
    RTCRtpSender,
    RTCRtpTransceiver,
    RTCSessionDescription,
)
from aiortc.sdp import SessionDescription

from services.gateway import bodies, errors, lifetimes, steering
from services.gateway.camera import Camera
from services.gateway.chunktrack import ChunkTrack
from services.gateway.feeds import End
from services.gateway.inputs import Lane
from services.gateway.state import GATEWAY_STATE, Gateway, authorized_session, json_response
from shared.logging import get_logger
from shared.registry import SessionRecord
from shared.states import SessionState
from shared.wire import SessionInput

log = get_logger("turboserve.gateway")

# A peer that has not connected this long after its answer is given up.
CONNECT_S = 30.0
# How long the last messages on the data channel (the end) get to leave before the close.
FLUSH_S = 1.0
OFFER_FIELDS = frozenset({"type", "sdp"})
MAX_SDP_CHARS = 64_000


class InvalidOffer(errors.InvalidRequest):
    """The body is JSON, but no SDP offer aiortc can answer (or one without video)."""

    code = "invalid_offer"


class Peer:
    """One viewer's peer connection, its viewer of the session's feed and its steering."""

    def __init__(
        self, gw: Gateway, record: SessionRecord, operator: bool, pc: RTCPeerConnection
    ) -> None:
        self.gw = gw
        self.record = record
        self.operator = operator
        self.pc = pc
        self.channel: RTCDataChannel | None = None
        self.controls: asyncio.Queue[dict[str, Any]] = asyncio.Queue(steering.CONTROLS_IN_FLIGHT)
        self.steering = asyncio.Lock()  # held while a control is applied and answered
        self.connected = asyncio.Event()
        self.done = asyncio.Event()
        self.end: End | None = None
        self.track: ChunkTrack | None = None
        self.task: asyncio.Task[None] | None = None
        self.release: Callable[[], Awaitable[None]] | None = None  # leave the feed, detach
        self.cameras: list[Camera] = []  # the video tracks it sends (a video session's)
        self.lane: Lane | None = None  # where their frames go
        pc.on("connectionstatechange", self._on_state)
        pc.on("datachannel", self._on_channel)

    def _on_state(self) -> None:
        state = self.pc.connectionState
        if state == "connected":
            self.connected.set()
        elif state in ("failed", "closed"):
            self.done.set()

    def _on_channel(self, channel: RTCDataChannel) -> None:
        if self.channel is not None:
            return  # one control channel per peer; others stay unanswered
        self.channel = channel
        channel.on("message", self._on_message)

    def _on_message(self, data: str | bytes) -> None:
        if isinstance(data, bytes):
            self.send(
                steering.error_message(
                    None, None, errors.InvalidRequest("controls are text (JSON) messages")
                )
            )
            return
        try:
            body = steering.parse_control(data)
        except steering.ControlRefused as refused:
            self.send(refused.message)
            return
        try:
            self.controls.put_nowait(body)
        except asyncio.QueueFull:
            self.send(
                steering.error_message(
                    body["type"],
                    body.get("id"),
                    errors.Unavailable(
                        "too many controls in flight; wait for their answers",
                        limit=steering.CONTROLS_IN_FLIGHT,
                    ),
                )
            )

    def send(self, message: dict[str, Any]) -> None:
        channel = self.channel
        if channel is not None and channel.readyState == "open":
            channel.send(orjson.dumps(message).decode())

    def finish(self, end: End) -> None:
        self.end = end
        self.done.set()

    async def run(self) -> None:
        """Steer until the peer is done, then close it. A failure ends this peer only."""
        try:
            async with asyncio.TaskGroup() as tg:
                steer = tg.create_task(self._steer())
                watchdog = tg.create_task(self._connect_or_give_up())
                cameras = [tg.create_task(camera.run()) for camera in self.cameras]
                await self.done.wait()
                watchdog.cancel()
                for task in cameras:
                    task.cancel()
                async with self.steering:  # the answer to a control in flight goes first
                    steer.cancel()
            if self.end is not None:
                await self._say_end(self.end)
        except Exception:  # one viewer's failure must not stop the gateway (ctx.spawn would)
            log.exception("webrtc_peer_failed", session_id=self.record.id)
        finally:
            with contextlib.suppress(Exception):
                await self.pc.close()
            if self.release is not None:
                await self.release()

    async def _steer(self) -> None:
        while True:
            body = await self.controls.get()
            async with self.steering:
                self.send(await steering.answer(self.gw, self.record, self.operator, body))

    async def _connect_or_give_up(self) -> None:
        try:
            await asyncio.wait_for(self.connected.wait(), CONNECT_S)
        except TimeoutError:
            log.info("webrtc_peer_never_connected", session_id=self.record.id)
            self.done.set()

    async def _say_end(self, end: End) -> None:
        last = (
            self.track.sent_seq if self.track and end.reason == "gateway_shutdown" else end.last_seq
        )
        self.send(
            {"type": "end", "session_id": self.record.id, "last_seq": last, "reason": end.reason}
        )
        channel = self.channel
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(FLUSH_S):
                # aiortc signals only a drop below a threshold, not an empty queue
                open_ = channel is not None and channel.readyState == "open"
                while open_ and channel is not None and channel.bufferedAmount:  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
                    open_ = channel.readyState == "open"
                await asyncio.sleep(0.05)  # out of the SCTP queue is not yet on the wire


class PeerSet:
    """This gateway's peer connections: each one's task is supervised (``ctx.spawn``), and
    :meth:`close_all` ends them on shutdown."""

    def __init__(self) -> None:
        self.peers: set[Peer] = set()
        self.closed = False

    def start(self, peer: Peer) -> None:
        self.peers.add(peer)
        peer.task = peer.gw.ctx.spawn(self._run(peer), name=f"webrtc-{peer.record.id}")

    async def _run(self, peer: Peer) -> None:
        try:
            await peer.run()
        finally:
            self.peers.discard(peer)

    async def close_all(self, _app: web.Application | None = None) -> None:
        """End every peer (``end`` with ``gateway_shutdown`` on its channel) and wait for them;
        idempotent."""
        self.closed = True
        tasks = []
        for peer in list(self.peers):
            if peer.end is None:
                peer.finish(End(peer.track.sent_seq if peer.track else -1, "gateway_shutdown"))
            if peer.task is not None:
                tasks.append(peer.task)
        if tasks:
            await asyncio.wait(tasks, timeout=FLUSH_S + 4.0)


PEERS = web.AppKey("webrtc_peers", PeerSet)


def offer_of(body: dict[str, Any]) -> RTCSessionDescription:
    """The offer in a request body (already a JSON object with known fields)."""
    kind, sdp = body.get("type", "offer"), body.get("sdp")
    if kind != "offer":
        raise InvalidOffer("'type' must be 'offer'", field="type", value=kind)
    if not isinstance(sdp, str) or not sdp.strip():
        raise InvalidOffer("'sdp' must be a non-empty string (an SDP offer)", field="sdp")
    if len(sdp) > MAX_SDP_CHARS:
        raise InvalidOffer(
            f"'sdp' is over {MAX_SDP_CHARS} characters", field="sdp", limit=MAX_SDP_CHARS
        )
    return RTCSessionDescription(sdp=sdp, type="offer")


def preferred_codecs() -> list[RTCRtpCodecCapability]:
    """aiortc's video codecs, H.264 first: a peer that offers it gets the worker's chunks passed
    through (:mod:`chunktrack`); one that does not gets VP8, re-encoded."""
    codecs = RTCRtpSender.getCapabilities("video").codecs
    return sorted(codecs, key=lambda c: c.mimeType.lower() != "video/h264")


def negotiated_codec(sdp: str) -> str | None:
    """The video codec an answer settled on (its first), as a MIME type."""
    for media in SessionDescription.parse(sdp).media:
        if media.kind == "video" and media.rtp.codecs:
            return media.rtp.codecs[0].mimeType
    return None


async def _answer(
    pc: RTCPeerConnection, offer: RTCSessionDescription, video: RTCRtpTransceiver
) -> None:
    try:
        await pc.setRemoteDescription(offer)
    except RuntimeError:
        raise  # not the offer's fault: a 500 (logged), not a 400
    except Exception as exc:  # noqa: BLE001 - aiortc's parser raises ValueError, KeyError, ...
        raise InvalidOffer(
            f"not an SDP offer aiortc can answer: {exc!r}"[:300], field="sdp"
        ) from None
    if video.mid is None:
        raise InvalidOffer(
            "the offer receives no video (add a recvonly video transceiver)", field="sdp"
        )


async def peer_offer(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY_STATE]
    peers = request.app[PEERS]
    record, operator = await authorized_session(gw, request)
    offer = offer_of(await bodies.read_object(request, OFFER_FIELDS))
    if record.state is SessionState.TERMINATED:
        raise errors.SessionClosed(
            f"session {record.id} is closed", session_id=record.id, state=str(record.state)
        )
    if gw.closing.is_set() or peers.closed:
        raise errors.Unavailable("gateway is shutting down; retry on another replica")
    # Host candidates only: no STUN server (aiortc's default is a public one) and no TURN.
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    takes_camera = record.input is SessionInput.VIDEO
    video = pc.addTransceiver("video", direction="sendrecv" if takes_camera else "sendonly")
    video.setCodecPreferences(preferred_codecs())
    received: list[Any] = []  # the tracks the offer sends (aiortc's track events)
    pc.on("track", received.append)
    try:
        await _answer(pc, offer, video)
    except BaseException:
        await pc.close()
        raise
    try:  # where a new SSE stream starts: the live edge
        viewer = await gw.hub.join(record.id, max(-1, record.last_seq - 1))
    except BaseException:
        await pc.close()
        raise
    attachment: str | None = None
    peer = Peer(gw, record, operator, pc)
    try:
        attachment = await lifetimes.attach(gw, record.id)
        peer.track = ChunkTrack(viewer, peer.send, peer.finish)
        video.sender.replaceTrack(peer.track)
        if takes_camera:
            lane = gw.inputs.open(record)
            peer.lane = lane
            peer.cameras = [
                Camera(record.id, track, lane.accept, gw.settings.camera_max_fps)
                for track in received
                if track.kind == "video"
            ]
        await pc.setLocalDescription(await pc.createAnswer())
        codec = negotiated_codec(pc.localDescription.sdp)
        peer.track.pass_through = codec is not None and codec.lower() == "video/h264"
    except BaseException:
        await pc.close()
        await gw.hub.leave(viewer)
        if attachment is not None:
            await lifetimes.detach(gw, attachment)
        if peer.lane is not None:
            await gw.inputs.close(peer.lane)
        raise
    gw.metrics.clients.labels("webrtc").inc()

    async def release() -> None:
        gw.metrics.clients.labels("webrtc").dec()
        await gw.hub.leave(viewer)
        await lifetimes.detach(gw, attachment)
        if peer.lane is not None:
            await gw.inputs.close(peer.lane)

    peer.release = release
    peers.start(peer)
    local = pc.localDescription
    log.info(
        "webrtc_peer_answered",
        session_id=record.id,
        codec=codec,
        pass_through=peer.track.pass_through,
        camera=bool(peer.cameras),
    )
    return json_response(
        {
            "type": local.type,
            "sdp": local.sdp,
            "session_id": record.id,
            "video": {"codec": codec, "pass_through": peer.track.pass_through},
            "camera": bool(peer.cameras),
        }
    )
