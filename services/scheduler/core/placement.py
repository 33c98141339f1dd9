"""Placement: the paper's min-max local search, made incremental.

1. Start from the previous placement: nothing moves without a reason.
2. Each new or re-activated session goes on the GPU whose latency grows least. Because a
   profile's ``chunk_ms`` is non-decreasing and all GPUs of a controller share one profile, that
   is the least loaded GPU with room: an O(1) bucket lookup.
3. Repeatedly move sessions off the most loaded GPU while it gains
   ``Gamma = L - L' - eta * kappa``, L the worst latency before, L' after, kappa the migration
   cost of what moved. The objective is the paper's: the *global* worst latency plus eta times
   the migration costs, ``J = max_g chunk(n_g) + eta * sum kappa_i`` (the evaluation's
   exhaustive oracle minimises the same J).

How step 3 handles plateaus: when ``h`` GPUs share the worst load, no single move lowers the
global worst latency, so a literal single-move search stops at once, and a pairwise reading
(gain = drop of the worst latency among the two GPUs touched) balances every +-1 difference,
paying a migration for no drop in J. We take the unit of search to be the cheapest *move set*
that lowers the worst load by one level: one session (the cheapest) off each of the h GPUs,
each onto the then least loaded GPU. It is feasible iff the GPUs at least two below the worst
have room for h more sessions without reaching it, and gains
``chunk(hi) - chunk(hi - 1) - eta * sum kappa``. Applied while it gains, it never raises the
worst latency, each application lowers J, and with eta = 0 it ends at the least possible worst
load, ceil(sessions / GPUs). Moves that would only even out loads below the worst are never
made: they cost migrations and lower nothing the objective counts.

Costs: the feasibility check is O(K) from the bucket sizes; an applied move set is O(h K).
"""

from __future__ import annotations

from typing import Protocol

from services.scheduler.core.cluster import Cluster
from services.scheduler.core.profile import LatencyProfile
from services.scheduler.core.types import Assign, Decision, GpuState, Migrate, Resume


class Chooser(Protocol):
    """Picks a placeable GPU with room for one more session, or None when all are full."""

    name: str

    def choose(self, cluster: Cluster) -> str | None: ...


class LeastLatencyGrowth:
    """The paper's rule (step 2); also what the `least_loaded` baseline uses."""

    name = "least_loaded"

    def choose(self, cluster: Cluster) -> str | None:
        return cluster.least_loaded()


class SoonestFirstChunk:
    """TurboServe's step 2: the GPU on which the session's first chunk is delivered soonest.

    A session that becomes active joins its GPU's batch at the next boundary: it waits for the
    pass in flight (until ``Gpu.step_end``, reported by the environment through
    ``Controller.note_step``; at most ``pass_ms(load)``, a whole step when the profile has one
    pass per chunk), then runs ``passes_per_chunk`` passes of ``load + 1`` sessions. Its first
    chunk is thus ready after ``max(0, step_end - now) + chunk_ms(load + 1)``; this picks the GPU with
    room that minimises it (ties: the least loaded, then join order). Without step reports every
    wait is 0 and this is the paper's least-latency-growth rule, an O(1) bucket lookup.

    Only load levels whose ``chunk_ms(load + 1)`` is below the best so far can win, so the scan
    stops after a few levels; within a level it is O(GPUs at that level)."""

    name = "soonest_first_chunk"

    def __init__(self) -> None:
        self.now = float("-inf")  # set by the controller before each placement

    def choose(self, cluster: Cluster) -> str | None:
        first = cluster.least_loaded()
        if first is None:
            return None
        profile, gpus, now = cluster.profile, cluster.gpus, self.now
        best_id, best = first, float("inf")
        for level in range(cluster.min_load, min(cluster.max_load, cluster.capacity - 1) + 1):
            run_ms = profile.chunk_ms(level + 1)
            if run_ms >= best:
                break
            for gpu_id in cluster.bucket(level):
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
            if cluster.load(gpu_id) < cluster.capacity:
                return gpu_id
        return None


class BestFit:
    """Memory-aware greedy: pack each session onto the GPU with the least free memory that still
    fits its state (classic best-fit bin packing), keeping other GPUs free for large tenants.
    The paper names a "memory-aware greedy" baseline without details; this is our reading."""

    name = "memory_aware"

    def choose(self, cluster: Cluster) -> str | None:
        return cluster.fullest_with_room()


def move_gain(profile: LatencyProfile, n_src: int, n_dst: int, kappa_ms: float, eta: float) -> float:
    """Gain of one move from a GPU holding ``n_src`` active sessions to one holding ``n_dst``,
    measured on the two GPUs it touches (the gain of a one-GPU plateau, where that is also the
    drop of the global worst latency)."""
    before = profile.chunk_ms(n_src)
    after = max(profile.chunk_ms(n_src - 1), profile.chunk_ms(n_dst + 1))
    return before - after - eta * kappa_ms


def place_pending(cluster: Cluster, chooser: Chooser) -> list[Decision]:
    """Step 2: put pending active sessions (oldest first) on GPUs while any has room."""
    out: list[Decision] = []
    for session_id in list(cluster.pending):
        gpu_id = chooser.choose(cluster)
        if gpu_id is None:
            break
        resumed = cluster.sessions[session_id].in_host_ram
        cluster.place(session_id, gpu_id)
        out.append(Resume(session_id, gpu_id) if resumed else Assign(session_id, gpu_id))
    return out


def rebalance(cluster: Cluster, eta: float, max_moves: int | None = None,
              boundary_wait: bool = False) -> list[Migrate]:
    """Step 3: lower the worst latency one load level at a time while that gains.

    To lower the worst load from ``hi`` to ``hi - 1``, each of the ``h`` GPUs at ``hi`` must
    hand one session to a GPU at ``hi - 2`` or below; that is possible iff those GPUs have
    ``room = sum(hi - 1 - load)`` >= h. The move set gains
    ``chunk(hi) - chunk(hi - 1) - eta * sum(kappa of the h cheapest sessions)``; it is applied
    (each session to the then least loaded GPU) while positive.

    ``boundary_wait``: also charge each move the wait for its destination's next chunk
    boundary (:func:`boundary_waits_ms`), on top of the copy kappa. The controller does; the
    bare paper objective (``place``'s default, what the exhaustive oracle minimises) does not."""
    out: list[Migrate] = []
    profile = cluster.profile
    while cluster.n_placeable >= 2:
        hi = cluster.max_load
        h = len(cluster.bucket(hi))
        room = 0
        for level in range(cluster.min_load, hi - 1):
            room += len(cluster.bucket(level)) * (hi - 1 - level)
        if hi == 0 or room < h or (max_moves is not None and len(out) + h > max_moves):
            break
        picks = [(gpu_id, *_cheapest_session(cluster, gpu_id)) for gpu_id in cluster.bucket(hi)]
        cost = sum(kappa for _, _, kappa in picks)
        if boundary_wait:
            cost += boundary_waits_ms(cluster, h, hi)
        if profile.chunk_ms(hi) - profile.chunk_ms(hi - 1) - eta * cost <= 0:
            break
        for src, session_id, _ in picks:
            dst = cluster.least_loaded()
            assert dst is not None and cluster.load(dst) <= hi - 2
            cluster.move(session_id, dst)
            out.append(Migrate(session_id, src, dst))
    return out


def boundary_waits_ms(cluster: Cluster, h: int, hi: int) -> float:
    """Worst-case waits of ``h`` sessions moved one by one onto the then least loaded GPU (all
    below ``hi - 1``), each for its destination's next pass boundary.

    A moved session joins its destination's batch at the next pass boundary, so after the
    copy it may wait up to a whole pass in flight, ``pass_ms(load) = chunk_ms(load) /
    passes_per_chunk`` (a whole step with one pass per chunk), and nothing on an idle, empty
    GPU. Counted at the worst case because the objective is one. O(h + K)."""
    chunk_ms = cluster.profile.pass_ms
    counts = [len(cluster.bucket(level)) for level in range(hi)]
    level = cluster.min_load
    total = 0.0
    for _ in range(h):
        while level < hi - 1 and counts[level] == 0:
            level += 1
        if level >= hi - 1:
            break  # infeasible move sets are rejected by the caller's room check
        total += chunk_ms(level)
        counts[level] -= 1
        counts[level + 1] += 1
    return total


def evacuate(cluster: Cluster, gpu_id: str) -> list[Migrate]:
    """Consolidation for scale-in: move every session off a DRAINING GPU onto the least loaded
    placeable GPUs, as long as any has room."""
    out: list[Migrate] = []
    for session_id in list(cluster.gpus[gpu_id].sessions):
        dst = cluster.least_loaded()
        if dst is None:
            break
        cluster.move(session_id, dst)
        out.append(Migrate(session_id, gpu_id, dst))
    return out


def place(
    cluster: Cluster, chooser: Chooser | None = None, eta: float = 0.1, migrate: bool = True,
    boundary_wait: bool = False,
) -> list[Decision]:
    """Steps 1-3 on the cluster in place; returns the decisions, in the order to carry out."""
    out = place_pending(cluster, chooser or LeastLatencyGrowth())
    if migrate:
        out.extend(rebalance(cluster, eta, boundary_wait=boundary_wait))
    return out


def _cheapest_session(cluster: Cluster, gpu_id: str) -> tuple[str, float]:
    sessions = cluster.sessions
    best_id = ""
    best = float("inf")
    for session_id in cluster.gpus[gpu_id].sessions:
        kappa = sessions[session_id].kappa_ms
        if kappa < best:
            best_id, best = session_id, kappa
    return best_id, best
