"""JPEG frames for the viewers that ask for them (``?format=jpeg``), made here from the chunk's
H.264 fragment: the wire carries video alone.

A chunk is decoded (PyAV) and its frames JPEG-encoded (PIL) once on this gateway, however many
of the session's viewers here take JPEG, and only when one does: :class:`Jpegs` holds the
result per chunk (on the feed's :class:`~services.gateway.feeds.Entry`), started as the chunk
arrives while the feed has a JPEG viewer, or when a JPEG viewer first asks for a chunk from
the ring. The work runs on a pool of threads (libav and PIL release the GIL), never on the event
loop; a fragment that does not decode gives no frames (logged once), and viewers skip it.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
from concurrent.futures import ThreadPoolExecutor

from shared.logging import get_logger

log = get_logger("turboserve.gateway")

# Decoder threads: a chunk is one thread's work; a few at once keep several sessions' JPEG
# viewers fed without taking every core of the gateway's host.
JPEG_THREADS = max(1, min(4, os.cpu_count() or 1))


def fragment_jpegs(fragment: bytes, quality: int) -> list[bytes]:
    """The fragment's frames, one JPEG each (baseline, 4:2:0), in order."""
    import av  # FFmpeg: imported where used
    from PIL import Image

    out = []
    with av.open(io.BytesIO(fragment), "r", format="mp4") as container:
        for frame in container.decode(video=0):
            image: Image.Image = frame.to_image()  # type: ignore[no-untyped-call]
            buffer = io.BytesIO()
            image.save(buffer, format="JPEG", quality=quality)
            out.append(buffer.getvalue())
    return out


class JpegFrames:
    """One chunk's JPEG frames: the raw bytes (the WebSocket's) and their base64 text (SSE's)."""

    __slots__ = ("base64", "frames")

    def __init__(self, frames: list[bytes]) -> None:
        self.frames = frames
        self.base64 = [base64.b64encode(f) for f in frames]


class Jpegs:
    """The gateway's JPEG makers: a thread pool and the quality."""

    def __init__(self, quality: int, threads: int = JPEG_THREADS) -> None:
        self.quality = quality
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="jpeg")
        self.made = 0  # chunks decoded to JPEG (one per chunk and gateway, however many viewers)

    def start(self, fragment: bytes) -> asyncio.Future[JpegFrames]:
        """Decode and encode ``fragment`` on the pool; the future is shared by every viewer."""
        self.made += 1
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._pool, _make, fragment, self.quality)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _make(fragment: bytes, quality: int) -> JpegFrames:
    try:
        return JpegFrames(fragment_jpegs(fragment, quality))
    except Exception as exc:  # noqa: BLE001 - one bad fragment: no frames, never the gateway
        log.warning("fragment_not_decoded", error=repr(exc), fragment_bytes=len(fragment))
        return JpegFrames([])
