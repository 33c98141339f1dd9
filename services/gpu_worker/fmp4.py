"""A chunk as a self-contained fragmented MP4: H.264 in an init segment plus one fragment.

Each chunk is encoded on its own: a keyframe first, every frame of the chunk in one ``moof`` +
``mdat``, and no encoder state carried to the next chunk. So any chunk decodes alone (a viewer
joining at the live edge, a chunk from the worker a session migrated or recovered to), and
Media Source Extensions can append chunk after chunk: each carries its own ``ftyp`` + ``moov``
(about 0.7 KiB; appending an identical init segment again is allowed) and its fragment's
``tfdt`` is the chunk's own start on the session's timeline (``start_s``), so the fragments
of a session line up back to back.

Rate control: CRF with a cap (libx264's ``maxrate`` = ``TURBOSERVE_VIDEO_BITRATE``, and a VBV
buffer of half a chunk's bits), so easy pictures stay small and a busy one is held to the
bitrate. The VBV of ``ultrafast`` is not exact, so the bound is checked, not assumed: a chunk is
at most ``shared.video.chunk_bytes_limit`` (its duration at the bitrate, plus the container), and one
that comes out larger is encoded again with a coarser floor on the quantiser (``qmin``) until
it fits (uniform noise at 480x832 needs two or three retries at 2 Mbit/s). x264 runs on one thread
here: with sliced threads its VBV depends on how the threads race, and the same noise came out
40 to 53 KB at ``qmin`` 51 and 0.5 Mbit/s, against a bound of 51 KB. Even so, x264 at its
coarsest does not always fit noise (at 0.9 Mbit/s, say), so the last resort keeps the frame
count and shows fewer pictures: each frame held for two, then four frames (the repeats cost
x264 next to nothing), which a viewer sees as a stutter in that chunk and not as a lost one. A
chunk that fits in none of these is refused (:class:`FragmentTooLarge`): a single coarsest
keyframe of noise at 480x832 is about 15 KB, so only a bitrate near the
lowest the worker accepts (0.1 Mbit/s) gets there.

Why H.264 (libx264, ``yuv420p``, the ``zerolatency`` tune: no B-frames, no lookahead): every
browser plays it through MSE, most with hardware decode, and the FFmpeg that PyAV ships has
the encoder. PyAV's mp4 muxer does the container; the options below only ask it for
fragments (``frag_keyframe+empty_moov+default_base_moof``, the MSE form), to keep the
timestamps we give it (``frag_discont`` with ``avoid_negative_ts=disabled``: otherwise the
muxer shifts every chunk to start at 0) and to skip the ``mfra`` index, which a stream has no
use for.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Final

import numpy as np

from services.gpu_worker.codec import frames_array
from shared.settings import DEFAULT_VIDEO_BITRATE
from shared.video import chunk_bytes_limit

TIMESCALE = 90_000  # ticks per second, the video norm: 16 fps and 12 fps are both whole ticks
CODEC: Final = "libx264"  # Final keeps the literal, so PyAV's typing knows a video stream
# ultrafast: on two shared CPU cores a 12-frame 480x832 chunk encodes in about 40-70 ms (a
# fifth of a 0.75 s period is 150 ms); CRF 26 keeps the textured case well under JPEG's size.
PRESET = "ultrafast"
CRF = 26
# The encodes of one chunk, (quantiser floor, frames each picture is held for): the capped CRF
# first, then coarser floors, then fewer pictures, while the chunk is over its bound.
ENCODE_STEPS: tuple[tuple[int | None, int], ...] = (
    (None, 1),
    (36, 1),
    (44, 1),
    (51, 1),
    (51, 2),
    (51, 4),
)
MOVFLAGS = "frag_keyframe+empty_moov+default_base_moof+frag_discont+skip_trailer"


@dataclass(frozen=True, slots=True)
class Fragment:
    """One encoded chunk and what a player needs to append it."""

    data: bytes  # ftyp + moov + moof + mdat
    mime: str  # for MediaSource.isTypeSupported / addSourceBuffer, with the codec's profile
    start_s: float  # the first frame's time on the session's timeline
    duration_s: float
    encode_ms: float
    limit_bytes: int = 0  # the bound it was held to (0: none)
    encodes: int = 1  # how many encodes it took to fit the bound
    hold: int = 1  # each picture shown for this many frames (above 1: held to fit the bound)


class FragmentTooLarge(Exception):
    """Even at libx264's coarsest quantiser the chunk is over its bound: not sent."""

    retryable = False

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"chunk of {size} bytes over its bound of {limit} bytes")
        self.size = size
        self.limit = limit


def chunk_start_s(seq: int, duration_s: float) -> float:
    """Where a chunk starts on its session's timeline: every chunk lasts one period whatever
    its frame count (``generation.playback_fps``), so seq x duration; it needs nothing from
    earlier chunks, so a migrated or recovered session's timeline goes on unbroken."""
    return seq * duration_s


def encode_chunk(
    frames: Any,
    fps: float,
    start_s: float,
    *,
    bitrate: int = DEFAULT_VIDEO_BITRATE,
    crf: int = CRF,
    preset: str = PRESET,
) -> Fragment:
    """``frames``: uint8 ``[T, H, W, 3]`` RGB (a tensor or an array), played at ``fps``, held
    to ``bitrate`` (bits/s): the fragment is at most ``shared.video.chunk_bytes_limit`` bytes, or
    :class:`FragmentTooLarge` is raised."""
    array = frames_array(frames)
    if not len(array):
        raise ValueError("a fragment needs at least one frame")
    array = _even(array)
    count = int(array.shape[0])
    if fps <= 0:
        raise ValueError(f"fps must be positive, got {fps}")
    started = time.perf_counter()
    limit = chunk_bytes_limit(bitrate, count / fps)
    data = b""
    for encodes, (qmin, hold) in enumerate(ENCODE_STEPS, start=1):
        data = _encode(_held(array, hold), fps, start_s, bitrate, crf, preset, qmin)
        if len(data) <= limit:
            return Fragment(
                data=data,
                mime=mime_of(data),
                start_s=start_s,
                duration_s=count / fps,
                encode_ms=(time.perf_counter() - started) * 1000.0,
                limit_bytes=limit,
                encodes=encodes,
                hold=hold,
            )
    raise FragmentTooLarge(len(data), limit)


def _encode(
    array: np.ndarray,
    fps: float,
    start_s: float,
    bitrate: int,
    crf: int,
    preset: str,
    qmin: int | None,
) -> bytes:
    import av  # FFmpeg: imported where used, so contract code and tests need not load it

    count, height, width, _ = array.shape
    duration_s = count / fps
    buffer = io.BytesIO()
    tick = Fraction(1, TIMESCALE)
    with av.open(
        buffer, "w", format="mp4", options={"movflags": MOVFLAGS, "avoid_negative_ts": "disabled"}
    ) as out:
        stream = out.add_stream(CODEC, rate=Fraction(fps).limit_denominator(1000))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.time_base = tick
        stream.codec_context.time_base = tick
        # One GOP per chunk: the keyframe is the chunk's first frame, no other.
        options: dict[str, str] = {
            "preset": preset,
            "tune": "zerolatency",
            "crf": str(crf),
            "maxrate": str(bitrate),
            # Half a chunk's bits, starting half full: the chunk's bits stay near the cap.
            "bufsize": str(max(1, round(bitrate * duration_s / 2))),
            "x264-params": "vbv-init=0.5",
            "g": str(max(count, 1)),
            "keyint_min": str(max(count, 1)),
            # One thread: with sliced threads x264's VBV depends on how the threads race, so
            # the same frames came out up to 20% apart; one thread gives the same bytes every
            # time, as fast on two cores (a worker encodes its sessions' chunks in parallel, one
            # per thread: encoder.py).
            "threads": "1",
        }
        if qmin is not None:
            options["qmin"] = str(qmin)
        stream.options = dict(options)
        for i, frame in enumerate(array):
            picture = av.VideoFrame.from_ndarray(frame, format="rgb24")
            picture.pts = round((start_s + i / fps) * TIMESCALE)
            picture.time_base = tick
            for packet in stream.encode(picture):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buffer.getvalue()


def mime_of(data: bytes) -> str:
    """``video/mp4; codecs="avc1.PPCCLL"`` from the ``avcC`` box (profile, constraints, level)."""
    at = data.find(b"avcC")
    if at < 0 or len(data) < at + 8:
        return "video/mp4"
    return f'video/mp4; codecs="avc1.{data[at + 5 : at + 8].hex().upper()}"'


def decode_fragment(data: bytes) -> tuple[np.ndarray, list[float]]:
    """Frames ``[T, H, W, 3]`` RGB and their times (s), from one fragment alone: for tests and
    the bench."""
    import av

    frames, times = [], []
    with av.open(io.BytesIO(data), "r", format="mp4") as container:
        for frame in container.decode(video=0):
            frames.append(frame.to_ndarray(format="rgb24"))
            times.append(float(frame.time) if frame.time is not None else float("nan"))
    return np.stack(frames) if frames else np.zeros((0, 0, 0, 3), np.uint8), times


def _held(array: np.ndarray, hold: int) -> np.ndarray:
    """Each ``hold``-th frame repeated in place of the ``hold - 1`` after it; as many frames."""
    if hold <= 1:
        return array
    return array[(np.arange(len(array)) // hold) * hold]


def _even(array: np.ndarray) -> np.ndarray:
    """4:2:0 needs even sides: an odd side gets its last row or column repeated."""
    _, height, width, _ = array.shape
    pad_h, pad_w = height % 2, width % 2
    if not (pad_h or pad_w):
        return array
    return np.pad(array, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
