"""What ``bench stream`` and its WebRTC part share: the plan from the options, the encoded
chunks, the wire message a worker would publish for one, and the publisher that paces them."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nats.aio.client import Client as NatsClient

    from shared.wire import Subjects


@dataclass(frozen=True, slots=True)
class StreamPlan:
    """What ``bench stream`` measures, from its options."""

    viewers: int
    sessions: int
    seconds: float
    warmup: float
    period: float
    frames: int
    height: int
    width: int
    chunks: int
    encode_runs: int
    kinds: tuple[str, ...]
    webrtc_viewers: int = 4


@dataclass
class Encoded:
    fmp4: list[Any] = field(default_factory=list)  # fmp4.Fragment
    jpeg_ms: list[float] = field(default_factory=list)  # the gateway's, per chunk
    fmp4_ms: list[float] = field(default_factory=list)  # the worker's, per chunk


def chunk_message(fmt: str, encoded: Encoded, i: int, sid: str, seq: int, plan: StreamPlan) -> Any:
    """The wire Chunk a worker would publish (the same for every format)."""
    from shared.wire import Chunk

    now = time.time()
    fragment = encoded.fmp4[i]
    return Chunk(
        session_id=sid,
        seq=seq,
        worker_id="bench",
        epoch=1,
        width=plan.width,
        height=plan.height,
        fps=plan.frames / plan.period,
        gen_ms=0.0,
        batch=1,
        due_at=now,
        done_at=now,
        fmp4=fragment.data,
        fmp4_mime=fragment.mime,
        start_s=seq * plan.period,
        duration_s=plan.period,
        encode_ms=0.0,
    )


async def inject(
    nc: NatsClient,
    subjects: Subjects,
    plan: StreamPlan,
    session_ids: list[str],
    messages: list[list[dict[str, Any]]],
    stop: asyncio.Event,
    published: dict[tuple[str, int], float] | None = None,
) -> None:
    """One chunk per session per period, sessions spread over the period; each prepared
    chunk gets its seq and its publish time (``done_at``) on the way out, also kept in
    ``published`` by (session, seq) where given."""
    import msgspec

    from tools.bench.gateway import paced

    async def publish(i: int, seq: int) -> None:
        chunk = messages[i][seq % len(messages[i])]
        now = time.time()
        chunk.update(seq=seq, due_at=now, done_at=now, start_s=seq * plan.period)
        await nc.publish(subjects.chunks(session_ids[i]), msgspec.json.encode(chunk))
        if published is not None:
            published[(session_ids[i], seq)] = now

    await paced(plan.period, len(session_ids), stop, publish)
    await nc.flush()
