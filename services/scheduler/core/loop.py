"""The closed loop: one controller that places sessions and sizes the pool from one signal.

``Controller.step(event)`` does, in order:

1. apply the event to its cluster view (a session arrives, flips, leaves; a GPU becomes ready
   or vanishes); an active->idle flip emits ``Suspend``;
2. place pending sessions (new, re-activated, or displaced by a vanished GPU) on the GPU whose
   latency grows least (``Assign`` / ``Resume``);
3. rebalance by min-max local search (``Migrate``), unless migration is disabled;
4. autoscale, unless disabled (a scale-in is checked before step 3 as well): compare rho_max with rho_hat +- delta (rho_hat fixed, or looked up
   from the volatility level); *scale-out* asks for GPUs (``RequestGpus``), and the rebalance of
   step 3 moves sessions onto them when their ``GPU_READY`` arrives; *scale-in* first cancels
   booting GPUs (``Release``), then drains the least loaded ready GPUs (``Drain``), consolidates
   their sessions onto the others (``Migrate``) and releases them once empty (``Release``);
5. release any draining GPU that has become empty.

Warm-up: for ``warmup_s`` (default: the boot delay) after its first event the loop scales out
but never in, so a pool it starts with is not released on the first arrival of a warm system.
Idle reserve (not in the paper): the autoscaler sizes the pool for the active sessions plus
``idle_reserve`` times the idle ones (the table's value at the current volatility level unless
given), because idle users come back faster than a GPU boots.

The same class, with switches, is every built-in policy (see ``policies.py``): the static
baselines turn off migration and autoscaling and use another chooser for step 2.

Extension hooks for other policies (HPA-style, clairvoyant, predictive):
``current_rho_hat(t)`` and ``target_gpus(t, n_required, rho_max, budget, rho_hat, delta)``.
``target_gpus`` is called up to twice per step (before and after the rebalance); keep any state
it records idempotent for equal ``t``.

Deviations from the agreed shape: none in names. Documented choices: the controller is lenient
about inconsistent session events (an ``ACTIVE`` for an unknown session counts as an arrival,
``IDLE``/``DEPART`` for an unknown one are ignored, ``GPU_READY`` for a released or vanished
GPU is ignored and for an unknown one adds it), because the live service may replay events after a restart.
Sessions displaced by ``GPU_GONE`` lost their state and come back with ``Assign``.
"""

from __future__ import annotations

import math
from pathlib import Path

from services.scheduler.core import autoscale as autoscale_mod
from services.scheduler.core.autoscale import (
    FALLBACK_DELTA,
    FALLBACK_RHO_HAT,
    RhoTable,
    VolatilityTracker,
    load_rho_table,
)
from services.scheduler.core.cluster import Cluster, ClusterView
from services.scheduler.core.placement import (
    Chooser,
    LeastLatencyGrowth,
    SoonestFirstChunk,
    evacuate,
    place_pending,
    rebalance,
)
from services.scheduler.core.profile import LatencyProfile
from services.scheduler.core.types import (
    Decision,
    Drain,
    Event,
    EventKind,
    GpuState,
    Release,
    RequestGpus,
    Suspend,
)

DEFAULT_BOOT_DELAY_S = 30.0
DEFAULT_ETA = 0.1


class Controller:
    """The TurboServe loop (and, with switches, the baselines). Deterministic for an event
    sequence; no I/O; decisions are applied to its own view before they are returned."""

    def __init__(
        self,
        profile: LatencyProfile,
        *,
        name: str = "turboserve",
        rho_hat: float | None = None,
        delta: float | None = None,
        boot_delay_s: float = DEFAULT_BOOT_DELAY_S,
        eta: float = DEFAULT_ETA,
        initial_gpus: int = 1,
        gpu_kind: str | None = None,
        migrate: bool = True,
        autoscale: bool = True,
        chooser: Chooser | None = None,
        min_gpus: int = 1,
        max_gpus: int | None = None,
        rho_table: RhoTable | str | Path | None = None,
        scale_in_delay_s: float = 0.0,
        warmup_s: float | None = None,
        idle_reserve: float | None = None,
        t0: float = 0.0,
    ) -> None:
        if initial_gpus < 0 or min_gpus < 0:
            raise ValueError(f"initial_gpus and min_gpus must be >= 0, got {initial_gpus}, {min_gpus}")
        if rho_hat is not None and not 0 < rho_hat <= 1:
            raise ValueError(f"rho_hat must be in (0, 1], got {rho_hat}")
        if delta is not None and delta < 0:
            raise ValueError(f"delta must be >= 0, got {delta}")
        if eta < 0 or boot_delay_s < 0 or scale_in_delay_s < 0:
            raise ValueError(f"eta, boot_delay_s and scale_in_delay_s must be >= 0, got "
                             f"{eta}, {boot_delay_s}, {scale_in_delay_s}")
        if warmup_s is not None and not warmup_s >= 0:
            raise ValueError(f"warmup_s must be >= 0, got {warmup_s}")
        if idle_reserve is not None and not 0 <= idle_reserve <= 1:
            raise ValueError(f"idle_reserve must be in [0, 1], got {idle_reserve}")
        self.name = name
        self.profile = profile
        self.gpu_kind = gpu_kind or profile.gpu_kind
        self.boot_delay_s = boot_delay_s
        self.eta = eta
        self.migrate = migrate
        self.autoscale = autoscale
        self.min_gpus = min_gpus
        self.scale_in_delay_s = scale_in_delay_s
        self._low_since: float | None = None  # when a scale-in first wanted to fire
        # No scale-in before the loop has watched the traffic this long (see _autoscale).
        self.warmup_s = boot_delay_s if warmup_s is None else warmup_s
        self._started: float | None = None  # time of the first event
        # Share of idle sessions the pool is sized for as if active (see _autoscale); None:
        # the table's value at the current level (0 without a table or with a fixed rho_hat).
        self.idle_reserve = idle_reserve
        self.max_gpus = max_gpus
        self.chooser = chooser or LeastLatencyGrowth()
        self.fixed_rho_hat = rho_hat
        self.fixed_delta = delta
        if rho_hat is None and not isinstance(rho_table, RhoTable):
            rho_table = load_rho_table(rho_table)
        self.rho_table: RhoTable | None = rho_table if rho_hat is None else None
        table = self.rho_table
        self.volatility = table.tracker() if table else VolatilityTracker()
        self._cluster = Cluster(profile)
        self._view = ClusterView(self._cluster)
        self._released: set[str] = set()
        self._next_gpu = 0
        self.scale_events = 0
        for _ in range(initial_gpus):
            self._cluster.add_gpu(self._new_gpu_id(), self.gpu_kind, GpuState.READY, t0)

    # ---- the Policy interface -----------------------------------------------------------

    @property
    def view(self) -> ClusterView:
        return self._view

    def step(self, event: Event) -> list[Decision]:
        out: list[Decision] = []
        if self._started is None:
            self._started = event.t
        self._apply(event, out)
        cluster = self._cluster
        if cluster.pending:
            if isinstance(self.chooser, SoonestFirstChunk):
                self.chooser.now = event.t
            out.extend(place_pending(cluster, self.chooser))
        if self.autoscale:
            # Scale-in first: rebalancing never raises rho_max, so if it fires now it would fire
            # after the rebalance too, and consolidating first saves the moves a rebalance would
            # make onto GPUs about to be drained.
            out.extend(self._autoscale(event.t, scale_out=False))
        if self.migrate:
            out.extend(rebalance(cluster, self.eta, boundary_wait=True))
        if self.autoscale:
            out.extend(self._autoscale(event.t, scale_out=True))
        if cluster.draining:
            out.extend(self._finish_drains())
        return out

    def note_step(self, gpu_id: str, ends_at: float) -> None:
        """The environment reports that ``gpu_id`` started a batched pass (a whole coalesced step
        when the profile has one pass per chunk) ending at ``ends_at``: the next boundary where
        a joining session can enter (the simulator knows it; a live worker knows its batch and
        the profile).
        Not an event: it changes no decision by itself and returns none; placement reads it
        to put a newly active session where its first chunk comes soonest."""
        gpu = self._cluster.gpus.get(gpu_id)
        if gpu is not None:
            gpu.step_end = ends_at

    # ---- hooks for derived policies -----------------------------------------------------

    def current_rho_hat(self, t: float) -> tuple[float, float]:
        """(rho_hat, delta) in force at ``t``: fixed, or from the volatility level."""
        if self.fixed_rho_hat is not None:
            return self.fixed_rho_hat, FALLBACK_DELTA if self.fixed_delta is None else self.fixed_delta
        if self.rho_table is None:
            return FALLBACK_RHO_HAT, FALLBACK_DELTA if self.fixed_delta is None else self.fixed_delta
        level = self._volatility_level(t)
        rho, delta = self.rho_table.rho_hat[level], self.rho_table.delta[level]
        return rho, delta if self.fixed_delta is None else self.fixed_delta

    def current_idle_reserve(self, t: float) -> float:
        """Share of idle sessions sized for as if active at ``t``: fixed, or the table's."""
        if self.idle_reserve is not None:
            return self.idle_reserve
        if self.rho_table is None:
            return 0.0
        return self.rho_table.reserve(self._volatility_level(t))

    def _volatility_level(self, t: float) -> int:
        """The table's volatility level at ``t`` (its middle level until the window fills)."""
        assert self.rho_table is not None
        value = self.volatility.value(t)  # the table's own signal (dispersion or std)
        if value is None:
            return len(self.rho_table.rho_hat) // 2
        return self.rho_table.level(value)

    def target_gpus(
        self, t: float, n_required: int, rho_max: float, budget: int, rho_hat: float, delta: float
    ) -> int:
        """GPU count (READY + BOOTING) to aim for; ``budget`` means no scale event."""
        return autoscale_mod.scale(
            n_required, rho_max, budget, self._cluster.capacity, rho_hat, delta,
            min_gpus=self.min_gpus, max_gpus=self.max_gpus,
        )

    def rho_max(self) -> float:
        """Load of the fullest READY GPU over K; above 1 while sessions wait for a slot."""
        cluster = self._cluster
        if cluster.pending:
            return 1.0 + len(cluster.pending) / cluster.capacity
        return cluster.max_load / cluster.capacity

    # ---- internals ----------------------------------------------------------------------

    def _apply(self, event: Event, out: list[Decision]) -> None:
        cluster = self._cluster
        kind = event.kind
        sid = event.session_id
        if kind is EventKind.ARRIVE or kind is EventKind.ACTIVE:
            self.volatility.record(event.t)
            if sid in cluster.sessions:
                cluster.activate(sid)
            else:
                cluster.add_session(_require(sid, event))
        elif kind is EventKind.IDLE:
            if sid in cluster.sessions:
                gpu_id = cluster.deactivate(sid)
                if gpu_id is not None:
                    out.append(Suspend(sid, gpu_id))
        elif kind is EventKind.DEPART:
            if sid in cluster.sessions:
                cluster.remove_session(sid)
        elif kind is EventKind.GPU_READY:
            gpu_id = _require(event.gpu_id, event)
            if gpu_id in cluster.gpus:
                cluster.mark_ready(gpu_id, event.t)
            elif gpu_id not in self._released:
                cluster.add_gpu(gpu_id, self.gpu_kind, GpuState.READY, event.t)
        elif kind is EventKind.GPU_GONE:
            gpu_id = _require(event.gpu_id, event)
            if gpu_id in cluster.gpus:
                cluster.remove_gpu(gpu_id)
                self._released.add(gpu_id)  # never reuse the name; ignore a late GPU_READY
        else:
            self.volatility.observe(event.t)

    def _autoscale(self, t: float, scale_out: bool) -> list[Decision]:
        cluster = self._cluster
        rho_hat, delta = self.current_rho_hat(t)
        budget = cluster.budget
        n_required = cluster.n_active
        reserve = self.current_idle_reserve(t)
        if reserve:
            # Not in the paper (0 unless given or in the table): size the pool as if this share
            # of the idle sessions were active too. Idle users come back, and a storm of
            # returns is faster than a boot; the active count alone cannot see them coming.
            idle = len(cluster.sessions) - cluster.n_active
            n_required += math.ceil(reserve * idle - 1e-9)
        target = self.target_gpus(t, n_required, self.rho_max(), budget, rho_hat, delta)
        if target < budget and self._started is not None and t - self._started < self.warmup_s:
            # Warm-up: the pool the loop starts with (initial_gpus, or the GPUs a restarted
            # scheduler finds) is kept until the loop has seen warmup_s of traffic (default
            # one boot delay), instead of being released on the first event, before the
            # sessions that are already there have reported in. Scale-out is not delayed.
            return []
        if target < budget and self.scale_in_delay_s > 0:
            # Optional stabilisation (not in the paper; 0 by default): scale in only once the
            # load has stayed below the band for scale_in_delay_s.
            if self._low_since is None:
                self._low_since = t
            if t - self._low_since < self.scale_in_delay_s:
                return []
        elif target >= budget and scale_out:
            self._low_since = None
        if target > budget and scale_out:
            self.scale_events += 1
            return [self._request(target - budget, t)]
        if target < budget:
            out = self._scale_in(budget - target)
            if out:
                self.scale_events += 1
            return out
        return []

    def _request(self, count: int, t: float) -> RequestGpus:
        ids = tuple(self._new_gpu_id() for _ in range(count))
        for gpu_id in ids:
            self._cluster.add_gpu(gpu_id, self.gpu_kind, GpuState.BOOTING, t)
        return RequestGpus(ids, self.gpu_kind)

    def _scale_in(self, count: int) -> list[Decision]:
        cluster = self._cluster
        out: list[Decision] = []
        # 1. Booting GPUs serve nothing yet: cancel the newest requests first.
        for gpu_id in reversed(list(cluster.booting)):
            if count == 0:
                return out
            self._release(gpu_id, out)
            count -= 1
        # 2. Drain the least loaded READY GPUs (fewest migrations), consolidating their sessions
        #    onto the rest while those have room.
        while count > 0 and cluster.n_placeable > 1:
            gpu_id = next(iter(cluster.bucket(cluster.min_load)))
            moving = cluster.load(gpu_id)
            room = (cluster.n_placeable - 1) * cluster.capacity - (
                self._placed_on_placeable() - moving
            )
            if self.migrate and room < moving:
                break
            cluster.mark_draining(gpu_id)
            out.append(Drain(gpu_id))
            if self.migrate:
                out.extend(evacuate(cluster, gpu_id))
            count -= 1
        return out

    def _finish_drains(self) -> list[Decision]:
        cluster = self._cluster
        out: list[Decision] = []
        for gpu_id in list(cluster.draining):
            if self.migrate and cluster.load(gpu_id):
                out.extend(evacuate(cluster, gpu_id))
            if cluster.load(gpu_id) == 0:
                self._release(gpu_id, out)
        return out

    def _release(self, gpu_id: str, out: list[Decision]) -> None:
        self._cluster.remove_gpu(gpu_id)
        self._released.add(gpu_id)
        out.append(Release(gpu_id))

    def _placed_on_placeable(self) -> int:
        cluster = self._cluster
        on_draining = sum(cluster.load(g) for g in cluster.draining)
        return cluster.n_active - len(cluster.pending) - on_draining

    def _new_gpu_id(self) -> str:
        # Skip names the environment may have introduced itself (GPU_READY for unknown ids).
        while True:
            gpu_id = f"{self.gpu_kind.lower()}-{self._next_gpu:04d}"
            self._next_gpu += 1
            if gpu_id not in self._cluster.gpus and gpu_id not in self._released:
                return gpu_id


def _require(value: str | None, event: Event) -> str:
    if value is None:
        raise ValueError(f"event {event.kind} at t={event.t} needs an id: {event!r}")
    return value
