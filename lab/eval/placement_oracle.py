"""The exhaustive placement oracle for small instances (up to about 4 GPUs and 12 sessions).

The objective is the one the core's local search optimises: the worst per-chunk latency over
the GPUs plus ``eta`` times the migration cost of every session that moved,

    J(phi) = max_g latency_g(n_g(phi)) + eta * sum_{i moved} kappa_i,

where ``n_g`` counts the active sessions placed on GPU g, ``latency_g(n)`` is GPU g's chunk
time at batch n on its own kind's profile (0 for an empty GPU), and a session "moved" when it
had a GPU and ``phi`` puts it on another one (a new or re-activated session has no GPU and
moves for free). GPU g holds at most its own K_g sessions. With one kind every row of
``latency`` is the same; with two (:func:`random_mixed_instance`) they differ.

``optimum`` searches every placement, grouped by their count vector (n_1..n_G).  The
grouping is exact, not a heuristic: the latency term depends on the counts alone, and for
fixed counts the cheapest way to reach them moves, off each GPU holding more sessions than its
target, exactly the surplus and the cheapest of them (moving any extra session in and another
out only adds migration cost; which GPU receives a moved session does not change the cost).
``brute_force`` enumerates the G**S assignments one by one; the tests check both agree.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = [
    "PlacementInstance",
    "brute_force",
    "objective",
    "optimum",
    "random_instance",
    "random_mixed_instance",
]


@dataclass(frozen=True, slots=True)
class PlacementInstance:
    """``latency[g][n]`` is GPU g's chunk time (ms) with n sessions, n = 0..K_g
    (latency[g][0] is 0); ``current[i]`` is session i's GPU or None; ``kappa[i]`` its
    migration cost (ms)."""

    latency: tuple[tuple[float, ...], ...]
    current: tuple[int | None, ...]
    kappa: tuple[float, ...]
    eta: float

    @property
    def gpus(self) -> int:
        return len(self.latency)

    @property
    def capacity(self) -> int:
        """The smallest K of the instance's GPUs."""
        return min(self.capacities)

    @property
    def capacities(self) -> tuple[int, ...]:
        """K_g of every GPU."""
        return tuple(len(row) - 1 for row in self.latency)


def objective(inst: PlacementInstance, assignment: Sequence[int]) -> float:
    """J(assignment); infinite when a GPU is over capacity."""
    counts = [0] * inst.gpus
    moved = 0.0
    for i, g in enumerate(assignment):
        counts[g] += 1
        if inst.current[i] is not None and inst.current[i] != g:
            moved += inst.kappa[i]
    if any(n > cap for n, cap in zip(counts, inst.capacities, strict=True)):
        return float("inf")
    worst = max(inst.latency[g][n] for g, n in enumerate(counts))
    return worst + inst.eta * moved


def brute_force(inst: PlacementInstance) -> tuple[float, tuple[int, ...]]:
    """Every assignment, one at a time (G**S of them): the reference for tests."""
    best: tuple[float, tuple[int, ...]] = (float("inf"), ())
    for assignment in itertools.product(range(inst.gpus), repeat=len(inst.current)):
        j = objective(inst, assignment)
        if j < best[0]:
            best = (j, assignment)
    return best


def _count_vectors(total: int, caps: Sequence[int]) -> Iterator[tuple[int, ...]]:
    if len(caps) == 1:
        if total <= caps[0]:
            yield (total,)
        return
    for first in range(min(total, caps[0]) + 1):
        for rest in _count_vectors(total - first, caps[1:]):
            yield (first, *rest)


def optimum(inst: PlacementInstance) -> tuple[float, tuple[int, ...]]:
    """The exact optimum of J, by count vectors (see the module docstring)."""
    sessions = len(inst.current)
    residents: list[list[int]] = [[] for _ in range(inst.gpus)]
    newcomers: list[int] = []
    for i, g in enumerate(inst.current):
        (newcomers if g is None else residents[g]).append(i)
    for row in residents:
        row.sort(key=lambda i: inst.kappa[i])
    # prefix[g][k]: migration cost of moving the k cheapest residents off GPU g.
    prefix: list[list[float]] = []
    for row in residents:
        sums = [0.0]
        for i in row:
            sums.append(sums[-1] + inst.kappa[i])
        prefix.append(sums)

    best_j = float("inf")
    best_counts: tuple[int, ...] | None = None
    for counts in _count_vectors(sessions, inst.capacities):
        worst = max(inst.latency[g][n] for g, n in enumerate(counts))
        if worst >= best_j:
            continue
        moved = sum(
            prefix[g][len(residents[g]) - n] for g, n in enumerate(counts) if n < len(residents[g])
        )
        j = worst + inst.eta * moved
        if j < best_j:
            best_j, best_counts = j, counts
    if best_counts is None:
        return float("inf"), ()
    return best_j, _realise(inst, residents, newcomers, best_counts)


def _realise(
    inst: PlacementInstance,
    residents: Sequence[Sequence[int]],
    newcomers: Sequence[int],
    counts: Sequence[int],
) -> tuple[int, ...]:
    """An assignment with these counts that moves only the cheapest surplus residents."""
    assignment = [-1] * len(inst.current)
    pool = list(newcomers)
    for g, row in enumerate(residents):
        surplus = max(0, len(row) - counts[g])
        pool.extend(row[:surplus])
        for i in row[surplus:]:
            assignment[i] = g
    for g, n in enumerate(counts):
        for _ in range(max(0, n - len(residents[g]))):
            assignment[pool.pop()] = g
    return tuple(assignment)


def random_instance(
    rng: random.Random,
    chunk_ms: Sequence[float],
    kappa_ms: tuple[float, float],
    eta: float,
    *,
    max_gpus: int = 4,
    max_sessions: int = 12,
) -> PlacementInstance:
    """A random current placement plus a few new sessions, within capacity.

    ``chunk_ms[n-1]`` is the chunk time at batch n; capacity is ``len(chunk_ms)``.
    """
    capacity = len(chunk_ms)
    gpus = rng.randint(2, max_gpus)
    sessions = rng.randint(2, min(max_sessions, gpus * capacity))
    new = rng.randint(0, min(3, sessions))
    counts = [0] * gpus
    current: list[int | None] = []
    for _ in range(sessions - new):
        free = [g for g in range(gpus) if counts[g] < capacity]
        # Skewed: prefer already-loaded GPUs, so imbalance is common (as after departures).
        g = rng.choice(free + [max(free, key=lambda g: counts[g])] * 2)
        counts[g] += 1
        current.append(g)
    current.extend([None] * new)
    latency = tuple((0.0, *chunk_ms) for _ in range(gpus))
    kappa = tuple(rng.uniform(*kappa_ms) for _ in range(sessions))
    return PlacementInstance(latency, tuple(current), kappa, eta)


def random_mixed_instance(
    rng: random.Random,
    kinds: Sequence[Sequence[float]],
    kappa_ms: tuple[float, float],
    eta: float,
    *,
    max_gpus: int = 4,
    max_sessions: int = 12,
) -> tuple[PlacementInstance, tuple[int, ...]]:
    """Like :func:`random_instance` on GPUs of several kinds (``kinds[k]`` is kind k's chunk
    time at batch 1..K_k), at least two kinds present; also returns each GPU's kind."""
    gpus = rng.randint(2, max_gpus)
    kind_of = [k % len(kinds) for k in range(min(gpus, len(kinds)))]
    kind_of += [rng.randrange(len(kinds)) for _ in range(gpus - len(kind_of))]
    rng.shuffle(kind_of)
    caps = [len(kinds[k]) for k in kind_of]
    sessions = rng.randint(2, min(max_sessions, sum(caps)))
    new = rng.randint(0, min(3, sessions))
    counts = [0] * gpus
    current: list[int | None] = []
    for _ in range(sessions - new):
        free = [g for g in range(gpus) if counts[g] < caps[g]]
        g = rng.choice(free + [max(free, key=lambda g: counts[g])] * 2)
        counts[g] += 1
        current.append(g)
    current.extend([None] * new)
    latency = tuple((0.0, *kinds[k]) for k in kind_of)
    kappa = tuple(rng.uniform(*kappa_ms) for _ in range(sessions))
    return PlacementInstance(latency, tuple(current), kappa, eta), tuple(kind_of)
