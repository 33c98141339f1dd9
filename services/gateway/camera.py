"""A video session's camera over WebRTC: the frames of the track a peer sends, as input frames.

A peer of a video session may send video on its offer's video m-line (``sendrecv``, the
playground's camera mode) or on one of its own. aiortc receives and decodes it (H.264 or VP8,
as negotiated) into frames; each is JPEG-encoded here, off the event loop, and handed to the
gateway's input relay like a frame sent over the WebSocket, so the worker sees one kind of
input whatever the transport. The frame's ``seq`` counts the frames forwarded on this track and
``captured_at`` is when the gateway received it (RTP carries no wall clock; the delay from the
camera to the gateway is not in it).

A camera runs at its own rate (30 fps is usual) and the model takes fewer frames a second:
frames closer than ``1 / max_fps`` to the last one forwarded are skipped here, so the relay
and the worker's buffer hold recent frames, not a backlog. The images keep the camera's size;
the worker fits them to the model's frame (cover, then centre crop).
"""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Callable
from typing import Any

from aiortc.mediastreams import MediaStreamError

from services.gateway import errors
from shared.logging import get_logger

log = get_logger("turboserve.gateway")

JPEG_QUALITY = 85
# (seq, captured_at, jpeg): the accept of this peer's input lane (``inputs.Lane``).
Forward = Callable[[int, float, bytes], None]


def jpeg_of(frame: Any) -> bytes:
    """One received ``av.VideoFrame`` as a JPEG."""
    out = io.BytesIO()
    frame.to_image().save(out, format="JPEG", quality=JPEG_QUALITY)
    return out.getvalue()


class Camera:
    """Reads one received video track until it ends, forwarding its frames (module docstring)."""

    def __init__(self, session_id: str, track: Any, forward: Forward, max_fps: float) -> None:
        self.session_id = session_id
        self.track = track
        self.forward = forward
        self.min_gap_s = 1.0 / max_fps if max_fps > 0 else 0.0
        self.forwarded = 0  # frames handed to the relay (the next frame's seq)
        self.skipped = 0  # frames closer than min_gap_s to the last one forwarded
        self.refused = 0  # frames the relay refused (logged once per code)
        self._refusals: set[str] = set()

    async def run(self) -> None:
        last = float("-inf")
        while True:
            try:
                frame = await self.track.recv()
            except MediaStreamError:
                return  # the peer stopped sending, or the connection closed
            now = time.time()
            if now - last < self.min_gap_s:
                self.skipped += 1
                continue
            last = now
            image = await asyncio.to_thread(jpeg_of, frame)
            try:
                self.forward(self.forwarded, now, image)
            except errors.ApiError as exc:
                self.refused += 1
                if exc.code not in self._refusals:
                    self._refusals.add(exc.code)
                    log.warning("camera_frame_refused", session_id=self.session_id, code=exc.code)
                continue
            self.forwarded += 1
