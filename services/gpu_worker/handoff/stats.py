"""What this worker's recent handoffs cost, measured (pure: no torch, no I/O).

A handoff's time splits into a part that grows with the state (the transfer) and a part that
does not (the registry compare-and-sets and the messages: offer, answer, outcome). Heartbeats
carry both, so the scheduler's migration cost is the machine's, not an assumption:

    cost(bytes) ~= fixed_ms + ms_per_mib * bytes / MiB

``fixed_ms`` is the median of ``offer_ms + commit_ms`` and ``ms_per_mib`` the median of
``transfer_ms / MiB`` over the last ``keep`` successful handoffs. A worker's sessions all have
one state size (one preset), so the decomposition is exact at the size that matters; a
regression over sizes would need spread that a serving worker never has. Building a
communicator for a new peer (first use) is kept apart: it is paid once per peer, not per move.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class HandoffSample:
    nbytes: int
    offer_ms: float  # registry CAS to migrating + offer/answer round trip
    transfer_ms: float
    commit_ms: float  # transfer end -> the destination's committed outcome
    connect_ms: float = 0.0  # building the communicator (0 when it was cached)


@dataclass(frozen=True, slots=True)
class HandoffCost:
    """Heartbeat figures (None until there is a sample)."""

    fixed_ms: float | None
    ms_per_mib: float | None
    first_use_ms: float | None
    samples: int


class HandoffStats:
    def __init__(self, keep: int = 32) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self._samples: deque[HandoffSample] = deque(maxlen=keep)
        self._connects: deque[float] = deque(maxlen=keep)

    def add(self, sample: HandoffSample) -> None:
        if sample.nbytes < 0 or min(sample.offer_ms, sample.transfer_ms, sample.commit_ms) < 0:
            raise ValueError(f"a handoff sample cannot be negative: {sample}")
        self._samples.append(sample)
        if sample.connect_ms > 0:
            self._connects.append(sample.connect_ms)

    def cost(self) -> HandoffCost:
        samples = list(self._samples)
        sized = [s for s in samples if s.nbytes > 0]
        return HandoffCost(
            fixed_ms=statistics.median(s.offer_ms + s.commit_ms for s in samples)
            if samples
            else None,
            ms_per_mib=statistics.median(s.transfer_ms * MIB / s.nbytes for s in sized)
            if sized
            else None,
            first_use_ms=statistics.median(self._connects) if self._connects else None,
            samples=len(samples),
        )
