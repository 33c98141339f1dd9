"""A video session's input frames at the worker: decoded, fitted to the model's resolution,
and held in a small buffer until the generation thread takes an input chunk.

``decode_frame`` turns one relayed image (JPEG as the viewer's client sent it; any format
Pillow reads) into an ``[H, W, 3]`` uint8 array at the model's resolution. The fit is cover and
centre crop: the image is scaled (Lanczos) so that it covers the model's frame, and what
overhangs is cut evenly from both sides, so the picture is never stretched and never
letterboxed. Resizing happens here, at the worker, once per frame: the gateway relays what it
got, and a frame crosses the network at the size the camera made it.

``InputBuffer`` is where those frames wait: thread-safe (the event loop puts, the generation
thread takes), bounded, and in order of the client's frame counter. When it is full the oldest
frame goes (a live input has no past worth keeping), counted in ``dropped``; a frame whose seq
is not after the last one put (a duplicate, or one overtaken) is refused as stale.
"""

from __future__ import annotations

import io
import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

from shared.wire import MAX_FRAME_PIXELS


class FrameRefused(Exception):
    """An input frame that cannot be used: ``code`` is ``not_an_image`` or ``frame_too_large``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def decode_frame(image: bytes, height: int, width: int) -> np.ndarray:
    """``image`` (encoded bytes) as ``[height, width, 3]`` uint8 RGB: cover, then centre crop
    (module docstring). Raises ``FrameRefused``."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(image)) as picture:
            w, h = picture.size
            if w * h > MAX_FRAME_PIXELS:
                raise FrameRefused(
                    "frame_too_large", f"a {w}x{h} image is larger than {MAX_FRAME_PIXELS} pixels"
                )
            rgb = picture.convert("RGB")
    except FrameRefused:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise FrameRefused("not_an_image", f"the frame is not a readable image: {exc}") from None
    scale = max(width / w, height / h)
    cover = (max(width, round(w * scale)), max(height, round(h * scale)))
    left, top = (cover[0] - width) // 2, (cover[1] - height) // 2
    if cover != (w, h):
        rgb = rgb.resize(cover, Image.Resampling.LANCZOS)
    if cover != (width, height):
        rgb = rgb.crop((left, top, left + width, top + height))
    return np.asarray(rgb, dtype=np.uint8)


@dataclass(frozen=True, slots=True)
class InputChunk:
    """The frames one output chunk is made from, oldest first."""

    frames: list[np.ndarray]
    first_seq: int
    last_seq: int
    captured_at: float  # the client's capture time of the chunk's last frame


class InputBuffer:
    """One video session's decoded input frames (module docstring). Thread-safe."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"an input buffer holds at least one frame, not {capacity}")
        self.capacity = capacity
        self._frames: deque[tuple[int, np.ndarray, float]] = deque()
        self._lock = threading.Lock()
        self._last_put = -1
        self.dropped = 0  # frames pushed out, oldest first, by newer ones
        self.stale = 0  # frames refused: their seq was not after the last one put

    def put(self, seq: int, pixels: np.ndarray, captured_at: float) -> bool:
        """Adds a frame; False (counted in ``stale``) when ``seq`` is not after the last put."""
        with self._lock:
            if seq <= self._last_put:
                self.stale += 1
                return False
            self._last_put = seq
            if len(self._frames) == self.capacity:
                self._frames.popleft()
                self.dropped += 1
            self._frames.append((seq, pixels, captured_at))
            return True

    def ready(self, count: int) -> bool:
        with self._lock:
            return len(self._frames) >= count

    def take(self, count: int) -> InputChunk | None:
        """The oldest ``count`` frames, removed; None (nothing removed) when fewer are here."""
        with self._lock:
            if len(self._frames) < count:
                return None
            taken = [self._frames.popleft() for _ in range(count)]
        return InputChunk(
            [pixels for _, pixels, _ in taken], taken[0][0], taken[-1][0], taken[-1][2]
        )

    def clear(self) -> None:
        """Drops what is buffered (a resumed session's frames from before its pause); the
        seq order carries on."""
        with self._lock:
            self._frames.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._frames)


__all__ = ["FrameRefused", "InputBuffer", "InputChunk", "decode_frame"]
