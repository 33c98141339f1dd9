"""The closed loop: one controller that places sessions and sizes the pool from one signal.

``Controller(profiles, config)``: ``profiles`` is a :class:`LatencyProfile` or a mapping GPU
kind -> profile (a pool of several kinds, each placed by its own profile); ``config`` is a
frozen :class:`ControllerConfig`. The controller reads no files.

``Controller.step(event)`` does, in order:

1. apply the event to its cluster view (a session arrives, flips, leaves; a GPU becomes ready,
   vanishes, is to be drained (and given back) or cordoned (drained and kept until
   uncordoned); a migration or placement failed); an active->idle flip emits ``Suspend``, an
   operator's drain ``Drain``;
2. place pending sessions (new, re-activated, or displaced by a vanished GPU or a failed
   placement) on the GPU whose latency grows least (``Assign`` / ``Resume``);
3. rebalance by min-max local search (``Migrate``), unless migration is disabled;
4. autoscale, unless disabled (a scale-in is checked before step 3 as well): compare rho_max
   with rho_hat +- delta (rho_hat fixed, or looked up from the volatility level); *scale-out*
   asks for GPUs (``RequestGpus``), and the rebalance of step 3 moves sessions onto them when
   their ``GPU_READY`` arrives; *scale-in* first cancels booting GPUs (``Release``), then
   drains the least loaded ready GPUs (``Drain``), consolidates their sessions onto the others
   (``Migrate``) and releases them once empty (``Release``);
5. release any draining GPU that has become empty, unless an operator cordoned it;
6. with the quality budget on (``min_steps``), tell each GPU over its budget the step count
   that serves its load on time, and each GPU back in budget full steps (``SetSteps``;
   ``quality.py``); step 2 then also places, once no GPU has room at full steps, on the room
   the floor adds.

Warm-up: for ``warmup_s`` (default: the boot delay) after its first event, or after
:meth:`Controller.restore`, the loop scales out but never in, so a pool it starts with is not
released on the first arrival of a warm system.
Idle reserve (not in the paper): the autoscaler sizes the pool for the active sessions plus
``idle_reserve`` times the idle ones (the table's value at the current volatility level unless
given), because idle users come back faster than a GPU boots.
Peak cap (not in the paper): the pool never holds more than the highest active count of the
last ``peak_window_s`` needs at utilisation ``peak_rho`` (the table's, none without one),
except in a surge: while the active count is above every count of the window older than
``peak_surge_s``.
Scale-in stabilisation (not in the paper): the pool never shrinks below the highest target of
the last ``scale_in_delay_s`` (the table's, 0 without one), as Kubernetes' HPA stabilises.
Scale cool-down (not in the paper; ``scale_cooldown_s``, 0: off): no scale-in within it of a
scale-out, and no scale-out within it of a scale-in unless sessions wait for a slot.
Pool limits: ``min_gpus`` / ``max_gpus`` from the config, replaced between steps by
:meth:`Controller.set_limits` (a live pool's limits change while it runs); with ``floor_kept``
the environment keeps the floor itself and a scale-out never asks for the GPUs it brings.

Several kinds: the autoscaler counts GPUs in units of the default kind (``config.gpu_kind``,
the kind it asks for): a GPU of twice its K counts as two. With one kind every count is the
plain GPU count.

The same class, with switches, is every built-in policy (see ``policies.py``): the static
baselines turn off migration and autoscaling and use another chooser for step 2.

Extension hooks for other policies (the rivals, ``rivals.py``; the lab's clairvoyant):
``current_rho_hat(t)`` and ``target_gpus(t, n_required, rho_max, budget, rho_hat, delta)``.
``target_gpus`` is called up to twice per step (before and after the rebalance); keep any state
it records idempotent for equal ``t``.

Documented choices: the controller is lenient about inconsistent events (an ``ACTIVE`` for an
unknown session counts as an arrival; ``IDLE``/``DEPART``/``MIGRATION_FAILED``/
``PLACEMENT_FAILED`` for an unknown or idle one are ignored; ``GPU_READY`` for a released or
vanished GPU is ignored and for an unknown one adds it; ``GPU_DRAIN`` of an unknown GPU is
ignored), because a live service may replay events after a restart. Sessions displaced by
``GPU_GONE`` lost their state and come back with ``Assign``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import deque
from collections.abc import Callable, Iterable, Mapping

from services.scheduler.core import autoscale as autoscale_mod
from services.scheduler.core.autoscale import (
    FALLBACK_DELTA,
    FALLBACK_RHO_HAT,
    RhoTable,
    VolatilityTracker,
)
from services.scheduler.core.cluster import Cluster, ClusterView
from services.scheduler.core.config import ControllerConfig
from services.scheduler.core.placement import (
    SoonestFirstChunk,
    evacuate,
    make_chooser,
    place_pending,
    rebalance,
)
from services.scheduler.core.quality import (
    StepBudget,
    check_min_steps,
    floor_of,
    place_in_reduced_room,
)
from services.scheduler.core.types import (
    Assign,
    Decision,
    Drain,
    Event,
    EventKind,
    GpuState,
    Migrate,
    Release,
    RequestGpus,
    RestoredGpu,
    RestoredSession,
    Resume,
    Suspend,
)
from shared.profile import LatencyProfile

_EPS = 1e-9


# A latency profile, or GPU kind -> profile: what every policy is built on.
Profiles = LatencyProfile | Mapping[str, LatencyProfile]


class Controller:
    """The TurboServe loop (and, with switches, the baselines). Deterministic for an event
    sequence; no I/O; decisions are applied to its own view before they are returned."""

    def __init__(
        self,
        profiles: Profiles,
        config: ControllerConfig | None = None,
    ) -> None:
        config = ControllerConfig() if config is None else config
        if not isinstance(config, ControllerConfig):
            raise TypeError(f"config must be a ControllerConfig, got {type(config).__name__}")
        self.config = config
        self.name = config.name
        self._cluster = Cluster(profiles, config.gpu_kind)
        self._view = ClusterView(self._cluster)
        self.gpu_kind = self._cluster.default_kind
        self.chooser = make_chooser(config.placement)
        self.rho_table = config.rho_table if config.rho_hat is None else None
        self.volatility = self.rho_table.tracker() if self.rho_table else VolatilityTracker()
        self._started: float | None = None  # time of the first event (warm-up clock)
        # Targets of the scale-in window: (time, target), targets strictly decreasing, so
        # the first entry is the highest of the window (a monotone queue).
        self._recent_targets: deque[tuple[float, float]] = deque()
        # Active counts of the peak window: (time, count), counts strictly decreasing.
        self._recent_active: deque[tuple[float, int]] = deque()
        # The same counts split at ``peak_surge_s`` ago: the newer ones in arrival order, the
        # older ones (still in the window) as a monotone queue like the one above.
        self._fresh_active: deque[tuple[float, int]] = deque()
        self._older_active: deque[tuple[float, int]] = deque()
        self._released: dict[str, str] = {}  # GPUs this controller gave back -> kind
        self._gone: set[str] = set()  # GPUs the environment reported gone
        self._next_gpu = 0
        self._id_prefix = config.gpu_id_prefix or (
            re.sub(r"[^a-z0-9]+", "-", self.gpu_kind.lower()).strip("-") or "gpu"
        )
        self.scale_events = 0
        # The last scale event: (time, +1 out / -1 in), for the cool-down.
        self._last_scale: tuple[float, int] | None = None
        check_min_steps(config.min_steps, self._cluster.profile)
        # The quality budget (quality.py): None while off for every kind, and then nothing of
        # it runs.
        self.step_budget: StepBudget | None = None
        if config.min_steps is not None and any(
            floor_of(p, config.min_steps) is not None for p in self._cluster.profiles.values()
        ):
            self.step_budget = StepBudget(config.min_steps)
        for _ in range(config.initial_gpus):
            self._cluster.add_gpu(self._new_gpu_id(), self.gpu_kind, GpuState.READY, config.t0)

    # ---- the Policy interface -----------------------------------------------------------

    @property
    def view(self) -> ClusterView:
        return self._view

    @property
    def autoscales(self) -> bool:
        """It asks for and gives back GPUs itself (else it keeps the pool it is given)."""
        return self.config.autoscale

    @property
    def boot_delay_s(self) -> float:
        """What it was told a GPU takes to boot."""
        return self.config.boot_delay_s

    def step(self, event: Event) -> list[Decision]:
        out: list[Decision] = []
        now = event.t
        if self._started is None:
            self._started = now
        self._apply(event, out)
        cluster = self._cluster
        config = self.config
        if cluster.pending:
            if isinstance(self.chooser, SoonestFirstChunk):
                self.chooser.now = now
            out.extend(place_pending(cluster, self.chooser, now))
            if self.step_budget is not None:
                out.extend(place_in_reduced_room(cluster, self.chooser, config.min_steps, now))
        if config.autoscale:
            # Scale-in first: rebalancing never raises rho_max, so if it fires now it would fire
            # after the rebalance too, and consolidating first saves the moves a rebalance would
            # make onto GPUs about to be drained.
            out.extend(self._autoscale(now, scale_out=False))
        if config.migrate:
            out.extend(rebalance(cluster, config.eta, boundary_wait=True, now=now))
        if config.autoscale:
            out.extend(self._autoscale(now, scale_out=True))
        if cluster.draining:
            out.extend(self._finish_drains(now))
        if self.step_budget is not None:
            out.extend(self.step_budget.update(cluster))
        return _coalesce(out) if len(out) > 1 else out

    def note_pass(self, gpu_id: str, ends_at: float) -> None:
        """The environment reports that ``gpu_id`` started a batched pass (a whole coalesced step
        when the profile has one pass per chunk) ending at ``ends_at``: the next boundary where
        a joining session can enter (the simulator knows it; a live worker knows its batch and
        the profile).
        Not an event: it changes no decision by itself and returns none; placement reads it
        to put a newly active session where its first chunk comes soonest."""
        gpu = self._cluster.gpus.get(gpu_id)
        if gpu is not None:
            gpu.step_end = ends_at

    def set_profile(self, kind: str, profile: LatencyProfile) -> None:
        """Replace (or add) the latency profile of GPU kind ``kind``, between steps.

        Not an event and returns no decisions: the next step places, rebalances and scales
        with it. If K drops below a GPU's load, that GPU keeps its sessions (above K) until the
        rebalance finds room elsewhere; it counts as the worst GPU, so the rebalance moves
        sessions off it first and the autoscaler sees rho_max above 1."""
        if not isinstance(profile, LatencyProfile):
            raise TypeError(f"profile must be a LatencyProfile, got {type(profile).__name__}")
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"kind must be a non-empty string, got {kind!r}")
        self._cluster.set_profile(kind, profile)

    def set_limits(self, min_gpus: int, max_gpus: int | None) -> None:
        """Follow new pool limits (the environment's floor and ceiling), between steps.

        Not an event and returns no decisions: the next step sizes the pool within them. A
        floor raised above the pool is not requested here when the environment keeps the floor
        itself (``floor_kept``); a ceiling lowered below it is reached by the next scale-in.
        Raises ``ValueError`` for limits a :class:`ControllerConfig` refuses."""
        if (min_gpus, max_gpus) != (self.config.min_gpus, self.config.max_gpus):
            self.config = dataclasses.replace(self.config, min_gpus=min_gpus, max_gpus=max_gpus)

    def restore(
        self, gpus: Iterable[RestoredGpu], sessions: Iterable[RestoredSession], t: float
    ) -> None:
        """Build the view from what a restarted scheduler finds, instead of the initial pool.

        Call it on a fresh controller, before its first step; then step a ``TICK`` at ``t``
        for the decisions the found state calls for (placing pending sessions, evacuating
        draining GPUs, releasing empty ones, scaling out). Rules:

        * every GPU is taken with its kind and state (BOOTING ones still send ``GPU_READY``);
        * an active session on a READY or DRAINING GPU stays there, even above K;
        * an active session on no GPU, or on a GPU not listed or still booting, is pending
          (``Resume`` if ``in_host_ram``, else ``Assign``);
        * an idle session holds no GPU, whatever ``gpu_id`` says;
        * the warm-up starts at ``t``: no scale-in for ``warmup_s`` (default one boot delay),
          so the found pool is not released before the sessions on it report in.

        Raises ``ValueError`` (naming the entry) for a duplicate GPU or session id or a GPU
        state that is not a ``GpuState``, and ``RuntimeError`` on a controller that has
        already stepped."""
        if self._started is not None:
            raise RuntimeError("restore() needs a fresh controller (this one has stepped)")
        cluster = Cluster(self._cluster.profiles, self.gpu_kind)
        for gpu in gpus:
            if gpu.gpu_id in cluster.gpus:
                raise ValueError(f"restore: GPU {gpu.gpu_id!r} listed twice")
            if not isinstance(gpu.state, GpuState):
                raise ValueError(
                    f"restore: GPU {gpu.gpu_id!r} has state {gpu.state!r}, "
                    f"not one of {', '.join(s.value for s in GpuState)}"
                )
            if not isinstance(gpu.kind, str) or not gpu.kind:
                raise ValueError(f"restore: GPU {gpu.gpu_id!r} needs a kind, got {gpu.kind!r}")
            cluster.add_gpu(gpu.gpu_id, gpu.kind, gpu.state, t)
            if gpu.cordoned and gpu.state is GpuState.DRAINING:
                cluster.cordoned[gpu.gpu_id] = None
            self._skip_name(gpu.gpu_id)
        for found in sessions:
            sid = found.session_id
            if sid in cluster.sessions:
                raise ValueError(f"restore: session {sid!r} listed twice")
            session = cluster.add_session(sid, active=found.active)
            session.in_host_ram = found.in_host_ram
            on = cluster.gpus.get(found.gpu_id) if found.gpu_id is not None else None
            if found.active and on is not None and on.state is not GpuState.BOOTING:
                cluster.put(sid, on.gpu_id)
        self._cluster = cluster
        self._view = ClusterView(cluster)
        self._started = t
        if self.step_budget is not None:
            self.step_budget.forget(
                g for g, gpu in cluster.gpus.items() if gpu.state is not GpuState.BOOTING
            )

    # ---- hooks for derived policies -----------------------------------------------------

    def current_rho_hat(self, t: float) -> tuple[float, float]:
        """(rho_hat, delta) in force at ``t``: fixed, or from the volatility level."""
        config = self.config
        if config.rho_hat is not None:
            return config.rho_hat, FALLBACK_DELTA if config.delta is None else config.delta
        if self.rho_table is None:
            return FALLBACK_RHO_HAT, FALLBACK_DELTA if config.delta is None else config.delta
        level = self._volatility_level(t)
        rho, delta = self.rho_table.rho_hat[level], self.rho_table.delta[level]
        return rho, delta if config.delta is None else config.delta

    def current_idle_reserve(self, t: float) -> float:
        """Share of idle sessions sized for as if active at ``t``: fixed, or the table's."""
        return self._per_level(self.config.idle_reserve, RhoTable.reserve, t)

    def current_scale_in_delay(self, t: float) -> float:
        """The scale-in stabilisation window at ``t`` (see ``_stabilised``): fixed, or
        the table's at the current level (0 without a table or with a fixed rho_hat)."""
        return self._per_level(self.config.scale_in_delay_s, RhoTable.scale_in_delay, t)

    def current_peak_rho(self, t: float) -> float:
        """The peak cap's utilisation at ``t`` (0: no cap): fixed, or the table's."""
        return self._per_level(self.config.peak_rho, RhoTable.peak_cap, t)

    def _per_level(
        self, fixed: float | None, column: Callable[[RhoTable, int], float], t: float
    ) -> float:
        """A setting given in the config, else the table's ``column`` at the current level
        (0 without a table)."""
        if fixed is not None:
            return fixed
        if self.rho_table is None:
            return 0.0
        return column(self.rho_table, self._volatility_level(t))

    def _volatility_level(self, t: float) -> int:
        """The table's volatility level at ``t`` (its middle level until the window fills)."""
        assert self.rho_table is not None
        value = self.volatility.value(t)  # the table's own signal (dispersion or std)
        if value is None:
            return len(self.rho_table.rho_hat) // 2
        return self.rho_table.level(value)

    def target_gpus(
        self,
        t: float,
        n_required: int,
        rho_max: float,
        budget: float,
        rho_hat: float,
        delta: float,
    ) -> float:
        """GPU count (READY + BOOTING, in units of the default kind) to aim for; ``budget``
        means no scale event."""
        return autoscale_mod.scale(
            n_required,
            rho_max,
            budget,
            self._cluster.capacity,
            rho_hat,
            delta,
            min_gpus=self.config.min_gpus,
            max_gpus=self.config.max_gpus,
        )

    def rho_max(self) -> float:
        """Load of the fullest READY GPU over its K; above 1 while sessions wait for a slot."""
        cluster = self._cluster
        if cluster.pending:
            return 1.0 + len(cluster.pending) / cluster.capacity
        return cluster.rho_max()

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
            self._gpu_ready(_require(event.gpu_id, event), event.gpu_kind, event.t)
        elif kind is EventKind.GPU_GONE:
            gpu_id = _require(event.gpu_id, event)
            if gpu_id in cluster.gpus:
                cluster.remove_gpu(gpu_id)
            self._gone.add(gpu_id)  # never reuse the name; ignore a late GPU_READY
            self._released.pop(gpu_id, None)
        elif kind is EventKind.GPU_DRAIN:
            self._operator_drain(_require(event.gpu_id, event), event.t, out)
        elif kind is EventKind.GPU_CORDON:
            self._cordon(_require(event.gpu_id, event), event.t, out)
        elif kind is EventKind.GPU_UNCORDON:
            gpu_id = _require(event.gpu_id, event)
            if gpu_id in cluster.cordoned:
                cluster.mark_undrained(gpu_id)
                # Back in the pool as a scale-out would bring it: the cool-down keeps a
                # scale-in from picking it (empty, the least loaded) at once.
                self._last_scale = (event.t, 1)
        elif kind is EventKind.GPU_KEPT:
            self._kept(_require(event.gpu_id, event), event.t)
        elif kind is EventKind.MIGRATION_FAILED:
            self._migration_failed(_require(sid, event), _require(event.gpu_id, event), event.t)
        elif kind is EventKind.PLACEMENT_FAILED:
            self._placement_failed(_require(sid, event), _require(event.gpu_id, event), event.t)
        else:
            self.volatility.observe(event.t)

    def _gpu_ready(self, gpu_id: str, gpu_kind: str | None, t: float) -> None:
        cluster = self._cluster
        gpu = cluster.gpus.get(gpu_id)
        if gpu is not None:
            if gpu.state is GpuState.BOOTING and gpu_kind and gpu_kind != gpu.kind:
                cluster.pool(gpu_kind)  # the environment booted another kind than asked for
                gpu.kind = gpu_kind
            cluster.mark_ready(gpu_id, t)
        elif gpu_id not in self._released and gpu_id not in self._gone:
            cluster.add_gpu(gpu_id, gpu_kind or self.gpu_kind, GpuState.READY, t)
            self._skip_name(gpu_id)

    def _operator_drain(self, gpu_id: str, t: float, out: list[Decision]) -> None:
        """Empty ``gpu_id`` and give it back, as a scale-in would; the autoscaler replaces it
        if the load needs it (it no longer counts in the budget)."""
        cluster = self._cluster
        gpu = cluster.gpus.get(gpu_id)
        if gpu is None:
            return
        if gpu.state is GpuState.DRAINING:
            cluster.cordoned.pop(gpu_id, None)  # a cordoned one is given back once empty
            return
        if gpu.state is GpuState.BOOTING:
            self._release(gpu_id, out)  # cancel the request
            return
        cluster.mark_draining(gpu_id)
        out.append(Drain(gpu_id))
        if self.config.migrate:
            out.extend(evacuate(cluster, gpu_id, t))

    def _cordon(self, gpu_id: str, t: float, out: list[Decision]) -> None:
        """An operator's drain that keeps the GPU: its sessions are moved off (as a drain's
        are), then it stays, out of placement and of the budget, and is never released by
        the loop (scale-in picks only READY GPUs; ``_finish_drains`` skips it). The operator
        has told the worker already: no ``Drain``. A GPU that is booting is not cordoned
        (there is nothing to keep yet)."""
        cluster = self._cluster
        gpu = cluster.gpus.get(gpu_id)
        if gpu is None or gpu.state is GpuState.BOOTING:
            return
        if gpu.state is GpuState.READY:
            cluster.mark_draining(gpu_id)
        cluster.cordoned[gpu_id] = None
        if self.config.migrate:
            out.extend(evacuate(cluster, gpu_id, t))

    def _kept(self, gpu_id: str, t: float) -> None:
        """A GPU given back that the environment keeps (a release refused for good): it is
        in the pool again and placeable, counted as a scale-out for the cool-down so that a
        scale-in does not pick it (empty, the least loaded) at once."""
        kind = self._released.pop(gpu_id, None)
        if kind is None or gpu_id in self._cluster.gpus:
            return
        self._cluster.add_gpu(gpu_id, kind, GpuState.READY, t)
        self._last_scale = (t, 1)

    def _migration_failed(self, sid: str, gpu_id: str, t: float) -> None:
        """The session is still on ``gpu_id`` (the source of the failed migration)."""
        cluster = self._cluster
        session = cluster.sessions.get(sid)
        if session is None or not session.active:
            return  # it went idle or left meanwhile: nothing to correct
        session.backoff_until = t + self.config.retry_backoff_s
        gpu = cluster.gpus.get(gpu_id)
        if gpu is None and gpu_id in self._released:
            # We gave the source back after evacuating it, but the environment keeps a GPU
            # until its migrations are done: take it back as DRAINING, release it once empty.
            cluster.add_gpu(gpu_id, self._released.pop(gpu_id), GpuState.DRAINING, t)
            gpu = cluster.gpus[gpu_id]
        if gpu is None or gpu.state is GpuState.BOOTING:
            # A GPU we do not know (or one that is not up) cannot hold it: its state is lost.
            cluster.unplace(sid)
            session.in_host_ram = False
            cluster.pending[sid] = None
            return
        cluster.put(sid, gpu_id)

    def _placement_failed(self, sid: str, gpu_id: str, t: float) -> None:
        """The ``Assign``/``Resume`` of the session onto ``gpu_id`` did not happen: it is on no
        GPU. It is placed again, not on ``gpu_id`` during the backoff."""
        cluster = self._cluster
        session = cluster.sessions.get(sid)
        if session is None or not session.active:
            return
        cluster.unplace(sid)
        cluster.pending[sid] = None
        session.failed_gpu = gpu_id
        session.backoff_until = t + self.config.retry_backoff_s

    def _autoscale(self, t: float, scale_out: bool) -> list[Decision]:
        cluster = self._cluster
        config = self.config
        rho_hat, delta = self.current_rho_hat(t)
        budget = cluster.budget_units()
        n_required = cluster.n_active
        reserve = self.current_idle_reserve(t)
        if reserve:
            # Not in the paper (0 unless given or in the table): size the pool as if this share
            # of the idle sessions were active too. Idle users come back, and a storm of
            # returns is faster than a boot; the active count alone cannot see them coming.
            idle = len(cluster.sessions) - cluster.n_active
            n_required += math.ceil(reserve * idle - _EPS)
        target = self.target_gpus(t, n_required, self.rho_max(), budget, rho_hat, delta)
        if target < budget and self._started is not None and t - self._started < config.warmup:
            # Warm-up: the pool the loop starts with (initial_gpus, or the GPUs a restarted
            # scheduler finds) is kept until the loop has seen warmup_s of traffic (default
            # one boot delay), instead of being released on the first event, before the
            # sessions that are already there have reported in. Scale-out is not delayed.
            return []
        target = self._capped(t, target, budget)
        target = self._stabilised(t, target, budget)
        if target > budget and scale_out:
            # GPUs the environment is bringing up to its floor by itself count as asked for.
            asked = budget + self._floor_coming()
            if target <= asked + _EPS or self._cooling(t, direction=1):
                return []
            self._scaled(t, direction=1)
            return [self._request(math.ceil(target - asked - _EPS), t)]
        if target < budget and not self._cooling(t, direction=-1):
            out = self._scale_in(budget - target, t)
            if out:
                self._scaled(t, direction=-1)
            return out
        return []

    def _floor_coming(self) -> float:
        """With ``floor_kept``: the GPUs the environment still starts to reach its floor on
        its own, the floor less every GPU that is up (ready, draining or cordoned); 0
        otherwise. GPUs booting at our request do not count: the environment started the
        floor's own boots when they were not there."""
        if not self.config.floor_kept:
            return 0.0
        cluster = self._cluster
        return max(0, self.config.min_gpus - (len(cluster.gpus) - len(cluster.booting)))

    def _cooling(self, t: float, direction: int) -> bool:
        """Whether a scale event in ``direction`` (+1 out, -1 in) waits out the cool-down of an
        event the other way: a scale-in never comes within ``scale_cooldown_s`` of a
        scale-out, nor a scale-out of a scale-in while no session waits for a slot."""
        last = self._last_scale
        if last is None or last[1] == direction or t - last[0] >= self.config.scale_cooldown_s:
            return False
        return not (direction > 0 and self._cluster.pending)

    def _scaled(self, t: float, direction: int) -> None:
        self.scale_events += 1
        self._last_scale = (t, direction)

    def _capped(self, t: float, target: float, budget: float) -> float:
        """Peak cap (not in the paper; the table's ``peak_rho``, none without one): the pool
        never grows beyond, and shrinks down to, what the highest active count of the last
        ``peak_window_s`` needs at utilisation ``peak_rho``. Headroom (a low rho_hat, the idle
        reserve) is for load that may come; at the top of what the recent past has seen it buys
        GPUs that a swing down leaves empty. With ``peak_rho`` <= 1 the cap always holds the
        active sessions of now, so it never keeps a session waiting for a slot.

        A surge lifts it: while the active count is above every count of the window older than
        ``peak_surge_s``, the load is beyond what the recent past has seen, and the pool grows
        for it with its full headroom (a cap at the new count would leave none for the
        sessions still arriving while a GPU boots)."""
        n = self._cluster.n_active
        self._note_active(t, n)
        peak_rho = self.current_peak_rho(t)
        if peak_rho <= 0:
            return target
        older = self._older_active
        if not older or n > older[0][1]:
            return target
        cap = math.ceil(self._recent_active[0][1] / (self._cluster.capacity * peak_rho) - _EPS)
        if target > budget:
            return max(budget, min(target, cap))
        return min(target, cap)

    def _note_active(self, t: float, n: int) -> None:
        """Record the active count ``n`` at ``t`` in the peak window's queues (O(1)
        amortised): the window's peak, and the peak of its part older than ``peak_surge_s``."""
        window, surge = self.config.peak_window_s, self.config.peak_surge_s
        recent = self._recent_active
        while recent and recent[-1][1] <= n:
            recent.pop()
        recent.append((t, n))
        while recent[0][0] <= t - window:  # never the entry just added
            recent.popleft()
        fresh, older = self._fresh_active, self._older_active
        if not fresh or fresh[-1] != (t, n):  # called twice in a step with the same count
            fresh.append((t, n))
        while fresh and fresh[0][0] <= t - surge:
            aged = fresh.popleft()
            while older and older[-1][1] <= aged[1]:
                older.pop()
            older.append(aged)
        while older and older[0][0] <= t - window:
            older.popleft()

    def _stabilised(self, t: float, target: float, budget: float) -> float:
        """Scale-in stabilisation (not in the paper; the table's window, 0 without one): the
        pool never shrinks below the highest target of the last ``scale_in_delay_s`` seconds,
        as Kubernetes' HPA stabilises its down-scaling. Where sessions flip between active and
        idle every few seconds, the fullest GPU's load dips below the band and comes straight
        back; a scale-in to the dip would drain a GPU that the next swing boots again. A
        scale-out is never delayed."""
        window = self.current_scale_in_delay(t)
        recent = self._recent_targets
        if window <= 0:
            recent.clear()
            return target
        while recent and recent[-1][1] <= target:
            recent.pop()
        recent.append((t, target))
        while recent[0][0] <= t - window:  # the entry just added is never this old
            recent.popleft()
        return target if target >= budget else min(budget, recent[0][1])

    def _request(self, count: int, t: float) -> RequestGpus:
        ids = tuple(self._new_gpu_id() for _ in range(count))
        for gpu_id in ids:
            self._cluster.add_gpu(gpu_id, self.gpu_kind, GpuState.BOOTING, t)
        return RequestGpus(ids, self.gpu_kind)

    def _scale_in(self, excess: float, t: float) -> list[Decision]:
        """Give back GPUs worth ``excess`` units of the default kind."""
        cluster = self._cluster
        out: list[Decision] = []
        # 1. Booting GPUs serve nothing yet: cancel the newest requests first.
        for gpu_id in reversed(list(cluster.booting)):
            if excess <= _EPS:
                return out
            units = cluster.units_of(gpu_id)
            if units <= excess + _EPS:
                self._release(gpu_id, out)
                excess -= units
        # 2. Drain the least loaded READY GPUs (fewest migrations), consolidating their sessions
        #    onto the rest while those have room.
        while excess > _EPS and cluster.n_placeable > 1:
            gpu_id = self._drain_candidate()
            units = cluster.units_of(gpu_id)
            if units > excess + _EPS:
                break
            moving = cluster.load(gpu_id)
            slots = sum(p.capacity * p.n for p in cluster.pools.values())
            room = slots - cluster.capacity_of(gpu_id) - (self._placed_on_placeable() - moving)
            if self.config.migrate and room < moving:
                break
            cluster.mark_draining(gpu_id)
            out.append(Drain(gpu_id))
            if self.config.migrate:
                out.extend(evacuate(cluster, gpu_id, t))
            excess -= units
        return out

    def _drain_candidate(self) -> str:
        """The READY GPU to drain first: the fewest active sessions (fewest migrations); ties:
        the smaller K (the weaker GPU), then kind and join order."""
        best: str | None = None
        best_key = (0, 0)
        for pool in self._cluster.live_pools():
            key = (pool.lo, pool.capacity)
            if best is None or key < best_key:
                best, best_key = next(iter(pool.buckets[pool.lo])), key
        assert best is not None
        return best

    def _finish_drains(self, t: float) -> list[Decision]:
        cluster = self._cluster
        out: list[Decision] = []
        for gpu_id in list(cluster.draining):
            if self.config.migrate and cluster.load(gpu_id):
                out.extend(evacuate(cluster, gpu_id, t))
            if cluster.load(gpu_id) == 0 and gpu_id not in cluster.cordoned:
                self._release(gpu_id, out)
        return out

    def _release(self, gpu_id: str, out: list[Decision]) -> None:
        kind = self._cluster.gpus[gpu_id].kind
        self._cluster.remove_gpu(gpu_id)
        self._released[gpu_id] = kind
        out.append(Release(gpu_id))

    def _placed_on_placeable(self) -> int:
        cluster = self._cluster
        on_draining = sum(cluster.load(g) for g in cluster.draining)
        return cluster.n_active - len(cluster.pending) - on_draining

    def _new_gpu_id(self) -> str:
        # Skip names the environment may have introduced itself (GPU_READY for unknown ids,
        # or a restore) and names used before.
        while True:
            gpu_id = f"{self._id_prefix}-{self._next_gpu:04d}"
            self._next_gpu += 1
            if (
                gpu_id not in self._cluster.gpus
                and gpu_id not in self._released
                and gpu_id not in self._gone
            ):
                return gpu_id

    def _skip_name(self, gpu_id: str) -> None:
        """Name new GPUs after ``gpu_id`` if it is one of this controller's names."""
        prefix, _, number = gpu_id.rpartition("-")
        if prefix == self._id_prefix and number.isdigit():
            self._next_gpu = max(self._next_gpu, int(number) + 1)


def _coalesce(out: list[Decision]) -> list[Decision]:
    """At most one placement decision per session in one list: a session placed or moved and
    then moved again in the same step (onto a GPU that a scale-in drains next, say) goes
    straight to where it ends, and a move back to where it started is dropped. The
    environment then never carries out a move that a later one in the same list undoes, and a
    failure report (``MIGRATION_FAILED``) names one move."""
    first: dict[str, int] = {}
    result: list[Decision | None] = list(out)
    merged = False
    for i, d in enumerate(out):
        if not isinstance(d, Assign | Resume | Migrate):
            continue
        j = first.setdefault(d.session_id, i)
        if j == i:
            continue
        merged = True
        earlier = result[j]
        final = d.dst if isinstance(d, Migrate) else d.gpu_id
        if isinstance(earlier, Migrate):
            result[j] = Migrate(d.session_id, earlier.src, final)
        elif isinstance(earlier, Assign | Resume):
            result[j] = type(earlier)(d.session_id, final)
        result[i] = None
    if not merged:
        return out
    return [d for d in result if d is not None and not (isinstance(d, Migrate) and d.src == d.dst)]


def _require(value: str | None, event: Event) -> str:
    if value is None:
        raise ValueError(f"event {event.kind} at t={event.t} needs an id: {event!r}")
    return value
