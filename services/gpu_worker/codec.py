"""Frame encoding for the wire: one encoded image per video frame.

Formats (the ``fmt`` argument, also the value clients see in a chunk's ``encoding``):

- ``jpeg``: baseline JPEG, 4:2:0, ``quality`` 1-95 (default 80). What the SSE stream sends.
- ``png``: lossless, for tests and debugging.
- ``raw``: the frame's bytes as is, ``H * W * 3`` RGB, row-major (the receiver needs the shape).

Frames are a uint8 tensor or array ``[T, H, W, 3]`` (RGB). Encoding is per frame so that a
client can show frames as they arrive and drop late ones without a decoder state.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

FRAME_FORMATS = ("jpeg", "png", "raw")


def frames_array(frames: Any) -> np.ndarray:
    """Frames as a contiguous uint8 ``[T, H, W, 3]`` array, from a tensor or an array;
    ``ValueError`` for anything else."""
    array = frames.numpy() if hasattr(frames, "numpy") else np.asarray(frames)
    if array.dtype != np.uint8 or array.ndim != 4 or array.shape[-1] != 3:
        raise ValueError(
            f"frames must be uint8 [T, H, W, 3], got {array.dtype} {list(array.shape)}"
        )
    return np.ascontiguousarray(array)


def encode_frames(frames: Any, fmt: str = "jpeg", quality: int = 80) -> list[bytes]:
    """One encoded image per frame, in order."""
    if fmt not in FRAME_FORMATS:
        raise ValueError(f"unknown frame format {fmt!r}; known: {', '.join(FRAME_FORMATS)}")
    if not 1 <= quality <= 95:
        raise ValueError(f"quality must be in 1..95, got {quality}")
    array = frames_array(frames)
    if fmt == "raw":
        return [frame.tobytes() for frame in array]
    from PIL import Image

    out = []
    for frame in array:
        buffer = io.BytesIO()
        image = Image.fromarray(frame)  # uint8 [H, W, 3] is RGB
        if fmt == "jpeg":
            image.save(buffer, format="JPEG", quality=quality)
        else:
            image.save(buffer, format="PNG", compress_level=1)
        out.append(buffer.getvalue())
    return out


def decode_frame(
    data: bytes, fmt: str = "jpeg", shape: tuple[int, int] | None = None
) -> np.ndarray:
    """``[H, W, 3]`` uint8 from one encoded frame (``shape`` = (H, W) is needed for raw)."""
    if fmt == "raw":
        if shape is None:
            raise ValueError("raw frames need shape=(H, W) to decode")
        return np.frombuffer(data, dtype=np.uint8).reshape(*shape, 3)
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
