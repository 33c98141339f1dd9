"""The quality budget: fewer denoising steps per chunk on a GPU that is over its budget.

A few-step sampler (Self-Forcing / LongLive: 4 steps and a cache-write pass) can run a chunk
with fewer steps, down to an operator floor (``ControllerConfig.min_steps``; None: off). At
``s`` steps a chunk is ``s + 1`` passes, so a GPU at fewer steps serves more sessions before
the deadline (``LatencyProfile.max_batch_at``). While a GPU's active load exceeds what full
steps serve on time (a burst that outruns a boot, a migration landing, a profile that lowered
K), :class:`StepBudget` lowers that GPU's step count to the largest ``s >= min_steps`` that
serves its load on time, instead of letting its chunks go late, and raises it back to full as
soon as the load fits again. It emits :class:`SetSteps` only when a GPU's count changes.

Placement (:func:`place_in_reduced_room`): sessions that no GPU has room for at full steps
would wait for a boot, every chunk period of the wait missed. With the budget on they go onto
the GPUs' reduced room instead (up to ``max_batch_at(min_steps)``), only once no GPU has room
at full steps: a session that waits misses every period, a GPU at fewer steps delivers every
chunk on time at somewhat lower quality, and room at full steps, while there is any, costs
no quality at all. The rebalance moves them off once new GPUs boot, and the budget then
returns to full.

The budget is off when ``min_steps`` is None or not below a kind's full step count: then
nothing here runs and every decision is what it was without it.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.scheduler.core.cluster import NEVER, Cluster
from services.scheduler.core.placement import Chooser, place_pending
from services.scheduler.core.types import Decision, GpuState, SetSteps
from shared.profile import LatencyProfile

__all__ = [
    "StepBudget",
    "check_min_steps",
    "floor_of",
    "place_in_reduced_room",
    "reduced_capacity",
    "steps_for",
]


def check_min_steps(min_steps: int | None, profile: LatencyProfile) -> None:
    """``ValueError`` unless ``min_steps`` is None or an integer in 1..full steps of
    ``profile`` (the kind the controller asks for)."""
    if min_steps is None:
        return
    if isinstance(min_steps, bool) or not isinstance(min_steps, int) or min_steps < 1:
        raise ValueError(f"min_steps must be an integer >= 1 or None (off), got {min_steps!r}")
    if min_steps > profile.full_steps:
        raise ValueError(
            f"min_steps ({min_steps}) is above the full step count of profile "
            f"{profile.name!r} ({profile.full_steps})"
        )


def floor_of(profile: LatencyProfile, min_steps: int | None) -> int | None:
    """The floor in force on a GPU of ``profile``: None when the budget is off there."""
    if min_steps is None or min_steps >= profile.full_steps:
        return None
    return min_steps


def steps_for(profile: LatencyProfile, load: int, min_steps: int | None) -> int:
    """Denoising steps for a GPU of ``profile`` holding ``load`` active sessions: full while
    full steps serve them on time (or the budget is off), else the largest ``s >= min_steps``
    whose ``max_batch_at(s)`` holds them, else ``min_steps`` (the most it may do)."""
    full = profile.full_steps
    floor = floor_of(profile, min_steps)
    if floor is None or load <= profile.max_batch_at(full):
        return full
    for steps in range(full - 1, floor, -1):
        if profile.max_batch_at(steps) >= load:
            return steps
    return floor


def reduced_capacity(profile: LatencyProfile, min_steps: int | None) -> int:
    """Sessions a GPU of ``profile`` may hold at the floor (K when the budget is off)."""
    floor = floor_of(profile, min_steps)
    return profile.capacity if floor is None else max(profile.capacity, profile.max_batch_at(floor))


def place_in_reduced_room(
    cluster: Cluster, chooser: Chooser, min_steps: int | None, now: float = NEVER
) -> list[Decision]:
    """Place the sessions still pending once no GPU has room at full steps onto the room the
    floor adds (see the module docstring): every kind's capacity is raised to
    :func:`reduced_capacity` for this one placement and put back after."""
    if not cluster.pending:
        return []
    raised: dict[str, int] = {}
    for kind, pool in cluster.pools.items():
        room = reduced_capacity(pool.profile, min_steps)
        if room > pool.capacity:
            raised[kind] = pool.capacity
            pool.capacity = room
    if not raised:
        return []
    try:
        return place_pending(cluster, chooser, now)
    finally:
        for kind, capacity in raised.items():
            cluster.pools[kind].capacity = capacity


class StepBudget:
    """The step count each GPU of one controller runs, and the :class:`SetSteps` that change
    it. A GPU it has not told anything runs full steps (a worker starts there)."""

    def __init__(self, min_steps: int) -> None:
        self.min_steps = min_steps
        # GPUs not at full steps, or whose count is unknown (None: after a restore).
        self._set: dict[str, int | None] = {}

    def forget(self, gpu_ids: Iterable[str]) -> None:
        """After a restore: the counts of these GPUs are unknown, so the next update tells
        each its count."""
        for gpu_id in gpu_ids:
            self._set[gpu_id] = None

    def update(self, cluster: Cluster) -> list[Decision]:
        """The :class:`SetSteps` for every GPU whose count should change now: the GPUs over
        their K (of their own kind) and those not at full steps are checked, nothing else."""
        out: list[Decision] = []
        gpus = cluster.gpus
        for gpu_id in [g for g in self._set if g not in gpus]:
            del self._set[gpu_id]  # released or gone
        for gpu_id in self._candidates(cluster):
            profile = cluster.profile_of(gpu_id)
            want = steps_for(profile, cluster.load(gpu_id), self.min_steps)
            if self._set.get(gpu_id, profile.full_steps) == want:
                continue
            out.append(SetSteps(gpu_id, want))
            if want == profile.full_steps:
                del self._set[gpu_id]
            else:
                self._set[gpu_id] = want
        return out

    def _candidates(self, cluster: Cluster) -> list[str]:
        found = dict.fromkeys(g for g in self._set if cluster.gpus[g].state is not GpuState.BOOTING)
        for pool in cluster.pools.values():
            for level in range(pool.capacity + 1, pool.hi + 1):
                found.update(pool.buckets[level])
        for gpu_id in cluster.draining:
            if cluster.load(gpu_id) > cluster.capacity_of(gpu_id):
                found[gpu_id] = None
        return sorted(found)
