"""Placement: the paper's min-max local search, made incremental, over GPUs of one or more kinds.

1. Start from the previous placement: nothing moves without a reason.
2. Each new or re-activated session goes on the GPU whose latency grows least. A profile's
   ``chunk_ms`` is non-decreasing, so within one kind that is the least loaded GPU with room
   (an O(1) bucket lookup); across kinds, the best of each kind's least loaded GPU.
3. Repeatedly move sessions off the slowest GPU while it gains
   ``Gamma = L - L' - eta * kappa``, L the worst latency before, L' after, kappa the migration
   cost of what moved. The objective is the paper's: the *global* worst latency plus eta times
   the migration costs, ``J = max_g chunk_g(n_g) + eta * sum kappa_i`` (the evaluation's
   exhaustive oracle minimises the same J), each GPU's chunk time from its own kind's profile.

How step 3 handles plateaus: when ``h`` GPUs share the worst latency, no single move lowers the
global worst latency, so a literal single-move search stops at once, and a pairwise reading
(gain = drop of the worst latency among the two GPUs touched) balances every +-1 difference,
paying a migration for no drop in J. We take the unit of search to be the cheapest *move set*
that lowers the worst latency by one load level: one session (the cheapest) off each of the h
GPUs, each onto the GPU whose latency then grows least, all of which must stay below the worst
latency. With one kind it is feasible iff the GPUs at least two below the worst load have room
for h more sessions without reaching it, and gains ``chunk(hi) - chunk(hi - 1) - eta * sum
kappa``; with several, L' is the largest of the sources' new latency, the destinations' new
latency and every other GPU's. Applied while it gains, it never raises the worst latency, each
application lowers J, and with eta = 0 and one kind it ends at the least possible worst load,
ceil(sessions / GPUs). Moves that would only even out loads below the worst are never made:
they cost migrations and lower nothing the objective counts.

Costs: the feasibility check is O(kinds x K) from the bucket sizes; an applied move set is
O(h K).
"""

from __future__ import annotations

from typing import Protocol

from services.scheduler.core.cluster import NEVER, Cluster, KindPool
from services.scheduler.core.types import Assign, Decision, GpuState, Migrate, Resume
from shared.profile import LatencyProfile


class Chooser(Protocol):
    """Picks a placeable GPU with room for one more session, or None when all are full."""

    name: str

    def choose(self, cluster: Cluster) -> str | None: ...


class LeastLatencyGrowth:
    """The paper's rule (step 2); also what the `least_loaded` baseline uses (with one kind,
    the GPU with the fewest active sessions)."""

    name = "least_loaded"

    def choose(self, cluster: Cluster) -> str | None:
        return cluster.least_growth()


class SoonestFirstChunk:
    """TurboServe's step 2: the GPU on which the session's first chunk is delivered soonest.

    A session that becomes active joins its GPU's batch at the next boundary: it waits for the
    pass in flight (until ``Gpu.step_end``, reported by the environment through
    ``Controller.note_pass``; at most ``pass_ms(load)``, a whole step when the profile has one
    pass per chunk), then runs ``passes_per_chunk`` passes of ``load + 1`` sessions. Its first
    chunk is thus ready after ``max(0, step_end - now) + chunk_ms(load + 1)``, on the GPU's own
    kind's profile; this picks the GPU with room that minimises it (ties: the least latency
    growth, then kind and join order). Without step reports every wait is 0 and this is the
    paper's least-latency-growth rule, an O(1) bucket lookup per kind.

    Only load levels whose ``chunk_ms(load + 1)`` is below the best so far can win, so the scan
    stops after a few levels; within a level it is O(GPUs at that level)."""

    name = "soonest_first_chunk"

    def __init__(self) -> None:
        self.now = NEVER  # set by the controller before each placement

    def choose(self, cluster: Cluster) -> str | None:
        first = cluster.least_growth()
        if first is None:
            return None
        gpus, now = cluster.gpus, self.now
        best_id, best = first, float("inf")
        for pool in cluster.pools.values():
            if not pool.n:
                continue
            chunk_ms = pool.profile.chunk_ms
            buckets = pool.buckets
            for level in range(pool.lo, min(pool.hi, pool.capacity - 1) + 1):
                run_ms = chunk_ms(level + 1)
                if run_ms >= best:
                    break
                for gpu_id in buckets[level]:
                    wait_ms = max(0.0, gpus[gpu_id].step_end - now) * 1000.0
                    if wait_ms + run_ms < best:
                        best_id, best = gpu_id, wait_ms + run_ms
                        if wait_ms == 0.0:
                            break  # nothing at this level can do better
        return best_id


class RoundRobin:
    """Cycle through the placeable GPUs in the order they joined, skipping full ones."""

    name = "round_robin"

    def __init__(self) -> None:
        self._order: list[str] = []
        self._version = -1
        self._next = 0

    def choose(self, cluster: Cluster) -> str | None:
        if cluster.version != self._version:
            self._order = [g for g in cluster.gpus if cluster.gpus[g].state is GpuState.READY]
            self._version = cluster.version
            self._next %= max(1, len(self._order))
        for _ in range(len(self._order)):
            gpu_id = self._order[self._next]
            self._next = (self._next + 1) % len(self._order)
            if cluster.load(gpu_id) < cluster.capacity_of(gpu_id):
                return gpu_id
        return None


class BestFit:
    """Memory-aware greedy: pack each session onto the GPU with the least free memory that still
    fits its state (classic best-fit bin packing), keeping other GPUs free for large tenants.
    The paper names a "memory-aware greedy" baseline without details; this is our reading."""

    name = "memory_aware"

    def choose(self, cluster: Cluster) -> str | None:
        return cluster.fullest_with_room()


CHOOSERS: dict[str, type[LeastLatencyGrowth | SoonestFirstChunk | RoundRobin | BestFit]] = {
    "soonest_first_chunk": SoonestFirstChunk,
    "least_loaded": LeastLatencyGrowth,
    "round_robin": RoundRobin,
    "memory_aware": BestFit,
}


def make_chooser(name: str) -> Chooser:
    """A fresh chooser by name (``ControllerConfig.placement``)."""
    try:
        return CHOOSERS[name]()
    except KeyError:
        raise ValueError(f"unknown placement {name!r}; known: {', '.join(CHOOSERS)}") from None


def place_pending(cluster: Cluster, chooser: Chooser, now: float = NEVER) -> list[Decision]:
    """Step 2: put pending active sessions (oldest first) on GPUs while any has room.

    A session whose placement failed recently (``Session.failed_gpu``, until
    ``backoff_until``) is not put back on the GPU that failed; it waits if that is the only
    GPU with room."""
    out: list[Decision] = []
    for session_id in list(cluster.pending):
        session = cluster.sessions[session_id]
        avoid = session.failed_gpu if session.backoff_until > now else None
        gpu_id = _choose_avoiding(cluster, chooser, avoid) if avoid else chooser.choose(cluster)
        if gpu_id is None:
            if avoid:
                continue  # others may still fit elsewhere
            break
        cluster.place(session_id, gpu_id)
        out.append(
            Resume(session_id, gpu_id) if session.in_host_ram else Assign(session_id, gpu_id)
        )
    return out


def _choose_avoiding(cluster: Cluster, chooser: Chooser, avoid: str) -> str | None:
    gpu = cluster.gpus.get(avoid)
    if gpu is None or gpu.state is not GpuState.READY:
        return chooser.choose(cluster)
    pool = cluster.pools[gpu.kind]
    load = len(gpu.sessions)
    pool.remove(avoid, load)  # hidden from the chooser for this one choice
    cluster.n_placeable -= 1
    try:
        chosen = chooser.choose(cluster)
        return None if chosen == avoid else chosen  # a chooser that does not use the buckets
    finally:
        pool.add(avoid, load)
        cluster.n_placeable += 1


def rebalance(
    cluster: Cluster,
    eta: float,
    max_moves: int | None = None,
    boundary_wait: bool = False,
    now: float = NEVER,
) -> list[Migrate]:
    """Step 3: lower the worst latency one load level at a time while that gains.

    To lower the worst latency L, each of the ``h`` GPUs at L must hand one session to a GPU
    whose latency, with it, stays below L; with one kind, that is a GPU at ``hi - 2`` or
    below, possible iff those GPUs have ``room = sum(hi - 1 - load)`` >= h. The move set gains
    ``L - L' - eta * sum(kappa of the h cheapest sessions)``; it is applied (each session to
    the GPU whose latency then grows least) while positive.

    ``boundary_wait``: also charge each move the wait for its destination's next pass
    boundary (see :func:`boundary_waits_ms`), on top of the copy kappa. The controller does;
    the bare paper objective (``place``'s default, what the exhaustive oracle minimises) does
    not. A session in backoff after a failed migration (``Session.backoff_until`` after
    ``now``) is not moved."""
    out: list[Migrate] = []
    while cluster.n_placeable >= 2:
        plan = _plan_level_drop(cluster, eta, boundary_wait, now)
        if plan is None or (max_moves is not None and len(out) + len(plan) > max_moves):
            break
        for src, session_id, worst in plan:
            dst = cluster.least_growth()
            assert (
                dst is not None and cluster.profile_of(dst).chunk_ms(cluster.load(dst) + 1) < worst
            )
            cluster.move(session_id, dst)
            out.append(Migrate(session_id, src, dst))
    return out


def _plan_level_drop(
    cluster: Cluster, eta: float, boundary_wait: bool, now: float
) -> list[tuple[str, str, float]] | None:
    """The move set that lowers the worst latency by one level, as ``(source, session,
    worst latency)`` per move, if it is feasible and gains; else None."""
    if len(cluster.pools) == 1:  # the common case, without the lists
        only = cluster.pools[cluster.default_kind]
        pools = plateau = [only]
        worst = only.profile.chunk_ms(only.hi)
        if worst <= 0.0:
            return None
        h = len(only.buckets[only.hi])
    else:
        pools = [p for p in cluster.pools.values() if p.n]
        worst = max(p.profile.chunk_ms(p.hi) for p in pools)
        if worst <= 0.0:
            return None
        plateau = [p for p in pools if p.profile.chunk_ms(p.hi) == worst]
        h = sum(len(p.buckets[p.hi]) for p in plateau)
    # 1. Room below the worst latency, excluding the plateau GPUs themselves.
    room = 0
    for pool in pools:
        top = pool.below(worst)  # a destination may reach this load
        for level in range(pool.lo, min(top, pool.hi + 1)):
            room += len(pool.buckets[level]) * (top - level)
    if room < h:
        return None
    # 2. The cheapest movable session of each plateau GPU.
    picks: list[tuple[str, str, float]] = []
    cost = 0.0
    for pool in plateau:
        for gpu_id in pool.buckets[pool.hi]:
            pick = _cheapest_session(cluster, gpu_id, now)
            if pick is None:
                return None  # every session on it is in backoff: the worst cannot drop now
            picks.append((gpu_id, pick[0], worst))
            cost += pick[1]
    # 3. The worst latency after the move set.
    after = max(
        [p.profile.chunk_ms(p.hi - 1) for p in plateau]
        + [p.profile.chunk_ms(p.hi) for p in pools if p.profile.chunk_ms(p.hi) < worst]
    )
    if boundary_wait or len(pools) > 1:
        waits, dest_worst = _destinations(pools, h, worst)
        after = max(after, dest_worst)
        if boundary_wait:
            cost += waits
    if worst - after - eta * cost <= 0:
        return None
    return picks


def _destinations(pools: list[KindPool], h: int, worst: float) -> tuple[float, float]:
    """Where ``h`` sessions moved one by one onto the GPU whose latency grows least (staying
    below ``worst``) would land: (the sum of their worst-case waits for the destination's next
    pass boundary, the highest latency a destination reaches). O(h + kinds x K)."""
    counts = []
    tops = []
    levels = []
    for pool in pools:
        top = pool.below(worst)
        counts.append(
            [len(pool.buckets[level]) for level in range(top + 1)] if top > pool.lo else []
        )
        tops.append(top)
        levels.append(pool.lo)
    waits = 0.0
    dest_worst = 0.0
    for _ in range(h):
        best = -1
        best_ms = 0.0
        for i, pool in enumerate(pools):
            c, top = counts[i], tops[i]
            while levels[i] < top and c[levels[i]] == 0:
                levels[i] += 1
            if levels[i] >= top:
                continue
            ms = pool.profile.chunk_ms(levels[i] + 1)
            if best < 0 or ms < best_ms:
                best, best_ms = i, ms
        if best < 0:
            break  # infeasible move sets are rejected by the caller's room check
        level = levels[best]
        waits += boundary_wait_ms(pools[best].profile, level)
        dest_worst = max(dest_worst, best_ms)
        counts[best][level] -= 1
        counts[best][level + 1] += 1
    return waits, dest_worst


def boundary_wait_ms(profile: LatencyProfile, load: int) -> float:
    """Worst-case wait of a session moved onto a GPU holding ``load`` sessions for its next pass
    boundary: the pass in flight, ``pass_ms(load) = chunk_ms(load) / passes_per_chunk`` (a
    whole step with one pass per chunk), and nothing on an idle, empty GPU. Counted at the
    worst case because the objective is one."""
    return profile.pass_ms(load)


def boundary_waits_ms(cluster: Cluster, h: int, hi: int) -> float:
    """Worst-case waits of ``h`` sessions moved one by one onto the then least loaded GPU of the
    default kind (all below ``hi - 1``), each for its destination's next pass boundary
    (:func:`boundary_wait_ms`). O(h + K)."""
    pool = cluster.pools[cluster.default_kind]
    if not pool.n:
        return 0.0
    return _destinations([pool], h, pool.profile.chunk_ms(hi))[0]


def evacuate(cluster: Cluster, gpu_id: str, now: float = NEVER) -> list[Migrate]:
    """Consolidation for scale-in and drains: move every session off a DRAINING GPU onto the
    placeable GPUs whose latency grows least, as long as any has room. A session in backoff
    after a failed migration stays until its backoff ends."""
    out: list[Migrate] = []
    sessions = cluster.sessions
    for session_id in list(cluster.gpus[gpu_id].sessions):
        if sessions[session_id].backoff_until > now:
            continue
        dst = cluster.least_growth()
        if dst is None:
            break
        cluster.move(session_id, dst)
        out.append(Migrate(session_id, gpu_id, dst))
    return out


def place(
    cluster: Cluster,
    chooser: Chooser | None = None,
    eta: float = 0.1,
    migrate: bool = True,
    boundary_wait: bool = False,
) -> list[Decision]:
    """Steps 1-3 on the cluster in place; returns the decisions, in the order to carry out."""
    out = place_pending(cluster, chooser or LeastLatencyGrowth())
    if migrate:
        out.extend(rebalance(cluster, eta, boundary_wait=boundary_wait))
    return out


def _cheapest_session(cluster: Cluster, gpu_id: str, now: float) -> tuple[str, float] | None:
    sessions = cluster.sessions
    best_id = ""
    best = float("inf")
    for session_id in cluster.gpus[gpu_id].sessions:
        session = sessions[session_id]
        if session.kappa_ms < best and session.backoff_until <= now:
            best_id, best = session_id, session.kappa_ms
    return (best_id, best) if best_id else None
