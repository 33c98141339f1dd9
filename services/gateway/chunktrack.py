"""A session's chunks as an aiortc video track, paced by each chunk's own fps.

Two ways a chunk becomes video, chosen per peer and per chunk:

- **pass-through** (a peer that negotiated H.264, a chunk with its fMP4 fragment): the worker's
  H.264 packets, demuxed from the fragment and rewritten to Annex B (``h264_mp4toannexb``: the
  SPS/PPS go in front of the chunk's keyframe), are handed to aiortc as ``av.Packet``, which it
  only packetizes (``H264Encoder.pack``). The worker encodes constrained baseline, a keyframe
  first in every chunk and no B-frames, which is what WebRTC's H.264 wants. What aiortc cannot do
  with packets: answer the peer's keyframe requests (the next keyframe is the next chunk's, at
  most a period away) or follow its bandwidth estimate (the stream is the worker's bitrate);
- **re-encode** (a VP8 peer): the chunk's fragment decoded to ``av.VideoFrame`` and encoded by
  aiortc for that peer, at a CPU cost per viewer (``turboserve bench webrtc-cost``;
  docs/gateway.md has the figures).

Timestamps: one 90 kHz clock per track, continuous across chunks (a frame lasts ``1/fps`` of
its chunk); :class:`FrameClock` is the pure part, tested without sockets.
"""

from __future__ import annotations

import asyncio
import io
import time
from collections import deque
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import av
import av.bitstream
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from services.gateway.chunkview import ChunkView
from services.gateway.feeds import End, Entry, Lag, Viewer
from services.gateway.sse import notice_data
from shared.logging import get_logger

log = get_logger("turboserve.gateway")

VIDEO_CLOCK = 90_000
TIME_BASE = Fraction(1, VIDEO_CLOCK)
# How often a track waiting for a chunk looks again (the viewer's queue wakes it sooner).
WAIT_S = 1.0


class FrameClock:
    """Presentation times on one continuous 90 kHz clock, and when each frame is due.

    ``anchor``: the wall-clock (monotonic) time of pts 0. A frame found late by more than one
    frame period (the next chunk came after the last one had played out, or the track was not
    read for a while) moves the anchor to now: the video pauses for the gap instead of
    bursting through it."""

    def __init__(self) -> None:
        self.next_pts = 0
        self.anchor: float | None = None

    def stamp(self, fps: float) -> tuple[int, int]:
        """The pts of the next frame of a chunk played at ``fps``, and its duration in ticks."""
        duration = max(1, round(VIDEO_CLOCK / fps)) if fps > 0 else VIDEO_CLOCK // 16
        pts = self.next_pts
        self.next_pts += duration
        return pts, duration

    def wait_s(self, pts: int, duration: int, now: float) -> float:
        """Seconds to wait before the frame at ``pts`` goes out."""
        due = None if self.anchor is None else self.anchor + pts / VIDEO_CLOCK
        if due is None or now - due > duration / VIDEO_CLOCK:
            self.anchor = now - pts / VIDEO_CLOCK
            return 0.0
        return max(0.0, due - now)


def annexb_packets(fragment: bytes) -> list[av.Packet[Any]]:
    """A chunk's H.264 packets from its self-contained fMP4 fragment, in Annex B (start codes,
    SPS/PPS before the keyframe), as aiortc's H.264 packetizer reads them (CPU work: run it off
    the event loop)."""
    out = []
    with av.open(io.BytesIO(fragment), "r", format="mp4") as container:
        stream = container.streams.video[0]
        annexb = av.bitstream.BitStreamFilterContext("h264_mp4toannexb", stream)
        for packet in container.demux(stream):
            for filtered in annexb.filter(packet if packet.size else None):
                if filtered.size:
                    out.append(filtered)
        out.extend(p for p in annexb.filter(None) if p.size)
    return out


def decode_fragment(fragment: bytes) -> list[av.VideoFrame]:
    """A chunk's frames, decoded from its fragment, for a peer that needs them re-encoded (CPU
    work: run it off the event loop)."""
    with av.open(io.BytesIO(fragment), "r", format="mp4") as container:
        return list(container.decode(video=0))


class ChunkTrack(MediaStreamTrack):
    """The video track of one viewer: reads the viewer's queue (chunks from the live edge on),
    sends notices and lag markers as text through ``on_text``, and ends with the session (or
    the gateway) through ``on_end``."""

    kind = "video"

    def __init__(
        self,
        viewer: Viewer,
        on_text: Callable[[dict[str, Any]], None],
        on_end: Callable[[End], None],
    ) -> None:
        super().__init__()
        self.viewer = viewer
        self.on_text = on_text
        self.on_end = on_end
        self.clock = FrameClock()
        self.frames: deque[tuple[av.VideoFrame | av.Packet[Any], float]] = deque()
        # Set once the answer says H.264: chunks with a fragment then pass through.
        self.pass_through = False
        self.sent_seq = -1
        self.chunks = {"passed": 0, "reencoded": 0}
        self.decode_s = 0.0  # CPU time spent on chunks (thread time), for the cost figure

    async def recv(self) -> av.VideoFrame | av.Packet[Any]:
        while not self.frames:
            await self._refill()
        frame, fps = self.frames.popleft()
        pts, duration = self.clock.stamp(fps)
        wait = self.clock.wait_s(pts, duration, time.monotonic())
        if wait > 0:
            await asyncio.sleep(wait)
        frame.pts, frame.time_base = pts, TIME_BASE
        return frame

    async def _refill(self) -> None:
        if self.readyState != "live":
            raise MediaStreamError
        item = await self.viewer.next(WAIT_S)
        if isinstance(item, Entry):
            chunk = item.item
            if isinstance(chunk, ChunkView):
                passing = self.pass_through
                frames, cpu_s = await asyncio.to_thread(
                    _timed, annexb_packets if passing else decode_fragment, chunk.fragment_bytes()
                )
                self.decode_s += cpu_s
                self.chunks["passed" if passing else "reencoded"] += 1
                self.frames.extend((f, chunk.fps) for f in frames)
                self.sent_seq = chunk.seq
            else:
                self.on_text({"type": "state", **notice_data(chunk)})
        elif isinstance(item, Lag):
            self.on_text(
                {
                    "type": "lag",
                    "session_id": self.viewer.feed.session_id,
                    "skipped": item.skipped,
                    "first_skipped": item.first_skipped,
                    "last_skipped": item.last_skipped,
                }
            )
        elif isinstance(item, End):
            self.on_end(item)
            self.stop()
            raise MediaStreamError


def _timed(work: Callable[[Any], list[Any]], data: Any) -> tuple[list[Any], float]:
    started = time.thread_time()
    done = work(data)
    return done, time.thread_time() - started
