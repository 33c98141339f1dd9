"""Discrete-event simulator with pass-level timing and playback pacing, driving any policy
through the core's :class:`~services.scheduler.core.pool.Pool`, as the live scheduler does: the
policy's ``step``, and what the live pool adds (what an ``Assign`` or ``Resume`` becomes by the
session's state, a worker the core does not take, each pass's heartbeat, where a released GPU's
parked sessions go).

The model is the live worker's (``services/gpu_worker/pacing.py``), so that a simulated run and
a live replay of the same trace can be compared figure by figure:

* **Passes.** A READY or DRAINING GPU runs batched model passes back to back while any of its
  sessions takes part; a pass with ``b`` participants lasts ``chunk_ms(b) / passes_per_chunk``
  and a chunk is ``passes_per_chunk`` passes of a session. Sessions at different phases of
  their chunks share each pass (pass-level admission): a session joins at the next pass
  boundary, and its chunk is done at the end of its ``passes_per_chunk``-th pass.
* **Pacing.** Each session plays at its own pace. Chunk k is due at ``due_k``: ``due_0`` when
  the worker starts the session (``Assign`` or ``Resume``; a ``Migrate`` carries the clock
  over), ``due_{k+1} = max(due_k, done_k) + P`` (a late chunk stalls the viewer, whose clock
  slips), P the chunk period (default: the profile's deadline, as the emulated workers pace).
  The worker starts chunk k's first pass at ``due_k - max(lead, chunk time at the GPU's current
  batch)`` (lead: one period by default), so a chunk is done at most ``lead`` ahead of its due
  time; a session that is ahead sits out of the passes until then. With ``chunk_period_s=0``
  sessions run back to back (``due_{k+1} = done_k``), the model of earlier versions.
* **Latency** of a chunk is ``max(0, done - due)``; what the viewer sees (on-time chunks,
  missed periods, stall-adjusted attainment) is counted by :class:`ServiceLedger`
  (``sim/viewer.py``), which a live replay uses too.
* **Migration.** A migrated session finishes any chunk in flight on its source; then its state
  is copied (``profile.migration_ms()``) and it joins the first pass of the destination that
  starts once the copy is done (and its pacing lets it). Copies run beside compute (copy
  engines, one-sided reads), so they delay only the moved session, never a pass. Resuming
  from host RAM is a copy of ``resume_ms`` (default 0, as in the paper, which does not price
  it); the clock starts when it is done. Suspending is free: it overlaps the user's idle time.
  With ``parked_on_gpu`` (as the live mesh works: an idle session's state stays in the host
  memory of the worker it was suspended on), a resume on another GPU first moves the state
  there: a migration, counted and priced as one. A released worker's parked state first moves
  to the GPU the core picks (``Pool.parking_for``), a migration each, as the live scheduler
  moves it before the release; with no GPU to take it, a later resume pays the move. Without it (the
  default, the paper's assumption), parked state is reachable from every GPU at no cost.
* **GPUs.** A requested GPU costs from the request on, is BOOTING for ``boot_delay_s`` and
  serves nothing, then the policy hears ``GPU_READY``. A released GPU stops costing at the end
  of any pass still in flight on it. Cost is integrated to the end of the trace.
* **Idle sessions** sit in host RAM once the policy suspends them; they take no batch slot.
* **Quality budget.** A GPU runs the profile's full denoising steps per chunk until the policy
  sends ``SetSteps``; a chunk that starts after it (a session joining the batch for its next
  chunk) runs ``steps + 1`` passes, each costing ``pass_ms(batch)`` as at full steps. Chunks
  in flight keep their count. Each delivered chunk counts as on time at full steps
  (``on_time_full``), on time at fewer (``on_time_reduced``) or ``late`` (whatever its
  steps); ``reduced_pct`` is the share of chunks, on time or not, that ran fewer steps.

**Counters.** ``migrations`` counts Migrate decisions; ``scale_out_events`` counts controller
steps that request GPUs; ``scale_in_events`` steps that start a scale-in (a Drain, or a Release
of a GPU that was not draining; releasing a drained GPU finishes a counted scale-in);
``scale_events`` is their sum; ``chunks_after_migration`` counts each migrated session's first
chunk on its new GPU (and how many of those were late).

The policy sees trace events, a ``TICK`` every ``tick_s`` and ``GPU_READY``; its decisions are
carried out in order. A decision the environment cannot carry out (an unknown GPU or session,
releasing a GPU that still holds an active session) raises :class:`SimulationError`: the
simulator never guesses. Everything is deterministic for a given trace, policy and parameters;
only the measured decision times vary.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lab.sim.policies import POLICIES
from lab.sim.traceio import Trace, TraceEvent
from lab.sim.viewer import ServiceLedger, summary
from services.scheduler.core.autoscale import FALLBACK_RHO_HAT
from services.scheduler.core.policies import Policy
from services.scheduler.core.pool import (
    CheckHandedBack,
    Claim,
    Command,
    Found,
    Pool,
    ReleaseUnknown,
    ResumeThere,
    SessionSeen,
    WorkerHeard,
    WorkerJoined,
    WorkerPhase,
    WorkerSeen,
)
from services.scheduler.core.types import (
    Assign,
    Drain,
    Event,
    EventKind,
    GpuState,
    Migrate,
    Release,
    RequestGpus,
    Resume,
    SetSteps,
    Suspend,
)
from shared.profile import LatencyProfile, load_profile

DEFAULT_PRICE_USD_PER_GPU_HOUR = 2.0  # used when the profile names no price (see profile.py)

_TRACE_KINDS = {
    "arrive": EventKind.ARRIVE,
    "active": EventKind.ACTIVE,
    "idle": EventKind.IDLE,
    "depart": EventKind.DEPART,
}

# Heap priorities at equal times: passes end, then GPUs come up, then the trace, then ticks.
# (A finished copy, _P_COPY, or a paced session's start time, _P_WAKE, may start a pass on an
# idle GPU.)
_P_STEP, _P_COPY, _P_WAKE, _P_READY, _P_TRACE, _P_TICK = 0, 1, 2, 3, 4, 5
_EPS_S = 1e-9
# The kind the core's books keep for a worker picks the profile measured from its heartbeats,
# live; the simulator measures none (the policy keeps each GPU's kind in its view).
_NO_KIND = ""


class PolicyError(TypeError, ValueError):
    """A policy that cannot be built from the given parameters (one it does not take, or a
    value out of range). A ``TypeError`` as well as a ``ValueError``, so callers that catch
    either, as before, still do."""


class SimulationError(RuntimeError):
    """A decision the simulated environment cannot carry out; names the decision and time."""

    def __init__(self, t: float, decision: object, reason: str) -> None:
        super().__init__(f"t={t:.3f}s: cannot carry out {decision!r}: {reason}")
        self.t = t
        self.decision = decision
        self.reason = reason


@dataclass(slots=True)
class _Gpu:
    gpu_id: str
    requested_at: float
    ready: bool = False
    draining: bool = False
    released_at: float | None = None
    release_pending: bool = False  # released while a pass was in flight
    members: set[str] = field(default_factory=set)
    # Sessions in the batch: session -> (its epoch, the pass whose end completes its chunk,
    # the denoising steps of that chunk).
    batch: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    done_at: dict[int, list[str]] = field(default_factory=dict)  # pass -> sessions completing
    leaving: set[str] = field(default_factory=set)  # went idle / departed while in the batch
    pass_no: int = 0  # index of the pass in flight (or the next one)
    busy: bool = False
    wake_at: float = math.inf  # a wake-up is scheduled then (a paced session may start)
    steps: int = 0  # denoising steps of the chunks that start now (0: the model's full count)


@dataclass(slots=True)
class _Session:
    spell_start: float  # when it became active (arrive / idle->active)
    active: bool = True
    gpu: str | None = None
    due: float = 0.0  # the playback clock: when its next chunk is due (once ``clocked``)
    clocked: bool = False  # a worker started its clock in this spell
    in_flight: str | None = None  # GPU whose pass is producing its chunk now
    pending_copy_ms: float = 0.0  # a copy to start once no chunk of it is in flight
    ready_at: float = 0.0  # its state is on its GPU from then on
    first: bool = True  # next chunk is the first of this active spell
    epoch: int = 0  # bumped when the session goes idle: a chunk in flight then is void
    migrated_to: str | None = None  # set until its first chunk on the migration's target
    parked_on: str | None = None  # the GPU whose host holds its idle state (parked_on_gpu)


@dataclass
class SimResult:
    """What one run measured. ``to_json()`` is the ``sim run --json`` document."""

    policy: str
    trace: str
    duration_s: float
    cost_gpu_seconds: float
    cost_usd: float
    latencies_ms: list[float]
    first_chunk_latencies_ms: list[float]
    stream_latencies_ms: list[float]
    deadline_ms: float
    migrations: int
    scale_events: int
    peak_gpus: int
    decision_times_ms: list[float]
    timeline: list[tuple[float, int, int]]  # (t, GPUs held incl. booting, active sessions)
    params: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    chunks_after_migration: int = 0
    late_chunks_after_migration: int = 0
    # Delivery time and missed periods (0: on time) of each chunk, parallel to latencies_ms,
    # and the times and missed periods of spells that ended overdue (keep_chunk_times only).
    chunk_times_s: list[float] = field(default_factory=list)
    first_flags: list[bool] = field(default_factory=list)
    chunk_missed: list[int] = field(default_factory=list)
    missed_at: list[tuple[float, int]] = field(default_factory=list)
    # Spells that ended (idle, departure, end of trace) with their next chunk overdue.
    unserved_chunks: int = 0
    on_time_chunks: int = 0
    missed_periods: int = 0  # chunk periods without an on-time chunk (see viewer.py)
    missed_periods_at_start: int = 0  # of those, before a spell's first chunk
    startups_ms: list[float] = field(default_factory=list)  # each first chunk's startup
    scale_out_events: int = 0
    scale_in_events: int = 0
    sessions: int = 0
    chunk_period_s: float = 0.0
    # The quality budget: delivered chunks on time at full steps, on time at fewer, late (any
    # steps), and how many of all of them ran fewer steps.
    on_time_full: int = 0
    on_time_reduced: int = 0
    late: int = 0
    reduced_chunks: int = 0

    @property
    def chunks(self) -> int:
        return len(self.latencies_ms)

    @property
    def reduced_pct(self) -> float:
        """Share of delivered chunks that ran fewer than the full denoising steps, in %."""
        return 100.0 * self.reduced_chunks / self.chunks if self.chunks else 0.0

    @property
    def deadline_attainment(self) -> float:
        """On-time chunks / chunks delivered (``viewer.py``)."""
        return self.on_time_chunks / self.chunks if self.chunks else 1.0

    @property
    def stall_adjusted_attainment(self) -> float:
        """On-time chunks / (on-time chunks + missed chunk periods): the measure of service."""
        total = self.on_time_chunks + self.missed_periods
        return self.on_time_chunks / total if total else 1.0

    def latency(self) -> dict[str, float]:
        return summary(self.latencies_ms)

    def decision(self) -> dict[str, float]:
        return summary(self.decision_times_ms)

    def to_json(self, timeline: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "policy": self.policy,
            "trace": self.trace,
            "duration_s": self.duration_s,
            "sessions": self.sessions,
            "cost_gpu_seconds": round(self.cost_gpu_seconds, 3),
            "cost_usd": round(self.cost_usd, 4),
            "latency_ms": self.latency(),
            "first_chunk_latency_ms": summary(self.first_chunk_latencies_ms),
            "stream_latency_ms": summary(self.stream_latencies_ms),
            "deadline_ms": self.deadline_ms,
            "chunk_period_s": self.chunk_period_s,
            "deadline_attainment": round(self.deadline_attainment, 6),
            "stall_adjusted_attainment": round(self.stall_adjusted_attainment, 6),
            "missed_periods": self.missed_periods,
            "missed_periods_at_start": self.missed_periods_at_start,
            "startup_ms": summary(self.startups_ms),
            "migrations": self.migrations,
            "chunks_after_migration": {
                "total": self.chunks_after_migration,
                "late": self.late_chunks_after_migration,
            },
            "scale_events": self.scale_events,
            "scale_out_events": self.scale_out_events,
            "scale_in_events": self.scale_in_events,
            "peak_gpus": self.peak_gpus,
            "decision_ms": self.decision(),
            "chunks": self.chunks,
            "on_time_full": self.on_time_full,
            "on_time_reduced": self.on_time_reduced,
            "late": self.late,
            "reduced_pct": round(self.reduced_pct, 4),
            "unserved_chunks": self.unserved_chunks,
            "params": self.params,
            "wall_s": round(self.wall_s, 3),
        }
        if timeline:
            out["timeline"] = [list(x) for x in self.timeline]
        return out


class Simulator:
    """One run of one policy over one trace. Use :func:`simulate` unless you need the parts."""

    def __init__(
        self,
        trace: Trace,
        policy: Policy,
        profile: LatencyProfile,
        *,
        boot_delay_s: float = 30.0,
        tick_s: float = 1.0,
        price_usd_per_gpu_hour: float | None = None,
        progress: Callable[[float], None] | None = None,
        keep_chunk_times: bool = False,
        resume_ms: float = 0.0,
        chunk_period_s: float | None = None,
        lead_s: float | None = None,
        parked_on_gpu: bool = False,
    ) -> None:
        self.trace = trace
        self.resume_ms = float(resume_ms)
        self.parked_on_gpu = parked_on_gpu
        self.keep_chunk_times = keep_chunk_times
        self.chunk_times: list[float] = []
        self.first_flags: list[bool] = []
        self.chunk_missed: list[int] = []
        self.missed_at: list[tuple[float, int]] = []
        self.policy = policy
        self.profile = profile
        self.boot_delay_s = float(boot_delay_s)
        self.tick_s = float(tick_s)
        # The core as the live scheduler runs it: the policy and the books of its workers.
        # Simulated workers never fall silent, and a requested GPU always boots.
        self.pool = Pool(policy, math.inf, math.inf, self.tick_s)
        self.parked: dict[str, int] = {}  # GPU -> idle sessions parked in its host memory
        self.period_s = (
            profile.deadline_ms / 1000.0 if chunk_period_s is None else float(chunk_period_s)
        )
        self.lead_s = self.period_s if lead_s is None else float(lead_s)
        if not (math.isfinite(self.period_s) and self.period_s >= 0):
            raise ValueError(f"chunk_period_s must be >= 0, got {chunk_period_s}")
        if not (math.isfinite(self.lead_s) and self.lead_s >= 0):
            raise ValueError(f"lead_s must be >= 0, got {lead_s}")
        self.ledger = ServiceLedger(self.period_s, profile.deadline_ms)
        self.price = (
            price_usd_per_gpu_hour
            or profile.price_usd_per_gpu_hour
            or DEFAULT_PRICE_USD_PER_GPU_HOUR
        )
        self.progress = progress
        self.now = 0.0
        self.gpus: dict[str, _Gpu] = {}
        self.sessions: dict[str, _Session] = {}
        # (time, priority, sequence, payload): the payload's type goes with the priority (a
        # GPU id, a trace row's index, a session id, or None for a tick).
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.first_latencies: list[float] = []
        self.stream_latencies: list[float] = []
        self.decision_ms: list[float] = []
        self.migrations = 0
        self.after_migration = 0  # chunks that were a session's first after a migration
        self.late_after_migration = 0  # ... and were not on time
        self.scale_out = 0
        self.scale_in = 0
        self.n_active = 0
        self.timeline: list[tuple[float, int, int]] = []
        self.held = 0
        self.peak = 0
        self._passes = max(1, profile.passes_per_chunk)
        self._full_steps = profile.full_steps
        self.on_time_full = self.on_time_reduced = self.late = self.reduced = 0
        self._pass_s = [0.0] + [profile.chunk_ms(b) / 1000.0 / self._passes for b in range(1, 257)]
        self._migration_ms = profile.migration_ms()

    # ---- driving --------------------------------------------------------------------------

    def run(self) -> SimResult:
        wall = time.perf_counter()
        self._adopt_initial_gpus()
        for i in range(len(self.trace.events)):
            self._push(self.trace.events[i].t, _P_TRACE, i)
        end = self.trace.duration
        n_ticks = int(end // self.tick_s) if self.tick_s > 0 else 0
        for k in range(1, n_ticks + 1):
            self._push(k * self.tick_s, _P_TICK, None)
        next_report = 0.0
        while self.heap and self.heap[0][0] <= end:
            t, prio, _, payload = heapq.heappop(self.heap)
            self.now = t
            if prio == _P_STEP:
                self._end_step(payload)
            elif prio == _P_TRACE:
                self._trace_event(self.trace.events[payload])
            elif prio == _P_COPY:
                self._copy_done(payload)
            elif prio == _P_WAKE:
                self._wake(payload)
            elif prio == _P_READY:
                self._gpu_ready(payload)
            else:
                self._heartbeats()
                self._call(Event(t, EventKind.TICK))
            if self.progress is not None and t >= next_report:
                self.progress(t / end if end > 0 else 1.0)
                next_report = t + end / 200.0
        self.now = end
        self._account_unserved(end)
        if self.progress is not None:
            self.progress(1.0)
        return self._result(time.perf_counter() - wall)

    def _push(self, t: float, prio: int, payload: str | int | None) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, prio, self.seq, payload))

    def _adopt_initial_gpus(self) -> None:
        """GPUs the policy starts with (static pools, ``initial_gpus``) are READY at t=0."""
        for gpu_id, ready in _initial_gpus(self.policy):
            self.gpus[gpu_id] = _Gpu(gpu_id, requested_at=0.0, ready=ready)
            if ready:
                self.pool.join(gpu_id, _NO_KIND, 0.0)
            else:
                self.pool.booting[gpu_id] = 0.0
                self._push(self.boot_delay_s, _P_READY, gpu_id)
            self.held += 1
        self.peak = self.held
        self.timeline.append((0.0, self.held, 0))

    # ---- events in ------------------------------------------------------------------------

    def _trace_event(self, ev: TraceEvent) -> None:
        sid, kind = ev.session_id, ev.event
        if kind == "arrive":
            self.sessions[sid] = _Session(spell_start=ev.t)
            self.n_active += 1
        elif kind == "active":
            s = self.sessions[sid]
            s.active, s.first, s.clocked, s.spell_start = True, True, False, ev.t
            self.n_active += 1
        else:
            s = self.sessions[sid]
            if s.active:
                self.n_active -= 1
                self._spell_ended(s, ev.t)  # its next chunk never comes
            s.active = False
            s.epoch += 1
            if s.in_flight is not None:
                self.gpus[s.in_flight].leaving.add(sid)  # leaves the batch at the next pass
            if kind == "depart":
                if s.gpu is not None:
                    self.gpus[s.gpu].members.discard(sid)
                del self.sessions[sid]
        self._call(Event(ev.t, _TRACE_KINDS[kind], session_id=sid))

    def _gpu_ready(self, gpu_id: str) -> None:
        g = self.gpus.get(gpu_id)
        if g is None or g.released_at is not None or g.release_pending:
            return  # cancelled while booting
        g.ready = True
        self.pool.join(gpu_id, _NO_KIND, self.now)
        self._call(WorkerJoined(self.now, gpu_id, None))

    def _call(self, event: Event | WorkerJoined) -> None:
        t0 = time.perf_counter()
        decisions = self.pool.decide(event)
        self.decision_ms.append((time.perf_counter() - t0) * 1000.0)
        if decisions:
            self._apply(decisions)
        self._mark()

    # ---- decisions out --------------------------------------------------------------------

    def _apply(self, decisions: list[Command]) -> None:
        touched: set[str] = set()
        scaled_out = scaled_in = False
        for d in decisions:
            if isinstance(d, Assign | Resume):
                s = self._session(d, d.session_id)
                placed = self.pool.place(self._seen(d, s), isinstance(d, Resume), self.now)
                if placed is None or isinstance(placed, Event):
                    # The simulated registry is the core's view: it never lags.
                    raise SimulationError(self.now, d, f"the core makes {placed!r} of it")
                self._place(d, s, d.session_id, d.gpu_id)
                # The worker starts the session, and its playback clock, now (a resume once
                # its state is back from host RAM).
                s.clocked = True
                s.due = self.now
                copy_ms = 0.0
                if not isinstance(placed, Claim) or placed.requeue:
                    copy_ms = self.resume_ms  # state comes back from host RAM
                    if not isinstance(placed, ResumeThere):
                        # From another worker's host first (a worker released meanwhile
                        # had it moved off: priced the same).
                        copy_ms += self._migration_ms
                        self.migrations += 1
                if copy_ms > 0:
                    s.pending_copy_ms += copy_ms
                    s.due = self.now + copy_ms / 1000.0
                    self._start_copy(d.session_id, s)
                self._unpark(s)
                touched.add(d.gpu_id)
            elif isinstance(d, Migrate):
                s = self._session(d, d.session_id)
                if s.gpu != d.src:
                    raise SimulationError(self.now, d, f"session is on {s.gpu}, not {d.src}")
                self._place(d, s, d.session_id, d.dst)
                s.pending_copy_ms += self._migration_ms
                self._start_copy(d.session_id, s)
                s.migrated_to = d.dst
                self.migrations += 1
                touched.add(d.dst)
            elif isinstance(d, Suspend):
                s = self._session(d, d.session_id)
                if s.gpu is not None:
                    self.gpus[s.gpu].members.discard(d.session_id)
                    if self.parked_on_gpu:
                        s.parked_on = s.gpu
                        self.parked[s.gpu] = self.parked.get(s.gpu, 0) + 1
                s.gpu = None
            elif isinstance(d, RequestGpus):
                for gpu_id in d.gpu_ids:
                    if gpu_id in self.gpus:
                        raise SimulationError(self.now, d, f"GPU {gpu_id} already exists")
                    self.gpus[gpu_id] = _Gpu(gpu_id, requested_at=self.now)
                    self._push(self.now + self.boot_delay_s, _P_READY, gpu_id)
                    self.held += 1
                scaled_out = True
            elif isinstance(d, Drain):
                self._gpu(d, d.gpu_id).draining = True
                scaled_in = True
            elif isinstance(d, Release):
                # Releasing a drained GPU finishes a scale-in already counted at its Drain.
                scaled_in |= not self._gpu(d, d.gpu_id).draining
                self._release(d)
            elif isinstance(d, SetSteps):
                self._set_steps(d)
            elif isinstance(d, ReleaseUnknown):
                self._release(Release(d.gpu_id))
            elif isinstance(d, CheckHandedBack):
                raise SimulationError(self.now, d, "a simulated worker never hands a session back")
            else:
                raise SimulationError(self.now, d, "unknown decision type")
        self.scale_out += int(scaled_out)
        self.scale_in += int(scaled_in)
        self.peak = max(self.peak, self.held)
        for gpu_id in touched:
            g = self.gpus[gpu_id]
            if not g.busy:
                self._start_step(g)

    def _seen(self, d: Assign | Resume, s: _Session) -> SessionSeen:
        """The session as the live registry would hold it when ``d`` is carried out: pending
        (new, or its worker gone), or suspended with its state parked on a worker (without
        ``parked_on_gpu``: on whichever it resumes on)."""
        if s.parked_on is not None:
            return SessionSeen(d.session_id, d.gpu_id, Found.SUSPENDED, s.parked_on)
        if isinstance(d, Resume):
            return SessionSeen(d.session_id, d.gpu_id, Found.SUSPENDED, d.gpu_id)
        return SessionSeen(d.session_id, d.gpu_id, Found.PENDING)

    def _unpark(self, s: _Session) -> None:
        if s.parked_on is not None:
            self.parked[s.parked_on] -= 1
            s.parked_on = None

    def _session(self, d: object, sid: str) -> _Session:
        s = self.sessions.get(sid)
        if s is None:
            raise SimulationError(self.now, d, f"unknown or departed session {sid}")
        return s

    def _gpu(self, d: object, gpu_id: str) -> _Gpu:
        g = self.gpus.get(gpu_id)
        if g is None or g.released_at is not None or g.release_pending:
            raise SimulationError(self.now, d, f"unknown or released GPU {gpu_id}")
        return g

    def _place(self, d: object, s: _Session, sid: str, gpu_id: str) -> None:
        g = self._gpu(d, gpu_id)
        if s.gpu is not None and s.gpu in self.gpus:
            self.gpus[s.gpu].members.discard(sid)
        s.gpu = gpu_id
        g.members.add(sid)

    def _set_steps(self, d: SetSteps) -> None:
        """Chunks that start on the GPU from now on run ``d.steps`` denoising steps."""
        g = self._gpu(d, d.gpu_id)
        full = self._full_steps
        if not 1 <= d.steps <= full:
            raise SimulationError(self.now, d, f"steps must be in 1..{full} (the model's)")
        if d.steps < full and self._passes != full + 1:
            raise SimulationError(
                self.now,
                d,
                f"profile {self.profile.name!r} runs {self._passes} passes per chunk, not "
                f"full steps + 1 = {full + 1}: fewer steps cannot be timed",
            )
        g.steps = d.steps
        self.pool.steps_sent(d.gpu_id, self.now)  # a simulated worker applies it at once

    def _release(self, d: Release) -> None:
        g = self._gpu(d, d.gpu_id)
        live = [sid for sid in g.members if self.sessions[sid].active]
        if live:
            raise SimulationError(self.now, d, f"GPU still holds active sessions {sorted(live)}")
        for sid in g.members:  # idle, never suspended: their state goes to host RAM now
            self.sessions[sid].gpu = None
        g.members.clear()
        if self.parked.get(d.gpu_id):
            self._move_parked(d.gpu_id)
        self.pool.released(d.gpu_id)
        self.pool.leave(d.gpu_id)
        if g.busy:
            g.release_pending = True  # held and billed until the pass in flight ends
        else:
            g.released_at = self.now
            self.held -= 1

    def _move_parked(self, gpu_id: str) -> None:
        """The idle sessions parked on a GPU given back move to the worker the core picks (a
        migration each, as the live scheduler moves them before the release); with none to
        take them, their state stays reachable where it was (a resume then pays the move)."""
        target = self.pool.parking_for(gpu_id)
        if target is None:
            return
        for s in self.sessions.values():
            if s.parked_on == gpu_id:
                self._unpark(s)
                s.parked_on = target
                self.parked[target] = self.parked.get(target, 0) + 1
                self.migrations += 1

    # ---- pass-level timing ----------------------------------------------------------------

    def _start_step(self, g: _Gpu) -> None:
        """Start the next pass on an idle GPU (the name is kept from the chunk-level model: with
        ``passes_per_chunk = 1`` a pass is a whole coalesced step)."""
        if not g.ready or g.released_at is not None or g.release_pending:
            return
        self._admit(g)
        if g.batch:
            self._run_pass(g)

    def _admit(self, g: _Gpu) -> None:
        """At a pass boundary: every member ready for a chunk joins the batch if its pacing lets
        it (``due - max(lead, chunk time at the current batch) <= now``); its chunk completes at
        the end of the ``passes_per_chunk``-th pass from this one. If a member waits for its
        start time and nothing runs, the GPU wakes up then."""
        now = self.now
        sessions = self.sessions
        members: list[str] = []
        batch = 0  # active sessions on the GPU: the worker's estimate of its batch
        for sid in g.members:
            s = sessions[sid]
            if s.active:
                batch += 1
                if s.in_flight is None and s.ready_at <= now:
                    members.append(sid)
        if not members:
            return
        joiners = members
        steps = g.steps or self._full_steps
        passes = self._passes - (self._full_steps - steps)  # steps + 1 when reduced
        if self.period_s > 0:
            head = max(self.lead_s, passes * self._pass_time(batch))
            joiners = []
            wake = math.inf
            for sid in members:
                start = sessions[sid].due - head
                if start <= now + _EPS_S:
                    joiners.append(sid)
                elif start < wake:
                    wake = start
            if wake < math.inf and not g.batch and not joiners and wake < g.wake_at:
                g.wake_at = wake
                self._push(wake, _P_WAKE, g.gpu_id)
            if not joiners:
                return
        joiners.sort()  # set order is not deterministic across runs; sorted order is
        last = g.pass_no + passes - 1
        done = g.done_at.get(last)
        if done is None:
            done = g.done_at[last] = []
        gpu_id = g.gpu_id
        for sid in joiners:
            s = sessions[sid]
            s.in_flight = gpu_id
            g.batch[sid] = (s.epoch, last, steps)
            done.append(sid)

    def _pass_time(self, n: int) -> float:
        return self._pass_s[n] if n < len(self._pass_s) else self.profile.pass_ms(n) / 1e3

    def _run_pass(self, g: _Gpu) -> None:
        pass_s = self._pass_time(len(g.batch))
        g.busy = True
        end = self.now + pass_s
        self._push(end, _P_STEP, g.gpu_id)
        # Policies that place by pass phase hear when each pass ends (exactly: a live worker's
        # heartbeat carries it).
        self.pool.note_pass(g.gpu_id, end)

    def _heartbeats(self) -> None:
        """Every worker's heartbeat, once a tick: its step budget in force and the sessions
        parked in its host memory, as a live worker reports them."""
        for gpu_id in list(self.pool.workers):  # the ready ones not given back
            g = self.gpus[gpu_id]
            seen = WorkerSeen(
                g.gpu_id,
                WorkerPhase.DRAINING if g.draining else WorkerPhase.READY,
                self.now,
                parked=self.parked.get(g.gpu_id, 0),
                steps=g.steps or self._full_steps,
                full_steps=self._full_steps,
                min_steps=1,
            )
            self.pool.hear(seen, self.now)
            decisions = self.pool.decide(WorkerHeard(self.now, seen))
            if decisions:
                self._apply(decisions)

    def _wake(self, gpu_id: str) -> None:
        g = self.gpus.get(gpu_id)
        if g is None or g.wake_at > self.now + _EPS_S:
            return  # superseded by an earlier wake-up that rescheduled
        g.wake_at = math.inf
        if not g.busy:
            self._start_step(g)

    def _start_copy(self, sid: str, s: _Session) -> None:
        """Start a pending state copy unless a chunk of the session is still in flight (then
        ``_end_step`` starts it at that chunk's end)."""
        if s.in_flight is not None or s.pending_copy_ms <= 0:
            return
        s.ready_at = self.now + s.pending_copy_ms / 1000.0
        s.pending_copy_ms = 0.0
        self._push(s.ready_at, _P_COPY, sid)

    def _copy_done(self, sid: str) -> None:
        s = self.sessions.get(sid)
        if s is None or s.gpu is None or s.ready_at > self.now:
            return  # departed, suspended, or a later copy superseded this one
        g = self.gpus[s.gpu]
        if not g.busy:
            self._start_step(g)

    def _end_step(self, gpu_id: str) -> None:
        """End of one pass on ``gpu_id``: sessions that went idle or departed leave the batch
        (their chunk is void), sessions whose last pass this was get their chunk, then the next
        pass admits whoever is ready."""
        g = self.gpus[gpu_id]
        now = self.now
        sessions = self.sessions
        batch = g.batch
        k = g.pass_no
        g.pass_no = k + 1
        wake: set[str] = set()
        if g.leaving:
            for sid in sorted(g.leaving):
                entry = batch.get(sid)
                s = sessions.get(sid)
                if entry is None or (s is not None and s.active and s.epoch == entry[0]):
                    continue  # completed already, or not void after all
                del batch[sid]
                if s is None:
                    continue  # departed mid-chunk: nobody receives it
                s.in_flight = None
                if s.pending_copy_ms > 0:
                    self._start_copy(sid, s)
                elif s.active and s.gpu is not None and s.gpu != gpu_id:
                    wake.add(s.gpu)  # resumed elsewhere while its void chunk ran
            g.leaving.clear()
        for sid in g.done_at.pop(k, ()):
            entry = batch.get(sid)
            if entry is None or entry[1] != k:
                continue  # left the batch (void chunk) before completing
            del batch[sid]
            s = sessions.get(sid)
            if s is None:
                continue
            s.in_flight = None
            if s.active and s.epoch == entry[0]:  # not for a session that went idle meanwhile
                self._delivered(s, gpu_id, entry[2])
            if s.pending_copy_ms > 0:
                self._start_copy(sid, s)  # moved while this chunk ran: the copy starts now
            elif s.active and s.gpu is not None and s.gpu != gpu_id:
                wake.add(s.gpu)  # resumed elsewhere while its void chunk ran
        g.busy = False
        if g.release_pending:
            if batch:
                self._run_pass(g)  # chunks of sessions moved away finish before the release
            else:
                g.release_pending = False
                g.released_at = now
                self.held -= 1
                self._mark()
        else:
            self._start_step(g)
        for other in sorted(wake):
            og = self.gpus[other]
            if not og.busy:
                self._start_step(og)

    def _delivered(self, s: _Session, gpu_id: str, steps: int) -> None:
        """A chunk of ``s`` that ran ``steps`` denoising steps is done now: count it, move its
        playback clock."""
        now = self.now
        latency = (now - s.due) * 1000.0
        startup = (now - s.spell_start) * 1000.0 if s.first else None
        missed = self.ledger.delivered(latency, startup)
        reduced = steps < self._full_steps
        self.reduced += reduced
        if missed:
            self.late += 1
        elif reduced:
            self.on_time_reduced += 1
        else:
            self.on_time_full += 1
        latency = max(0.0, latency)
        if self.keep_chunk_times:
            self.chunk_times.append(now)
            self.first_flags.append(s.first)
            self.chunk_missed.append(missed)
        if s.first:
            self.first_latencies.append(latency)
            s.first = False
        else:
            self.stream_latencies.append(latency)
        if s.migrated_to == gpu_id:
            s.migrated_to = None
            self.after_migration += 1
            self.late_after_migration += missed > 0
        s.due = max(s.due, now) + self.period_s if self.period_s > 0 else now

    # ---- accounting -----------------------------------------------------------------------

    def _mark(self) -> None:
        last = self.timeline[-1]
        point = (self.now, self.held, self.n_active)
        if last[1:] != point[1:]:
            if last[0] == self.now:
                self.timeline[-1] = point
            else:
                self.timeline.append(point)

    def _account_unserved(self, end: float) -> None:
        """At the end of the trace, every active session's spell ends (see ``_spell_ended``)."""
        for sid in sorted(self.sessions):
            s = self.sessions[sid]
            if s.active:
                self._spell_ended(s, end)

    def _spell_ended(self, s: _Session, t: float) -> None:
        """``s`` stops being active at ``t`` (idle, departure, end of trace): if its next chunk
        was already overdue (waiting for a GPU, for its turn, or in flight and now void), the
        periods it missed count (``ServiceLedger.spell_ended``)."""
        if s.first:
            overdue_ms = (t - s.spell_start) * 1000.0
        else:
            overdue_ms = (t - s.due) * 1000.0
        missed = self.ledger.spell_ended(overdue_ms, s.first)
        if missed and self.keep_chunk_times:
            self.missed_at.append((t, missed))

    def _cost_gpu_seconds(self, end: float) -> float:
        total = 0.0
        for g in self.gpus.values():
            stop = g.released_at if g.released_at is not None else end
            total += max(0.0, min(stop, end) - g.requested_at)
        return total

    def _result(self, wall_s: float) -> SimResult:
        end = self.trace.duration
        gpu_s = self._cost_gpu_seconds(end)
        ledger = self.ledger
        return SimResult(
            policy=self.policy.name,
            trace=self.trace.name,
            duration_s=end,
            cost_gpu_seconds=gpu_s,
            cost_usd=gpu_s / 3600.0 * self.price,
            latencies_ms=ledger.latencies_ms,
            first_chunk_latencies_ms=self.first_latencies,
            stream_latencies_ms=self.stream_latencies,
            deadline_ms=self.profile.deadline_ms,
            migrations=self.migrations,
            scale_events=self.scale_out + self.scale_in,
            peak_gpus=self.peak,
            decision_times_ms=self.decision_ms,
            timeline=self.timeline,
            wall_s=wall_s,
            chunk_times_s=self.chunk_times,
            chunks_after_migration=self.after_migration,
            late_chunks_after_migration=self.late_after_migration,
            first_flags=self.first_flags,
            chunk_missed=self.chunk_missed,
            missed_at=self.missed_at,
            unserved_chunks=ledger.overdue_spells,
            on_time_chunks=ledger.on_time,
            missed_periods=ledger.missed_periods,
            missed_periods_at_start=ledger.missed_at_start,
            startups_ms=ledger.startups_ms,
            scale_out_events=self.scale_out,
            scale_in_events=self.scale_in,
            sessions=self.trace.sessions,
            chunk_period_s=self.period_s,
            on_time_full=self.on_time_full,
            on_time_reduced=self.on_time_reduced,
            late=self.late,
            reduced_chunks=self.reduced,
        )


def _initial_gpus(policy: Policy) -> list[tuple[str, bool]]:
    """(gpu_id, ready) for the GPUs in a fresh policy's view: static pools and
    ``initial_gpus``. A BOOTING one boots like any requested GPU; the others are ready at
    t=0."""
    gpus = policy.view.gpus
    return [(gpu_id, gpus[gpu_id] is not GpuState.BOOTING) for gpu_id in sorted(gpus)]


WARM_START_RHO = FALLBACK_RHO_HAT  # the paper's example target utilisation, 0.7
WARM_START_MIN_WINDOW_S = 10.0


def warm_start_gpus(trace: Trace, capacity: int, boot_delay_s: float) -> int:
    """The pool an autoscaler starts a warm trace with: enough GPUs for the most sessions
    active during the first boot delay (at least the first 10 s) at utilisation 0.7.

    Why: the traces start warm (their initial population arrives in the first seconds, as
    if the service had been running) and the static pools they are compared with are all
    READY at t=0. An autoscaler started from one GPU would instead spend its first boot delay
    with most sessions waiting: a cold start, which is a different experiment (``sim run
    --cold-start``)."""
    window = max(boot_delay_s, WARM_START_MIN_WINDOW_S)
    return warm_pool(trace.initial_active(window), capacity)


def warm_pool(initial_active: int, capacity: int) -> int:
    """GPUs for ``initial_active`` sessions at utilisation ``WARM_START_RHO`` (at least one)."""
    return max(1, math.ceil(initial_active / (capacity * WARM_START_RHO) - 1e-9))


def simulate(
    trace: Trace | str,
    policy: str | Policy,
    profile: LatencyProfile | str | None = None,
    *,
    boot_delay_s: float = 30.0,
    tick_s: float = 1.0,
    price_usd_per_gpu_hour: float | None = None,
    progress: Callable[[float], None] | None = None,
    keep_chunk_times: bool = False,
    resume_ms: float = 0.0,
    warm_start: bool = True,
    chunk_period_s: float | None = None,
    lead_s: float | None = None,
    parked_on_gpu: bool = False,
    **params: Any,
) -> SimResult:
    """Run ``policy`` (a name of ``lab.sim.policies.POLICIES``, or a :class:`Policy`) over
    ``trace`` (a Trace, a built-in trace name or a path). ``params`` are the policy's loose parameters
    (``Policies.config``); a policy that takes them also gets ``boot_delay_s``, so that
    it knows what the environment does, and, unless the caller names ``gpus`` or
    ``initial_gpus`` or passes ``warm_start=False``, a warm pool (:func:`warm_start_gpus`) as
    ``initial_gpus``.

    This is the entry point for sweeps: ``simulate("bursty", "turboserve", rho_hat=0.6)``.
    ``profile``: a :class:`LatencyProfile`, a shipped name or a path (None: the default).
    A policy built by name that takes a ``rho_table`` gets the shipped table unless the
    caller gives one (``rho_table=None``: none, the fixed rho_hat)."""
    from lab.sim.catalog import load_trace

    if not isinstance(trace, Trace):
        trace = load_trace(trace)
    profile = resolve_profile(profile)
    extra: dict[str, Any] = {}
    if isinstance(policy, str):
        if warm_start and "gpus" not in params and "initial_gpus" not in params:
            extra["initial_gpus"] = warm_start_gpus(trace, profile.capacity, boot_delay_s)
        policy_obj, taken = _build_policy(
            policy,
            profile,
            {"boot_delay_s": boot_delay_s, **_shipped_table(params, profile), **extra, **params},
            optional=("boot_delay_s", "rho_table", *extra),
        )
        extra = {k: v for k, v in extra.items() if k in taken}
    else:
        policy_obj = policy
    sim = Simulator(
        trace,
        policy_obj,
        profile,
        boot_delay_s=boot_delay_s,
        tick_s=tick_s,
        price_usd_per_gpu_hour=price_usd_per_gpu_hour,
        progress=progress,
        keep_chunk_times=keep_chunk_times,
        resume_ms=resume_ms,
        chunk_period_s=chunk_period_s,
        lead_s=lead_s,
        parked_on_gpu=parked_on_gpu,
    )
    result = sim.run()
    result.params = {
        "boot_delay_s": boot_delay_s,
        "tick_s": tick_s,
        "profile": profile.name,
        "resume_ms": resume_ms,
        **({"parked_on_gpu": True} if parked_on_gpu else {}),
        "chunk_period_s": sim.period_s,
        "lead_s": sim.lead_s,
        **{k: v for k, v in {**extra, **params}.items() if _jsonable(v)},
    }
    return result


def make_policy(
    name: str,
    profile: LatencyProfile | str | None,
    *,
    boot_delay_s: float,
    optional: tuple[str, ...] = ("boot_delay_s",),
    **params: Any,
) -> Policy:
    """Build a policy of ``POLICIES``, telling it the environment's boot delay and giving it the
    shipped rho_hat table unless ``params`` name one. Keys in ``optional`` were added by the
    environment, not the caller: a policy that does not take one is built without it."""
    resolved = resolve_profile(profile)
    return _build_policy(
        name,
        resolved,
        {"boot_delay_s": boot_delay_s, **_shipped_table(params, resolved), **params},
        (*optional, "rho_table"),
    )[0]


def resolve_profile(profile: LatencyProfile | str | None) -> LatencyProfile:
    """A :class:`LatencyProfile` from a profile, a shipped name, a path or None (default)."""
    if isinstance(profile, LatencyProfile):
        return profile
    return load_profile() if profile is None else load_profile(profile)


def _shipped_table(params: dict[str, Any], profile: LatencyProfile) -> dict[str, Any]:
    """``{"rho_table": the shipped table for this profile}`` unless ``params`` name a table (or
    there is none)."""
    from services.scheduler.shipped import DEFAULT_TABLE_PATH, load_rho_table, table_path_for

    if "rho_table" in params:
        return {}
    path = table_path_for(profile.name)
    table = load_rho_table(None if path == DEFAULT_TABLE_PATH else path)
    return {} if table is None else {"rho_table": table}


def _build_policy(
    name: str, profile: LatencyProfile, params: dict[str, Any], optional: tuple[str, ...]
) -> tuple[Policy, dict[str, Any]]:
    """(policy, the parameters it was built with), leaving out the ``optional`` ones the
    policy does not take. An unknown name, a parameter it does not take or a value out of
    range is a :class:`PolicyError`."""
    try:
        spec = POLICIES[name]
        taken = {k: v for k, v in params.items() if k in spec.params or k not in optional}
        return POLICIES.build(name, profile, spec.config(taken)), taken
    except KeyError as exc:
        raise PolicyError(exc.args[0]) from None
    except (TypeError, ValueError) as exc:
        raise PolicyError(str(exc)) from exc


def _jsonable(v: Any) -> bool:
    return v is None or isinstance(v, bool | int | float | str)
