"""Playback pacing: when each session's next chunk is due, and which sessions join a pass.

Pure logic (no torch, no threads), used by the generation loop.

A session plays at its own pace. Chunk k is due at ``due_k``: the first when the worker starts
the session (assignment, resume), each next one a chunk period after the previous one was due,
or after it was done if it was late (a late chunk stalls the viewer, whose clock slips):
``due_{k+1} = max(due_k, done_k) + period``. The worker starts chunk k's first pass at
``due_k - max(lead, estimated chunk time)``, so the chunk is done by its due time and at most
``lead`` ahead of it (the viewer's buffer). A session that is ahead sits out of the batched
passes until then; a session in the middle of a chunk, or one that is due or late, takes every
pass, so a late session never waits for an early one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(slots=True)
class PlaybackClock:
    """One session's playback clock (wall-clock seconds)."""

    due: float  # when its next chunk is due
    last_lead_ms: float | None = None  # how far its last chunk was ahead of its due time

    def chunk_done(self, done_at: float, period_s: float) -> float:
        """Records that the chunk due at ``self.due`` was done at ``done_at``; returns that due
        time and moves the clock to the next chunk's."""
        due = self.due
        self.last_lead_ms = (due - done_at) * 1000.0
        self.due = max(due, done_at) + period_s if period_s > 0 else done_at
        return due


@dataclass(frozen=True, slots=True)
class PassPlan:
    """Who takes the next pass, who waits, and when the first waiting session is due to start."""

    participants: list[str]
    waiting: list[str]
    next_start: float | None  # wall clock; None when nobody waits

    def wait_s(self, now: float) -> float | None:
        """How long the loop may wait for a command before a pass is due (None: no session)."""
        if self.participants:
            return 0.0
        if self.next_start is None:
            return None
        return max(0.0, self.next_start - now)


def plan_pass(
    now: float,
    sessions: Iterable[tuple[str, bool, float]],
    lead_s: float,
    chunk_estimate_s: float,
) -> PassPlan:
    """Splits ``(session_id, at_boundary, due)`` into the next pass's participants and the
    sessions that wait. A session mid-chunk always takes the pass; one at a chunk boundary
    takes it once ``now >= due - max(lead, estimated chunk time)``."""
    head_start = max(lead_s, chunk_estimate_s)
    participants: list[str] = []
    waiting: list[str] = []
    next_start: float | None = None
    for session_id, at_boundary, due in sessions:
        start = due - head_start
        if not at_boundary or start <= now:
            participants.append(session_id)
        else:
            waiting.append(session_id)
            next_start = start if next_start is None else min(next_start, start)
    return PassPlan(participants, waiting, next_start)


@dataclass(slots=True)
class ChunkEstimate:
    """Expected wall time of one chunk at a batch size, from measured pass times.

    A batch never measured is scaled from the nearest one measured (linearly in the batch size
    above it, which overestimates on hardware that batches well: the safe side for pacing)."""

    passes_per_chunk: int
    pass_ms: Mapping[int, float] = field(default_factory=dict)

    def chunk_s(self, batch: int) -> float:
        if batch <= 0 or not self.pass_ms:
            return 0.0
        if batch in self.pass_ms:
            ms = self.pass_ms[batch]
        else:
            nearest = min(self.pass_ms, key=lambda b: (abs(b - batch), b))
            ms = self.pass_ms[nearest] * max(1.0, batch / nearest)
        if not math.isfinite(ms) or ms < 0:
            return 0.0
        return self.passes_per_chunk * ms / 1000.0
