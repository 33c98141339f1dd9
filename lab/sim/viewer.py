"""What a viewer sees, counted the same way for the simulator and for a live replay.

Pure (no I/O, no clock): feed it each chunk's timing and each active spell's end, read the
summary. The simulator uses it; ``turboserve replay`` can feed it the timings its SSE clients
receive (``due_at``, ``done_at``) and the spells it plays, so that both report the same
figures under the same definitions.

Definitions (``P`` = chunk period, the playback time of one chunk; ``D`` = the deadline,
``deadline_ms`` of the profile; the shipped profiles and the emulated workers have P = D):

* **latency** of a chunk: ``max(0, done - due)``, where ``due`` is the worker's playback clock
  (``due_0`` = when the worker started the session, by assignment or resume; ``due_{k+1} =
  max(due_k, done_k) + P``). A session that waited for a GPU before its first chunk is not
  late by the worker's clock: the wait shows in the first chunk's *startup* instead.
* **on time**: the first chunk of an active spell when its startup (``done`` minus the moment
  the session became active) is at most D; every other chunk when its latency is at most
  ``slack_ms`` (0: any stall is a miss, as the gateway counts deadline misses). Without pacing
  (P = 0: chunks back to back, each due when the one before was done) a chunk's latency is its
  generation time, and it is on time when that is at most D.
* **deadline attainment**: on-time chunks / chunks delivered.
* **missed periods**: a chunk late by ``x`` beyond its allowance (D for a first chunk,
  ``slack_ms`` after) froze the viewer for ``x``: ``ceil(x / P)`` chunk periods passed without
  a new chunk. A spell that ends while its next chunk is overdue by ``x`` (the session waited
  for a GPU, or a chunk in flight was cut off) adds ``ceil(x / P)``; one that is not overdue
  yet adds nothing (the viewer left before it was owed anything).
* **stall-adjusted attainment**: on-time chunks / (on-time chunks + missed periods): the share
  of chunk periods, while sessions were active, that were served on time. A session frozen for
  60 s with P = 1.25 s misses 48 periods, not one chunk. This is the measure of service
  wherever policies are compared; the per-chunk p99 is shown beside it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from shared.quantiles import quantiles

__all__ = ["ServiceLedger", "summary"]

# Float sums of pass times may put a chunk a few femtoseconds past a due time it meets exactly.
_TOLERANCE_MS = 1e-6


@dataclass(slots=True)
class ServiceLedger:
    period_s: float  # P; 0: back to back (no playback pacing), periods counted per deadline
    deadline_ms: float  # D
    slack_ms: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    chunks: int = 0
    on_time: int = 0
    missed_periods: int = 0
    overdue_spells: int = 0  # spells that ended with their next chunk overdue
    # Where the misses are: the periods missed before a spell's first chunk, and each first
    # chunk's startup (done minus the moment its session became active).
    missed_at_start: int = 0
    startups_ms: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.period_s) and self.period_s >= 0):
            raise ValueError(f"period_s must be >= 0, got {self.period_s}")
        if not (math.isfinite(self.deadline_ms) and self.deadline_ms > 0):
            raise ValueError(f"deadline_ms must be > 0, got {self.deadline_ms}")
        if not (math.isfinite(self.slack_ms) and self.slack_ms >= 0):
            raise ValueError(f"slack_ms must be >= 0, got {self.slack_ms}")

    @property
    def period_ms(self) -> float:
        """The unit of a missed period (the deadline when chunks are not paced)."""
        return self.period_s * 1000.0 if self.period_s > 0 else self.deadline_ms

    @property
    def allowance_ms(self) -> float:
        """How late a chunk after the first may be and still be on time."""
        return self.slack_ms if self.period_s > 0 else self.deadline_ms

    def delivered(self, latency_ms: float, startup_ms: float | None = None) -> int:
        """A chunk was delivered ``latency_ms`` after its due time (negative or 0: on time by
        the worker's clock); ``startup_ms`` for the first chunk of an active spell. Returns
        the periods it missed: 0 when it was on time."""
        latency = max(0.0, latency_ms)
        self.latencies_ms.append(latency)
        self.chunks += 1
        if startup_ms is not None:
            self.startups_ms.append(startup_ms)
        late_by = (
            startup_ms - self.deadline_ms if startup_ms is not None else latency - self.allowance_ms
        )
        if late_by <= _TOLERANCE_MS:
            self.on_time += 1
            return 0
        missed = math.ceil(late_by / self.period_ms - 1e-9)
        self.missed_periods += missed
        if startup_ms is not None:
            self.missed_at_start += missed
        return missed

    def spell_ended(self, overdue_ms: float, first: bool) -> int:
        """An active spell ended (idle, departure, end of the trace) while its next chunk was
        ``overdue_ms`` past its due time (``first``: past the spell's start, no chunk delivered
        yet). Returns the periods it missed."""
        late_by = overdue_ms - (self.deadline_ms if first else self.allowance_ms)
        if late_by <= _TOLERANCE_MS:
            return 0
        missed = math.ceil(late_by / self.period_ms - 1e-9)
        self.missed_periods += missed
        self.overdue_spells += 1
        if first:
            self.missed_at_start += missed
        return missed

    @property
    def deadline_attainment(self) -> float:
        return self.on_time / self.chunks if self.chunks else 1.0

    @property
    def stall_adjusted_attainment(self) -> float:
        total = self.on_time + self.missed_periods
        return self.on_time / total if total else 1.0

    def summary(self) -> dict[str, object]:
        return {
            "latency_ms": summary(self.latencies_ms),
            "chunks": self.chunks,
            "chunks_on_time": self.on_time,
            "missed_periods": self.missed_periods,
            "missed_periods_at_start": self.missed_at_start,
            "startup_ms": summary(self.startups_ms),
            "deadline_attainment": round(self.deadline_attainment, 6),
            "stall_adjusted_attainment": round(self.stall_adjusted_attainment, 6),
        }


def summary(values: Iterable[float]) -> dict[str, float]:
    """p50, p99 and max (the tree's one quantile, :mod:`shared.quantiles`), 0 when empty."""
    ordered = sorted(values)
    p50, p99, top = quantiles(ordered, (0.50, 0.99, 1.0))
    return {"p50": round(p50, 3), "p99": round(p99, 3), "max": round(top, 3)}
