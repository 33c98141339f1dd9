"""The ``webrtc`` entry of ``turboserve bench stream``: the worker's H.264 passed through to
loopback aiortc viewers (``POST /v1/sessions/{id}/webrtc``), as :mod:`tools.bench.stream`
measures the other formats.

- ``encode_ms``: the gateway's own work per chunk on this path, the chunk's fMP4 fragment
  demuxed to Annex B packets (:func:`chunktrack.annexb_packets`); aiortc then only packetizes
  them. (The worker's H.264 encode is the fMP4 rows' figure: the same fragment.)
- ``bytes_per_s``: RTP payload bytes one viewer receives per second (retransmissions
  included), counted as each packet reaches the viewer's receiver: aiortc's receiver stats
  count packets, not bytes.
- ``delivery_ms``: from a chunk's NATS publish to the arrival, at the viewer, of the RTP packet
  that completes the chunk's first frame (its marker bit), before decoding. The track plays a
  chunk at its own fps, so a chunk's first frame leaves when the previous chunk has played out:
  the figure includes that pacing, as a browser would see it.

Which chunk an RTP packet belongs to: every chunk has the same frame count and fps, and the
track's 90 kHz clock runs on across chunks, so a packet's chunk is its timestamp's distance
from the viewer's first frame over one chunk's ticks. The viewers connect before the first
chunk is published, so their first chunk is seq 0; a viewer that is told it lagged (chunks
skipped) is counted in ``lags`` and its timings after the skip are left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tools.bench.stream_plan import Encoded, StreamPlan

# How long all viewers get to negotiate and connect before the first chunk.
CONNECT_S = 30.0


def pass_through_ms(encoded: Encoded, plan: StreamPlan) -> list[float]:
    """The gateway's work per chunk for an H.264 peer, ``plan.encode_runs`` chunks."""
    from services.gateway.chunktrack import annexb_packets

    out = []
    for run_ in range(plan.encode_runs):
        data = encoded.fmp4[run_ % len(encoded.fmp4)].data
        started = time.perf_counter()
        annexb_packets(data)
        out.append((time.perf_counter() - started) * 1000.0)
    return out


@dataclass
class RtpTally:
    """What one viewer's receiver saw."""

    payload_bytes: int = 0
    first_ts: int | None = None
    # chunk index (= seq) -> wall time the packet completing its first frame arrived
    first_frames: dict[int, float] = field(default_factory=dict)
    lagged: bool = False
    lags: int = 0
    decoded: int = 0


class WebRtcViewer:
    """An aiortc peer offering H.264 only, with a control channel (where ``lag`` and
    ``state`` arrive); it counts RTP payload bytes and notes each chunk's first frame."""

    def __init__(self, chunk_ticks: int, measuring: asyncio.Event) -> None:
        from aiortc import RTCConfiguration, RTCPeerConnection, RTCRtpReceiver

        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        video = self.pc.addTransceiver("video", direction="recvonly")
        capabilities = RTCRtpReceiver.getCapabilities("video")
        assert capabilities is not None  # aiortc always has video codecs
        video.setCodecPreferences(
            [c for c in capabilities.codecs if c.mimeType in ("video/H264", "video/rtx")]
        )
        self.receiver = video.receiver
        self.channel = self.pc.createDataChannel("control")
        self.channel.on("message", self._on_message)
        self.chunk_ticks = chunk_ticks
        self.measuring = measuring
        self.tally = RtpTally()
        self.h264_types: set[int] = set()
        self.connected = asyncio.Event()
        self.pc.on("connectionstatechange", self._on_state)
        self.tracks: asyncio.Queue[Any] = asyncio.Queue()
        self.pc.on("track", self.tracks.put_nowait)

    def _on_state(self) -> None:
        if self.pc.connectionState == "connected":
            self.connected.set()

    def _on_message(self, data: str | bytes) -> None:
        if isinstance(data, str) and '"type":"lag"' in data:
            self.tally.lags += 1
            self.tally.lagged = True

    async def connect(self, http: Any, sid: str, token: str) -> None:
        from aiortc import RTCSessionDescription
        from aiortc.sdp import SessionDescription

        from tools.bench.gateway import BenchError

        await self.pc.setLocalDescription(await self.pc.createOffer())
        offer = {"type": "offer", "sdp": self.pc.localDescription.sdp}
        async with http.post(
            f"/v1/sessions/{sid}/webrtc", json=offer, headers={"Authorization": f"Bearer {token}"}
        ) as resp:
            body = await resp.json()
            if resp.status != 200:
                raise BenchError(f"webrtc: the offer was refused: HTTP {resp.status} {body}")
        if not body["video"]["pass_through"]:
            raise BenchError(
                f"webrtc: the gateway answered {body['video']}, not H.264 pass-through"
            )
        for media in SessionDescription.parse(body["sdp"]).media:
            if media.kind == "video":
                self.h264_types = {
                    c.payloadType
                    for c in media.rtp.codecs
                    if c.mimeType.lower() == "video/h264" and c.payloadType is not None
                }
        self._count_packets()
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=body["sdp"], type="answer"))

    def _count_packets(self) -> None:
        """Wrap this receiver's RTP entry point (aiortc has no byte counter of its own)."""
        handle = self.receiver._handle_rtp_packet
        tally, ticks, h264 = self.tally, self.chunk_ticks, self.h264_types

        async def counted(packet: Any, arrival_time_ms: int) -> None:
            arrived = time.time()
            if self.measuring.is_set():
                tally.payload_bytes += len(packet.payload)
            if packet.payload_type in h264 and packet.marker and not tally.lagged:
                if tally.first_ts is None:
                    tally.first_ts = packet.timestamp
                offset = (packet.timestamp - tally.first_ts) & 0xFFFFFFFF
                if offset % ticks == 0:  # a chunk's first frame, now complete
                    tally.first_frames.setdefault(offset // ticks, arrived)
            await handle(packet, arrival_time_ms)

        self.receiver._handle_rtp_packet = counted  # type: ignore[method-assign]

    async def drain(self) -> None:
        """Read the decoded frames (a viewer's decoder runs anyway: aiortc's queue is unbounded)."""
        from aiortc.mediastreams import MediaStreamError

        track = await self.tracks.get()
        with contextlib.suppress(MediaStreamError):
            while True:
                await track.recv()
                self.tally.decoded += 1

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.pc.close()


async def deliver_webrtc(encoded: Encoded, plan: StreamPlan) -> dict[str, Any]:
    """``--webrtc-viewers`` aiortc viewers over ``min(--sessions, viewers)`` sessions of one
    gateway process; fMP4 chunks published at the period. Bytes/s per viewer, delivery p99."""
    import aiohttp
    import msgspec
    import nats

    from shared.quantiles import quantile
    from shared.settings import GatewaySettings
    from shared.wire import Subjects
    from tools.bench.gateway import (
        BenchError,
        _create_sessions,
        gateway_process,
        measure_while,
    )
    from tools.bench.stream_plan import chunk_message, inject

    settings = GatewaySettings.from_env()
    viewers_n = plan.webrtc_viewers
    fps = plan.frames / plan.period
    chunk_ticks = plan.frames * max(1, round(90_000 / fps))
    measuring, stop = asyncio.Event(), asyncio.Event()
    published: dict[tuple[str, int], float] = {}
    viewers: list[WebRtcViewer] = []
    drains: list[asyncio.Task[None]] = []
    async with gateway_process(settings.nats_url, settings.redis_url, "bwebrtc") as (
        tag,
        port,
        http_url,
    ):
        async with aiohttp.ClientSession(http_url) as http:
            sessions = await _create_sessions(
                http, min(plan.sessions, viewers_n), settings.redis_url, tag
            )
            watching = [sessions[i % len(sessions)][0] for i in range(viewers_n)]
            try:
                for i in range(viewers_n):
                    viewer = WebRtcViewer(chunk_ticks, measuring)
                    viewers.append(viewer)
                    await viewer.connect(http, *sessions[i % len(sessions)])
                    drains.append(asyncio.create_task(viewer.drain()))
                try:
                    async with asyncio.timeout(CONNECT_S):
                        await asyncio.gather(*(v.connected.wait() for v in viewers))
                except TimeoutError:
                    raise BenchError(
                        f"webrtc: {sum(not v.connected.is_set() for v in viewers)} "
                        f"of {viewers_n} viewers did not connect in {CONNECT_S:g} s"
                    ) from None
                nc = await nats.connect(settings.nats_url)
                try:
                    messages = [
                        [
                            msgspec.to_builtins(chunk_message("webrtc", encoded, c, sid, 0, plan))
                            for c in range(len(encoded.fmp4))
                        ]
                        for sid, _ in sessions
                    ]
                    _, window = await measure_while(
                        inject(
                            nc,
                            Subjects(tag),
                            plan,
                            [s for s, _ in sessions],
                            messages,
                            stop,
                            published,
                        ),
                        plan.warmup,
                        plan.seconds,
                        measuring,
                        stop,
                    )
                finally:
                    stop.set()
                    await nc.close()
            finally:
                for task in drains:
                    task.cancel()
                await asyncio.gather(*drains, return_exceptions=True)
                for viewer in viewers:
                    await viewer.close()
    latencies = []
    for viewer, sid in zip(viewers, watching, strict=True):
        for seq, arrived in viewer.tally.first_frames.items():
            sent = published.get((sid, seq))
            if sent is not None and window.started_at <= sent <= window.ended_at:  # measured
                latencies.append((arrived - sent) * 1000.0)
    if not latencies:
        raise BenchError("webrtc: no chunk's first frame reached a viewer in the measured time")
    lat = latencies
    return {
        "bytes_per_s": round(
            sum(v.tally.payload_bytes for v in viewers) / window.seconds / viewers_n
        ),
        "delivery_ms_p50": round(statistics.median(lat), 2),
        "delivery_ms_p99": round(quantile(lat, 0.99), 2),
        "viewers": viewers_n,
        "sessions": len(sessions),
        "chunks_received": len(lat),
        "lags": sum(v.tally.lags for v in viewers),
        "frames_decoded": sum(v.tally.decoded for v in viewers),
        "path": "H.264 pass-through (fragment to Annex B, packetized by aiortc)",
    }
