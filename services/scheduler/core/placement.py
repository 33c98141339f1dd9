"""Placement: the paper's min-max local search, made incremental.

1. Start from the previous placement: nothing moves without a reason.
2. Each new or re-activated session goes on the GPU whose latency grows least. Because a
   profile's ``chunk_ms`` is non-decreasing and all GPUs of a controller share one profile, that
   is the least loaded GPU with room: an O(1) bucket lookup.
3. Repeatedly take the best single move off the most loaded GPU. A move of session ``i`` from
   GPU ``s`` (``n_s`` sessions) to GPU ``d`` (``n_d``) gains

       Gamma = L - L' - eta * kappa_i,   L = chunk(n_s),   L' = max(chunk(n_s - 1), chunk(n_d + 1))

   i.e. the drop of the worst latency over the GPUs the move touches, less the migration cost.
   The best destination is the least loaded GPU and the best session the one cheapest to move.
   Apply it while Gamma > 0.

Why the pairwise L instead of the global worst latency: when several GPUs share the worst load,
no single move lowers the global maximum, so a literal reading of the paper stops at once on any
plateau. The pairwise gain never raises the global worst latency (both touched GPUs end below
``chunk(n_s)``, which is the global worst) and, applied until no move gains, lowers it as soon
as every GPU on the plateau has been relieved. The search ends: every applied move strictly
lowers the sorted load vector lexicographically.

Costs: each step of the search is O(1) (bucket pointers) plus a scan of the source GPU's at most
K sessions for the cheapest one.
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
    """Gamma of moving one session (migration cost ``kappa_ms``) from a GPU holding ``n_src``
    active sessions to one holding ``n_dst`` (see the module docstring)."""
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


def rebalance(cluster: Cluster, eta: float, max_moves: int | None = None) -> list[Migrate]:
    """Step 3: apply the best single move off the most loaded GPU while it gains."""
    out: list[Migrate] = []
    profile = cluster.profile
    while cluster.n_placeable >= 2 and (max_moves is None or len(out) < max_moves):
        src = cluster.most_loaded()
        dst = cluster.least_loaded()
        if src is None or dst is None or src == dst:
            break
        session_id, kappa = _cheapest_session(cluster, src)
        if move_gain(profile, cluster.max_load, cluster.min_load, kappa, eta) <= 0:
            break
        cluster.move(session_id, dst)
        out.append(Migrate(session_id, src, dst))
    return out


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
    cluster: Cluster, chooser: Chooser | None = None, eta: float = 0.1, migrate: bool = True
) -> list[Decision]:
    """Steps 1-3 on the cluster in place; returns the decisions, in the order to carry out."""
    out = place_pending(cluster, chooser or LeastLatencyGrowth())
    if migrate:
        out.extend(rebalance(cluster, eta))
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
