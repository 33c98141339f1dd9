"""The core's placement against the exhaustive oracle on random small instances.

Each instance is a random current placement on 2-4 READY GPUs plus a few new (pending)
sessions, at most 12 in all, built on the profile's chunk-time table.  The core runs its
``place`` (greedy placement of the newcomers, then min-max local search) on a real
``Cluster``; its objective counts every ``Migrate`` it emitted at the session's kappa, exactly
as its gain ``Gamma`` charges them.  The oracle is ``placement_oracle.optimum`` on the same
objective.  Gap = ``J_core / J_opt - 1``, in percent; we also report the gap of the worst
latency alone.

On GPUs of one kind the core's min-max search is exact for this objective (a 0.0% gap is
expected). :func:`placement_gap_mixed` draws instances on GPUs of two kinds (e.g. the H20 and
the H200 profiles: K = 12 and K = 2, different chunk times), where it need not be.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from lab.eval.placement_oracle import (
    PlacementInstance,
    optimum,
    random_instance,
    random_mixed_instance,
)
from shared.profile import LatencyProfile

__all__ = ["PlacementGap", "core_objective", "placement_gap", "placement_gap_mixed"]


@dataclass(frozen=True, slots=True)
class PlacementGap:
    instances: int
    avg_pct: float
    max_pct: float
    worst_latency_avg_pct: float
    worst_latency_max_pct: float
    optimal_share: float  # instances where the core matched the optimum exactly

    def to_json(self) -> dict[str, float]:
        return {
            "instances": self.instances,
            "avg": round(self.avg_pct, 4),
            "max": round(self.max_pct, 4),
            "worst_latency_avg": round(self.worst_latency_avg_pct, 4),
            "worst_latency_max": round(self.worst_latency_max_pct, 4),
            "optimal_share": round(self.optimal_share, 4),
        }


def core_objective(
    inst: PlacementInstance,
    profile: LatencyProfile | Sequence[LatencyProfile],
    kind_of: tuple[int, ...] | None = None,
) -> tuple[float, float]:
    """(J, worst latency) of the core's ``place`` on this instance. ``profile`` is one
    profile, or with ``kind_of`` (each GPU's kind) a list of profiles, one per kind."""
    from services.scheduler.core.cluster import Cluster
    from services.scheduler.core.placement import place
    from services.scheduler.core.types import GpuState, Migrate

    gpu_ids = [f"g{g}" for g in range(inst.gpus)]
    if kind_of is None:
        if not isinstance(profile, LatencyProfile):
            raise TypeError("core_objective: several profiles need kind_of (each GPU's kind)")
        cluster = Cluster(profile)
        kinds = [profile.gpu_kind] * inst.gpus
    else:
        if isinstance(profile, LatencyProfile):
            raise TypeError("core_objective: with kind_of, profile is one profile per kind")
        cluster = Cluster({f"kind{k}": p for k, p in enumerate(profile)})
        kinds = [f"kind{k}" for k in kind_of]
    for gpu_id, kind in zip(gpu_ids, kinds, strict=True):
        cluster.add_gpu(gpu_id, kind, GpuState.READY, 0.0)
    kappa_of: dict[str, float] = {}
    for i, g in enumerate(inst.current):
        sid = f"s{i:02d}"
        session = cluster.add_session(sid)
        session.kappa_ms = inst.kappa[i]
        kappa_of[sid] = inst.kappa[i]
        if g is not None:
            cluster.place(sid, gpu_ids[g])
    decisions = place(cluster, eta=inst.eta)
    moved = sum(kappa_of[d.session_id] for d in decisions if isinstance(d, Migrate))
    worst = max(inst.latency[g][cluster.load(gpu_id)] for g, gpu_id in enumerate(gpu_ids))
    if cluster.pending:
        return float("inf"), float("inf")
    return worst + inst.eta * moved, worst


def placement_gap(
    profile: LatencyProfile,
    instances: int = 1000,
    seed: int = 0,
    eta: float = 0.1,
    max_gpus: int = 4,
    max_sessions: int = 12,
    capacity: int | None = None,
) -> PlacementGap:
    """Average and maximum gap of the core's placement to the optimum over random instances.

    ``capacity`` truncates the profile's chunk table (K = capacity) to make the capacity
    constraint bind on small instances (12 sessions on 4 GPUs never fill K = 12)."""
    if capacity is not None:
        profile = dataclasses.replace(
            profile, chunk_ms_table=profile.chunk_ms_table[:capacity], sources={}
        )
    rng = random.Random(seed)
    chunk = tuple(profile.chunk_ms(b) for b in range(1, profile.capacity + 1))
    base_kappa = profile.migration_ms()
    gaps: list[float] = []
    lat_gaps: list[float] = []
    for _ in range(instances):
        # Sessions' states differ in size (shorter or longer context): kappa varies +-50%.
        inst = random_instance(
            rng,
            chunk,
            (0.5 * base_kappa, 1.5 * base_kappa),
            eta,
            max_gpus=max_gpus,
            max_sessions=max_sessions,
        )
        j_opt, assignment = optimum(inst)
        j_core, worst_core = core_objective(inst, profile)
        worst_opt = max(inst.latency[g][assignment.count(g)] for g in range(inst.gpus))
        gaps.append(100.0 * (j_core / j_opt - 1.0))
        lat_gaps.append(100.0 * (worst_core / worst_opt - 1.0))
    return PlacementGap(
        instances=instances,
        avg_pct=statistics.fmean(gaps),
        max_pct=max(gaps),
        worst_latency_avg_pct=statistics.fmean(lat_gaps),
        worst_latency_max_pct=max(lat_gaps),
        optimal_share=sum(1 for g in gaps if g <= 1e-9) / len(gaps),
    )


def placement_gap_mixed(
    profiles: Sequence[LatencyProfile],
    instances: int = 1000,
    seed: int = 0,
    eta: float = 0.1,
    max_gpus: int = 4,
    max_sessions: int = 12,
) -> PlacementGap:
    """The same as :func:`placement_gap` on GPUs of several kinds, one profile per kind (each
    instance has at least two kinds). The kappa range is the first profile's."""
    rng = random.Random(seed)
    kinds = [tuple(p.chunk_ms(b) for b in range(1, p.capacity + 1)) for p in profiles]
    base_kappa = profiles[0].migration_ms()
    gaps: list[float] = []
    lat_gaps: list[float] = []
    for _ in range(instances):
        inst, kind_of = random_mixed_instance(
            rng,
            kinds,
            (0.5 * base_kappa, 1.5 * base_kappa),
            eta,
            max_gpus=max_gpus,
            max_sessions=max_sessions,
        )
        j_opt, assignment = optimum(inst)
        j_core, worst_core = core_objective(inst, profiles, kind_of)
        worst_opt = max(inst.latency[g][assignment.count(g)] for g in range(inst.gpus))
        gaps.append(100.0 * (j_core / j_opt - 1.0))
        lat_gaps.append(100.0 * (worst_core / worst_opt - 1.0))
    return PlacementGap(
        instances=instances,
        avg_pct=statistics.fmean(gaps),
        max_pct=max(gaps),
        worst_latency_avg_pct=statistics.fmean(lat_gaps),
        worst_latency_max_pct=max(lat_gaps),
        optimal_share=sum(1 for g in gaps if g <= 1e-9) / len(gaps),
    )
