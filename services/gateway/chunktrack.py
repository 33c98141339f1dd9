"""A session's chunks as an aiortc video track: each chunk's JPEG frames decoded to
``av.VideoFrame`` and handed to aiortc, which encodes them for the peer (VP8 or H.264, as
negotiated), paced by each chunk's own fps.

Why decode and re-encode rather than pass the worker's H.264 through: aiortc takes encoded
packets only for H.264 (``H264Encoder.pack``), and a packet source cannot honour the peer's
keyframe requests or its bandwidth estimate, nor serve a peer that negotiated VP8; re-encoding
works for every peer and every chunk (one without a fragment too), at a cost the gateway pays
per viewer (``python -m services.gateway.webrtc_cost`` measures it; docs/gateway.md has the
figures).

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
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from PIL import Image

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


def decode_jpegs(frames: list[bytes]) -> list[av.VideoFrame]:
    """A chunk's JPEG frames as video frames (CPU work: run it off the event loop)."""
    out = []
    for data in frames:
        with Image.open(io.BytesIO(data)) as image:
            out.append(av.VideoFrame.from_image(image.convert("RGB")))
    return out


class ChunkTrack(MediaStreamTrack):
    """The video track of one viewer: reads the viewer's queue (chunks from the live edge on),
    sends notices and lag markers as text through ``on_text``, and ends with the session (or
    the gateway) through ``on_end``."""

    kind = "video"

    def __init__(self, viewer: Viewer, on_text: Callable[[dict[str, Any]], None],
                 on_end: Callable[[End], None]) -> None:
        super().__init__()
        self.viewer = viewer
        self.on_text = on_text
        self.on_end = on_end
        self.clock = FrameClock()
        self.frames: deque[tuple[av.VideoFrame, float]] = deque()
        self.sent_seq = -1
        self.decode_s = 0.0  # CPU time spent decoding chunks (thread time), for the cost figure

    async def recv(self) -> av.VideoFrame:
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
                frames, cpu_s = await asyncio.to_thread(_timed_decode, chunk.frame_bytes())
                self.decode_s += cpu_s
                self.frames.extend((f, chunk.fps) for f in frames)
                self.sent_seq = chunk.seq
            else:
                self.on_text({"type": "state", **notice_data(chunk)})
        elif isinstance(item, Lag):
            self.on_text({"type": "lag", "session_id": self.viewer.feed.session_id,
                          "skipped": item.skipped, "first_skipped": item.first_skipped,
                          "last_skipped": item.last_skipped})
        elif isinstance(item, End):
            self.on_end(item)
            self.stop()
            raise MediaStreamError


def _timed_decode(frames: list[bytes]) -> tuple[list[av.VideoFrame], float]:
    started = time.thread_time()
    decoded = decode_jpegs(frames)
    return decoded, time.thread_time() - started
