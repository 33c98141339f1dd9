"""What the video bitrate (``TURBOSERVE_VIDEO_BITRATE``) bounds, in bytes: one chunk's fragment,
its NATS message, and what the chunk stream retains for every session's resume window.

Pure arithmetic, shared by the worker (which holds every chunk to the bound and checks the
message against the server's ``max_payload`` at start), the stream declarations (retention),
the deployment files (the NATS limits) and ``turboserve model check``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shared.settings import (
    DEFAULT_CHUNK_PERIOD_S,
    DEFAULT_STREAM_SESSIONS,
    DEFAULT_VIDEO_BITRATE,
    CommonSettings,
)

MIB = 1024 * 1024

# The container around the H.264 of one chunk: ftyp + moov (about 0.7 KiB) and moof (a sample
# entry per frame), with room to spare.
FRAGMENT_OVERHEAD_BYTES = 4096
# The wire message's other fields (JSON: ids, timings, the MIME type), with room to spare.
WIRE_OVERHEAD_BYTES = 4096
# NATS's own default max_payload, what a server that says nothing else takes.
NATS_DEFAULT_MAX_PAYLOAD = 1024 * 1024
# The resume window the gateway promises a client reconnecting with Last-Event-ID: the last 64
# chunks of its session, for five minutes.
CHUNKS_PER_SESSION = 64
CHUNK_RETENTION_S = 300.0


def chunk_bytes_limit(bitrate: int, duration_s: float) -> int:
    """The most bytes one chunk's fragment may take: its duration at ``bitrate`` (bits/s),
    plus the container."""
    return math.ceil(bitrate * duration_s / 8) + FRAGMENT_OVERHEAD_BYTES


def chunk_wire_bytes(bitrate: int, duration_s: float) -> int:
    """The most bytes one chunk's NATS message may take: the fragment's bound as base64 (the
    message is JSON), plus the other fields."""
    return 4 * math.ceil(chunk_bytes_limit(bitrate, duration_s) / 3) + WIRE_OVERHEAD_BYTES


class PayloadTooSmall(Exception):
    """A chunk at this bitrate may not fit one NATS message of the server's max_payload."""

    retryable = False

    def __init__(self, bitrate: int, duration_s: float, wire_bytes: int, max_payload: int) -> None:
        super().__init__(
            f"TURBOSERVE_VIDEO_BITRATE={bitrate}: a chunk of {duration_s:g} s may take "
            f"{wire_bytes} bytes on NATS, over the server's max_payload of {max_payload} "
            "bytes; lower the bitrate or raise max_payload"
        )
        self.bitrate = bitrate
        self.duration_s = duration_s
        self.wire_bytes = wire_bytes
        self.max_payload = max_payload


def check_payload(bitrate: int, duration_s: float, max_payload: int) -> int:
    """The chunk's wire bound, or :class:`PayloadTooSmall` when it exceeds ``max_payload``."""
    wire = chunk_wire_bytes(bitrate, duration_s)
    if wire > max_payload:
        raise PayloadTooSmall(bitrate, duration_s, wire, max_payload)
    return wire


def retention_bytes(bitrate: int, sessions: int, period_s: float) -> int:
    """The chunk stream's ``max_bytes``: every session's resume window at the chunk bound,
    ``sessions x CHUNKS_PER_SESSION x chunk_wire_bytes(bitrate, period_s)``."""
    return sessions * CHUNKS_PER_SESSION * chunk_wire_bytes(bitrate, period_s)


@dataclass(frozen=True, slots=True)
class ChunkRetention:
    """What the chunk stream keeps: every session's resume window at the chunk bound of the
    bitrate, for ``sessions`` sessions (one formula for the stream's declaration and the NATS
    server's limits)."""

    video_bitrate: int = DEFAULT_VIDEO_BITRATE
    sessions: int = DEFAULT_STREAM_SESSIONS
    period_s: float = DEFAULT_CHUNK_PERIOD_S

    @classmethod
    def of(cls, settings: CommonSettings) -> ChunkRetention:
        return cls(settings.video_bitrate, settings.stream_sessions)

    @property
    def max_bytes(self) -> int:
        """The chunk stream's ``max_bytes``."""
        return retention_bytes(self.video_bitrate, self.sessions, self.period_s)

    @property
    def memory_store_bytes(self) -> int:
        """The NATS server's JetStream ``max_memory_store``: the chunk stream's bytes and a
        quarter more (consumers, indexes), in whole MiB (the sessions stream is on disk)."""
        return -(-self.max_bytes * 5 // 4 // MIB) * MIB


def nats_limits_config(retention: ChunkRetention, store_dir: str | None = None) -> str:
    """The nats-server settings that carry the chunks (one config's text): ``max_payload``
    explicit (NATS's default, which a chunk at the bitrate fits) and the JetStream memory."""
    store = f'  store_dir: "{store_dir}"\n' if store_dir else ""
    return (
        f"max_payload: {NATS_DEFAULT_MAX_PAYLOAD}\n"
        f"jetstream {{\n{store}  max_memory_store: {retention.memory_store_bytes}\n}}\n"
    )
