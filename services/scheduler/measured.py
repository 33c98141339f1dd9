"""The latency model the live scheduler places by: what the workers of a kind measure.

Pure (no I/O): heartbeats of the workers of one kind plus the shipped profile of that kind (or
the default one) in, a ``LatencyProfile`` out. Where the workers have measured chunk times
they are taken as measured; a batch they timed only by its passes takes its pass times plus
the chunk overhead measured at the other batches; the rest comes from the shipped profile
(``profile_from_measurements``). Every live profile also takes from the workers what the shipped file cannot
know: the playback period they keep (the deadline of a chunk), their slots (K never exceeds
them), one session's state size, the measured cost of their handoffs (the migration cost) and
what a prompt change adds to a chunk (K leaves room for it).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable

from shared.profile import (
    LatencyProfile,
    ProfileError,
    profile_from_measurements,
)
from shared.wire import Heartbeat

MIB = 1024 * 1024


def live_profile(kind: str, beats: Iterable[Heartbeat], fallback: LatencyProfile) -> LatencyProfile:
    """The profile of ``kind`` from its workers' latest heartbeats (at least one).

    ``fallback`` is the kind's shipped profile, or (for a kind nothing ships for) the default
    kind's: then its shape is kept but scaled so that the workers' slots meet their deadline,
    an assumption the measurements replace as they come in.
    Raises ProfileError when the measurements make no usable profile (e.g. not even one
    session meets the deadline): the caller keeps what it had."""
    beats = list(beats)
    if not beats:
        raise ValueError("live_profile needs at least one heartbeat")
    slots = min(b.capacity for b in beats)
    if slots < 1:
        raise ProfileError(kind, "a worker of this kind reports no session slots")
    base = fallback
    periods = [b.chunk_period_s for b in beats if b.chunk_period_s > 0]
    if periods:
        base = dataclasses.replace(base, deadline_ms=1000.0 * min(periods))
    if fallback.gpu_kind != kind:
        base = _scaled_to(base, slots)
    measured = _median_by_batch(b.chunk_ms for b in beats)
    # Passes are timed at every batch a worker runs, whole chunks mostly at the small batches
    # of a ramp-up: the pass times fill in the rest (see profile_from_measurements).
    passes = _median_by_batch(b.pass_ms for b in beats)
    profile = profile_from_measurements(measured, base, pass_ms=passes) if measured else base
    table = profile.chunk_ms_table[:slots]
    state = [b.state_bytes for b in beats if b.state_bytes > 0]
    state_bytes = int(statistics.median(state)) if state else profile.state_bytes_per_session
    fixed = [b.handoff_fixed_ms for b in beats if b.handoff_fixed_ms is not None]
    per_mib = [b.handoff_ms_per_mib for b in beats if b.handoff_ms_per_mib is not None]
    migration_fixed = statistics.median(fixed) if fixed else profile.migration_fixed_ms
    if per_mib:
        migration = migration_fixed + statistics.median(per_mib) * state_bytes / MIB
    elif state_bytes != profile.state_bytes_per_session:
        migration = profile.migration_ms(state_bytes)
    else:
        migration = profile.migration_per_session_ms
    switches = [b.prompt_switch_ms for b in beats if b.prompt_switch_ms is not None]
    out = dataclasses.replace(
        profile,
        prompt_switch_ms=statistics.median(switches) if switches else profile.prompt_switch_ms,
        name=f"{kind}-measured" if measured else profile.name,
        gpu_kind=kind,
        chunk_ms_table=table,
        state_bytes_per_session=state_bytes,
        migration_fixed_ms=migration_fixed,
        migration_per_session_ms=max(migration, migration_fixed),
    )
    if out.capacity < 1:
        raise ProfileError(kind, f"no batch meets the {out.deadline_ms:.0f} ms deadline")
    return out


def _scaled_to(profile: LatencyProfile, slots: int) -> LatencyProfile:
    """``profile``'s shape, every chunk time scaled so that ``slots`` sessions just meet the
    deadline (an unmeasured kind is assumed to keep the pace it was given slots for)."""
    factor = 0.99 * profile.deadline_ms / profile.chunk_ms(slots)
    table = tuple(profile.chunk_ms(b) * factor for b in range(1, max(slots, 2) + 1))
    return dataclasses.replace(profile, chunk_ms_table=table)


def _median_by_batch(per_worker: Iterable[dict[int, float]]) -> dict[int, float]:
    samples: dict[int, list[float]] = {}
    for times in per_worker:
        for batch, ms in times.items():
            if batch >= 1 and ms > 0:
                samples.setdefault(int(batch), []).append(float(ms))
    return {b: statistics.median(v) for b, v in sorted(samples.items())}


def differs(a: LatencyProfile, b: LatencyProfile, rel: float = 0.1) -> bool:
    """Whether two profiles differ enough to re-place by: K, or a chunk time by ``rel``."""
    if a.capacity != b.capacity or a.deadline_ms != b.deadline_ms:
        return True
    for batch in range(1, a.capacity + 1):
        x, y = a.chunk_ms(batch), b.chunk_ms(batch)
        if abs(x - y) > rel * max(x, y):
            return True
    return abs(a.migration_per_session_ms - b.migration_per_session_ms) > rel * max(
        a.migration_per_session_ms, b.migration_per_session_ms, 1e-9
    )
