"""The chunk encoders: H.264 off the generation thread.

The generation thread hands each finished chunk's frames here and goes on with the next pass;
a pool of threads encodes them (libav releases the GIL while it encodes, so the threads run in
parallel with each other and with the engine). What comes back is a future per chunk: the
publisher awaits them in the order they were handed in, so a session's chunks go out in seq
order, and the generation thread reads the encode times of the finished ones into the chunk
times it measures (a chunk's time is its passes and its encoding).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from services.gpu_worker.fmp4 import Fragment, chunk_start_s, encode_chunk

FPS = 16.0  # playback rate of an unpaced worker's chunks (a chunk period of 0)


def playback_fps(frames: int, period_s: float) -> float:
    """The rate a chunk's frames play at: a chunk carries as much video as its period, whatever
    sets the period (emulation, the profile, TURBOSERVE_CHUNK_PERIOD_S) and however many frames
    this chunk has (a model's first chunk may carry fewer). Unpaced (period 0): FPS."""
    if period_s <= 0 or frames <= 0:
        return FPS
    return frames / period_s


def chunk_duration_s(frames: int, period_s: float) -> float:
    """How long a chunk of ``frames`` plays: its period, or frames at FPS unpaced."""
    return frames / playback_fps(frames, period_s)


@dataclass(frozen=True, slots=True)
class EncodedChunk:
    fragment: Fragment
    fps: float
    encode_ms: float


def default_threads(slots: int) -> int:
    """One encoder per session slot (a pass ends at most one chunk per slot), at most one per
    CPU."""
    return max(1, min(slots, os.cpu_count() or 1))


class ChunkEncoder:
    """A pool of encoder threads; :meth:`submit` is thread-safe and never blocks."""

    def __init__(self, threads: int, *, bitrate: int, period_s: float) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.bitrate = bitrate
        self.period_s = period_s
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="encode")

    def submit(self, frames: Any, seq: int) -> Future[EncodedChunk]:
        return self._pool.submit(self.encode, frames, seq)

    def encode(self, frames: Any, seq: int) -> EncodedChunk:
        """The chunk as a self-contained fragment: every gateway fans out these bytes as they
        are. It stands alone (keyframe first, no encoder state kept), so a migration, a
        recovery or a viewer joining mid-stream needs nothing from earlier chunks."""
        started = time.perf_counter()
        count = int(frames.shape[0])
        fps = playback_fps(count, self.period_s)
        fragment = encode_chunk(frames, fps, chunk_start_s(seq, count / fps), bitrate=self.bitrate)
        return EncodedChunk(
            fragment=fragment, fps=fps, encode_ms=(time.perf_counter() - started) * 1000.0
        )

    def close(self) -> None:
        """Finish what was handed in, then stop the threads; idempotent."""
        self._pool.shutdown(wait=True)
