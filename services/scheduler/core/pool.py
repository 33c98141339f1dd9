"""The pool as the core keeps it for a live scheduler (and the simulator): the policy, and the
books of the workers behind its GPUs; every decision the shell around it carries out.

A policy (``Policy.step``) decides placement, moves and scaling from its view of GPUs and
sessions. A real pool has more to decide, and :class:`Pool` decides it, from typed facts the
shell reports (what a worker says of itself, what the registry holds of a session, how a
command ended), so that the simulator, which drives the same :class:`Pool`, exercises it too:

* **resume or assign** (:meth:`Pool.place`): what an ``Assign`` or a ``Resume`` becomes once the
  registry's record of the session is read (:class:`SessionSeen`): a claim, a resume where its
  state is parked, a move of that state first, or an event that repairs the view;
* **parking** (:meth:`Pool.parking_for`): the worker that takes the idle sessions parked on a
  GPU being given back;
* **releasing a GPU the core does not know** (:class:`WorkerJoined` -> :class:`ReleaseUnknown`):
  a worker that came up after the core gave it back (or gave up on it) is stopped;
* **re-sending step budgets** (:class:`WorkerHeard` -> ``SetSteps``): a worker whose heartbeat
  shows another budget than the core set (restarted, or a STEPS command lost) is sent it again;
* **the books**: the workers known and when last heard, GPUs asked for and booting (with their
  boot timeout), GPUs given back that still run (with the retry pause of their release), the
  drains this scheduler decided, the step budget set per GPU, and the sessions with a
  migration in flight.

Pure: no asyncio, no I/O; every question that depends on time takes ``now`` (seconds, the
clock of the facts: the wall clock heartbeats carry, live; the simulated clock, offline).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from services.scheduler.core.cluster import ClusterView
from services.scheduler.core.policies import Policy
from services.scheduler.core.types import (
    Decision,
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

# How often one release asks the provisioner to stop a worker that still looks busy to it
# (its heartbeat lagging the last migration off it) before the release counts as failed.
RELEASE_STOP_ATTEMPTS = 10
# A release that did not go through (a session still there, a refused stop) is tried again
# after a pause that starts at a few ticks (at least this) and doubles up to the maximum.
RELEASE_RETRY_MIN_S = 1.0
RELEASE_RETRY_MAX_S = 60.0
RELEASE_RETRY_TICKS = 4


class WorkerPhase(enum.StrEnum):
    """A worker's status as it reports it (the wire's ``WorkerStatus``, by value)."""

    BOOTING = "booting"
    READY = "ready"
    DRAINING = "draining"
    GONE = "gone"
    LOST = "lost"  # only in the registry: a scheduler declared it lost


@dataclass(frozen=True, slots=True)
class WorkerSeen:
    """What a worker says of itself: its heartbeat, or its record in the registry.

    ``at``: when it said it (its clock); ``alive``: False for a registry record that expired;
    ``parked``: how many idle sessions it holds in host memory; ``steps``, ``full_steps``,
    ``min_steps``: the quality budget in force, the model's full count and the operator's
    floor (``full_steps`` 0: it does not report steps); ``pass_ends_at``: when its pass in
    flight ends (None: not timed yet)."""

    worker_id: str
    status: WorkerPhase
    at: float
    kind: str = "cpu"
    alive: bool = True
    parked: int = 0
    steps: int = 0
    full_steps: int = 0
    min_steps: int = 0
    pass_ends_at: float | None = None


@dataclass
class KnownWorker:
    """A worker the core knows as a GPU (ready or draining)."""

    kind: str
    seen_at: float  # when it joined or was last heard


class PendingRelease(NamedTuple):
    """A GPU the core gave back whose worker has not stopped yet."""

    due: float  # when to try again (inf: the first attempt is under way)
    attempts: int  # attempts that did not go through


# ---- the facts the shell reports ------------------------------------------------------------


class Found(enum.StrEnum):
    """What the registry holds of a session (GONE: no record, or it terminated)."""

    GONE = "gone"
    PENDING = "pending"
    EXECUTING = "executing"
    SUSPENDED = "suspended"
    MIGRATING = "migrating"


@dataclass(frozen=True, slots=True)
class SessionSeen:
    """The registry's record of a session that a decision is to put on ``gpu_id``: its state,
    its owner (the worker that runs or parks it) and its epoch."""

    session_id: str
    gpu_id: str
    state: Found
    owner: str | None = None
    epoch: int = 0


@dataclass(frozen=True, slots=True)
class WorkerJoined:
    """A worker ready to take sessions that the books did not know (:meth:`Pool.join` took
    it in): the core's ``GPU_READY``, and a release if the core does not take it. ``kind``:
    the kind it says it is (None: the kind the core asked for)."""

    t: float
    gpu_id: str
    kind: str | None


@dataclass(frozen=True, slots=True)
class WorkerHeard:
    """A heartbeat of a known worker: its pass boundary and its step budget."""

    t: float
    seen: WorkerSeen


@dataclass(frozen=True, slots=True)
class GpuRefused:
    """The provisioner would not start ``gpu_id`` (asked for by a ``RequestGpus``)."""

    t: float
    gpu_id: str


@dataclass(frozen=True, slots=True)
class ParkedStateMoved:
    """An idle session's parked state moved to ``dst`` for a resume there (``ok``), or did not."""

    t: float
    session_id: str
    dst: str
    ok: bool


@dataclass(frozen=True, slots=True)
class MoveEnded:
    """The migration in flight of a session the core has suspended meanwhile ended: the
    registry names ``owner`` (``executing``: it runs there)."""

    t: float
    session_id: str
    owner: str | None
    executing: bool


@dataclass(frozen=True, slots=True)
class HandedBack:
    """Sessions the registry has pending (read every few ticks): a worker that found no free
    slot for an assignment hands it back that way."""

    t: float
    session_ids: tuple[str, ...]


Fact = WorkerJoined | WorkerHeard | GpuRefused | ParkedStateMoved | MoveEnded | HandedBack
Input = Event | Fact


# ---- what the pool decides beyond the policy -------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReleaseUnknown:
    """Stop the worker ``gpu_id`` that came up while the core does not hold it."""

    gpu_id: str


@dataclass(frozen=True, slots=True)
class CheckHandedBack:
    """If the registry still has ``session_id`` pending, its worker (``gpu_id``, where the
    core has it) handed it back: report ``PLACEMENT_FAILED``. Checked where the decisions are
    carried out, so that an assignment decided just before has claimed it already."""

    session_id: str
    gpu_id: str


Command = Decision | ReleaseUnknown | CheckHandedBack


@dataclass(frozen=True, slots=True)
class Claim:
    """Claim ``session_id`` for ``gpu_id`` at ``epoch`` and assign it; ``requeue``: put it back to
    pending first (its worker is gone)."""

    session_id: str
    gpu_id: str
    epoch: int
    requeue: bool = False


@dataclass(frozen=True, slots=True)
class ResumeThere:
    """Resume ``session_id`` on ``gpu_id``, whose host memory holds its state."""

    session_id: str
    gpu_id: str
    epoch: int


@dataclass(frozen=True, slots=True)
class MoveThenResume:
    """Move ``session_id``'s parked state from ``src`` to ``dst``, then resume it there."""

    session_id: str
    src: str
    dst: str


Placement = Claim | ResumeThere | MoveThenResume | Event


class Pool:
    """A policy and the books of its workers: one per leadership (live) or per run (offline)."""

    def __init__(
        self, policy: Policy, worker_timeout_s: float, boot_timeout_s: float, tick_s: float
    ) -> None:
        self.policy = policy
        self.worker_timeout_s = worker_timeout_s
        self.boot_timeout_s = boot_timeout_s
        self.tick_s = tick_s
        self.workers: dict[str, KnownWorker] = {}  # GPUs the core knows (ready or draining)
        self.seen: dict[str, WorkerSeen] = {}  # what every worker heard last said
        self.heard: dict[str, float] = {}  # when each worker's last heartbeat came
        self.booting: dict[str, float] = {}  # requested GPU id -> when
        self.our_drains: set[str] = set()  # drains this scheduler decided (not an operator)
        self.unreleased: dict[str, PendingRelease] = {}
        # The quality budget: the step count the core set for each GPU (absent: full steps),
        # the GPUs with a STEPS command under way, and when each GPU's last one was answered.
        self.steps_wanted: dict[str, int] = {}
        self.steps_sending: set[str] = set()
        self.steps_answered: dict[str, float] = {}
        # Sessions with a Migrate in flight -> how many: the core has them on the destination
        # already, while the registry names the source until the commit.
        self.moving: dict[str, int] = {}

    @property
    def view(self) -> ClusterView:
        return self.policy.view

    # -- one step -------------------------------------------------------------------------------
    def decide(self, fact: Input) -> list[Command]:
        """The decisions ``fact`` calls for, booked as they are made."""
        if isinstance(fact, Event):
            return list(self._step(fact))
        if isinstance(fact, WorkerHeard):
            return self._heard(fact.seen)
        if isinstance(fact, WorkerJoined):
            out: list[Command] = list(
                self._step(
                    Event(fact.t, EventKind.GPU_READY, gpu_id=fact.gpu_id, gpu_kind=fact.kind)
                )
            )
            released = any(isinstance(d, Release) and d.gpu_id == fact.gpu_id for d in out)
            if self.knows(fact.gpu_id) and fact.gpu_id not in self.view.gpus and not released:
                # One the core gave back (or gave up on) while it booted, which came up all
                # the same: stopped rather than paid for unused (unless the policy gives it
                # back in this very step).
                self.unreleased.setdefault(fact.gpu_id, PendingRelease(0.0, 0))
                out.append(ReleaseUnknown(fact.gpu_id))
            return out
        if isinstance(fact, GpuRefused):
            if self.booting.pop(fact.gpu_id, None) is None:
                return []
            return list(self._step(Event(fact.t, EventKind.GPU_GONE, gpu_id=fact.gpu_id)))
        if isinstance(fact, ParkedStateMoved):
            if not fact.ok:
                event = Event(fact.t, EventKind.PLACEMENT_FAILED, fact.session_id, fact.dst)
                return list(self._step(event))
            # Idle again while its state moved: it stays suspended where it is.
            return [] if self.view.is_idle(fact.session_id) else [Resume(fact.session_id, fact.dst)]
        if isinstance(fact, MoveEnded):
            # The core moved it when it decided; the registry named the source until the
            # handoff committed. It is suspended where it landed unless active again.
            if self.view.is_idle(fact.session_id) and fact.executing and self.knows(fact.owner):
                assert fact.owner is not None
                return [Suspend(fact.session_id, fact.owner)]
            return []
        return self._handed_back(fact)

    def _step(self, event: Event) -> list[Decision]:
        decisions = self.policy.step(event)
        for d in decisions:
            if isinstance(d, RequestGpus):
                for gpu_id in d.gpu_ids:
                    self.booting[gpu_id] = event.t
            elif isinstance(d, Drain):
                self.our_drains.add(d.gpu_id)
            elif isinstance(d, Release):
                # Its first release attempt starts now; it stays a known worker until the
                # pool reports it gone.
                self.booting.pop(d.gpu_id, None)
                self.unreleased[d.gpu_id] = PendingRelease(math.inf, 0)
            elif isinstance(d, SetSteps):
                self.want_steps(d.gpu_id, d.steps)
            elif isinstance(d, Migrate):
                self.moving[d.session_id] = self.moving.get(d.session_id, 0) + 1
        return decisions

    def _handed_back(self, fact: HandedBack) -> list[Command]:
        out: list[Command] = []
        for sid in fact.session_ids:
            gpu = self.view.gpu_of(sid)
            if gpu is not None and sid not in self.moving:
                out.append(CheckHandedBack(sid, gpu))
        return out

    # -- resume or assign -----------------------------------------------------------------------
    def place(self, seen: SessionSeen, resume: bool, t: float) -> Placement | None:
        """What an ``Assign`` (``resume`` False) or a ``Resume`` of ``seen.session_id`` onto
        ``seen.gpu_id`` becomes, by the registry's record: None when it is there already."""
        sid, gpu, owner = seen.session_id, seen.gpu_id, seen.owner
        if seen.state is Found.GONE:
            return Event(t, EventKind.DEPART, session_id=sid)
        parked_on_known = seen.state is Found.SUSPENDED and self.knows(owner)
        if resume or parked_on_known:
            if seen.state is Found.EXECUTING and owner == gpu:
                return None
            if parked_on_known:
                assert owner is not None
                if owner == gpu:
                    return ResumeThere(sid, gpu, seen.epoch)
                return MoveThenResume(sid, owner, gpu)  # parked on another worker: moved first
            if seen.state is Found.MIGRATING:
                return Event(t, EventKind.PLACEMENT_FAILED, session_id=sid, gpu_id=gpu)
            # Its state is gone (its worker says so): placed anew.
        if seen.state is Found.PENDING:
            return Claim(sid, gpu, seen.epoch)
        if owner == gpu and seen.state is Found.EXECUTING:
            return None  # already there
        if self.knows(owner):
            # The core's view was behind: the session runs elsewhere. Repair the view.
            return Event(t, EventKind.MIGRATION_FAILED, session_id=sid, gpu_id=owner)
        return Claim(sid, gpu, seen.epoch, requeue=True)

    # -- repairing the view from the registry ---------------------------------------------------
    def unheard(self, sids: Iterable[str]) -> list[str]:
        """The sessions of ``sids`` the core never heard of (a lost event, or written back
        after Redis restarted empty), in their order: they are to arrive."""
        view = self.view
        known = set(view.placement) | set(view.pending) | set(view.idle_sessions)
        return [sid for sid in sids if sid not in known]

    def misplaced(self, placement: Mapping[str, str]) -> list[tuple[str, str]]:
        """Sessions the registry's ``placement`` has on another known worker than the core, as
        (session, that worker): where they run, unless a migration of theirs is in flight (the
        core moved it when it decided, the registry follows at the commit, and the migration's
        own outcome corrects the core if it fails: taking it back now would have the core move
        it, or others, again and then back)."""
        out = []
        for sid, gpu in self.view.placement.items():
            registered = placement.get(sid)
            if sid in self.moving or registered is None or registered == gpu:
                continue
            if self.knows(registered):
                out.append((sid, registered))
        return out

    def unlisted(
        self, placement: Mapping[str, str], holding: Mapping[str, Collection[str]]
    ) -> list[tuple[str, str]]:
        """Sessions the registry's ``placement`` has on a known worker whose last heartbeat
        leaves them out (``holding``: the sessions each worker heard from says it has), as
        (session, worker): each is lost to its worker if :meth:`lost_by_worker` says so."""
        out = []
        for sid, owner in placement.items():
            listed = holding.get(owner)
            if listed is not None and self.knows(owner) and sid not in listed:
                out.append((sid, owner))
        return out

    def lost_by_worker(self, seen: SessionSeen, updated_at: float, beat_at: float) -> bool:
        """Whether a session its worker's heartbeat leaves out is lost to it (an assignment it
        lost): the registry still has it executing there, and did so for a worker's timeout
        before that heartbeat (an assignment just claimed is not in a beat yet). It goes back
        to pending and is placed again."""
        return (
            seen.state is Found.EXECUTING
            and seen.owner == seen.gpu_id
            and self.knows(seen.owner)
            and beat_at - updated_at >= self.worker_timeout_s
        )

    # -- workers --------------------------------------------------------------------------------
    def knows(self, wid: str | None) -> bool:
        return wid is not None and wid in self.workers

    def hear(self, seen: WorkerSeen, now: float) -> bool:
        """Record a heartbeat; whether its worker is one the core knows."""
        self.seen[seen.worker_id] = seen
        self.heard[seen.worker_id] = now
        known = self.workers.get(seen.worker_id)
        if known is None:
            return False
        known.seen_at = now
        return True

    def join(self, wid: str, kind: str, now: float) -> bool:
        """A worker ready to take sessions; False when it is known already."""
        if wid in self.workers:
            return False
        self.booting.pop(wid, None)
        self.workers[wid] = KnownWorker(kind, now)
        # A worker that joins runs full steps, as the core holds a GPU it just heard of; a
        # budget a decision set after the worker left (a SetSteps carried out late) is stale.
        self.steps_wanted.pop(wid, None)
        self.steps_answered.pop(wid, None)
        return True

    def leave(self, wid: str) -> bool:
        """Forget a worker that is gone; whether it was known or awaited."""
        was_known = self.workers.pop(wid, None) is not None
        was_booting = self.booting.pop(wid, None) is not None
        self.seen.pop(wid, None)
        self.our_drains.discard(wid)
        self.unreleased.pop(wid, None)
        self.steps_wanted.pop(wid, None)
        self.steps_answered.pop(wid, None)
        return was_known or was_booting

    def silent(self, now: float) -> list[str]:
        """Known workers not heard from for longer than the worker timeout."""
        out = []
        for wid, worker in self.workers.items():
            seen = self.seen.get(wid)
            last = max(worker.seen_at, seen.at) if seen is not None else worker.seen_at
            if now - last > self.worker_timeout_s:
                out.append(wid)
        return out

    def heard_lately(self, wid: str, now: float) -> bool:
        """Whether a heartbeat of ``wid`` came within the worker timeout."""
        return now - self.heard.get(wid, 0.0) < self.worker_timeout_s

    def expired(self, records: Iterable[WorkerSeen], now: float) -> list[str]:
        """Known workers gone from the registry (or no longer alive there) and silent on NATS
        too. A worker heard on NATS whose record is missing is one Redis lost: it writes it
        back at its next beat."""
        alive = {r.worker_id for r in records if r.alive}
        return [w for w in self.workers if w not in alive and not self.heard_lately(w, now)]

    def lost_records(self, records: Iterable[WorkerSeen], now: float) -> list[str]:
        """Registry records of workers silent beyond the timeout that the core never had (or
        no longer has): workers that died while no scheduler led, or before they were ready.
        They are to be shown lost, then forgotten."""
        return [
            r.worker_id
            for r in records
            if r.worker_id not in self.workers
            and not r.alive
            and r.status is not WorkerPhase.LOST
            and now - max(r.at, self.heard.get(r.worker_id, 0.0)) > self.worker_timeout_s
        ]

    def joining(self, records: Iterable[WorkerSeen]) -> list[tuple[str, str]]:
        """Ready workers in the registry that the core does not know, as (id, kind): a
        heartbeat missed on NATS is still in Redis. Their record stands in for a heartbeat
        until one is heard."""
        out = []
        for r in records:
            if r.worker_id in self.workers or not r.alive or r.status is not WorkerPhase.READY:
                continue
            self.seen.setdefault(r.worker_id, r)
            out.append((r.worker_id, r.kind))
        return out

    # -- parking --------------------------------------------------------------------------------
    def parking_for(self, leaving: str) -> str | None:
        """Among the core's READY GPUs, the known one with the fewest sessions parked in its
        host memory, for the idle sessions of one that is ``leaving``; ties go to the smaller
        id."""
        best: tuple[int, str] | None = None
        for gpu_id, state in self.view.gpus.items():
            if state is not GpuState.READY or gpu_id == leaving or gpu_id not in self.workers:
                continue
            seen = self.seen.get(gpu_id)
            parked = seen.parked if seen is not None else 0
            if best is None or (parked, gpu_id) < best:
                best = (parked, gpu_id)
        return None if best is None else best[1]

    # -- drains ---------------------------------------------------------------------------------
    def drain_mode(
        self, wid: str, seen: WorkerSeen | None, operator_drains: dict[str, str]
    ) -> str | None:
        """How an operator drains ``wid`` (``hold`` or ``stop``), None when nobody does. A
        worker found draining that nobody recorded and this scheduler did not drain is an
        operator's too: held."""
        mode = operator_drains.get(wid)
        if (
            mode is None
            and seen is not None
            and seen.status is WorkerPhase.DRAINING
            and wid not in self.our_drains
        ):
            return "hold"
        return mode

    def drained_by_operator(self, seen: WorkerSeen) -> bool:
        """Whether a known worker's heartbeat shows a drain this scheduler did not decide, on
        a GPU the core still places on: an operator's, to be looked up and followed."""
        return (
            seen.status is WorkerPhase.DRAINING
            and seen.worker_id not in self.our_drains
            and self.view.state_of(seen.worker_id) is GpuState.READY
        )

    def follow_drain(self, wid: str, mode: str, t: float) -> Event | None:
        """The event an operator's drain of ``wid`` calls for now (None: followed already):
        ``stop`` drains it to be given back, ``hold`` cordons it (the operator's now, even if a
        scale-in began it)."""
        view = self.view
        state = view.state_of(wid)
        cordoned = wid in view.cordoned
        if mode == "stop" and (state is GpuState.READY or cordoned):
            self.our_drains.add(wid)  # the core gives it back once empty
            return Event(t, EventKind.GPU_DRAIN, gpu_id=wid)
        if mode == "hold" and not cordoned and state in (GpuState.READY, GpuState.DRAINING):
            self.our_drains.discard(wid)
            return Event(t, EventKind.GPU_CORDON, gpu_id=wid)
        return None

    def undrained(self, wid: str, seen: WorkerSeen | None, t: float) -> Event | None:
        """A cordoned GPU whose worker is ready again and no longer held: back in placement."""
        if wid in self.view.cordoned and seen is not None and seen.status is WorkerPhase.READY:
            return Event(t, EventKind.GPU_UNCORDON, gpu_id=wid)
        return None

    # -- GPUs asked for -------------------------------------------------------------------------
    def boot_overdue(self, now: float) -> list[str]:
        """Requested GPUs not ready within the boot timeout."""
        return [g for g, since in self.booting.items() if now - since > self.boot_timeout_s]

    # -- GPUs given back ------------------------------------------------------------------------
    def released(self, gpu_id: str) -> None:
        """The provisioner took the stop of ``gpu_id``."""
        self.unreleased.pop(gpu_id, None)
        self.our_drains.discard(gpu_id)

    def kept(self, gpu_id: str, *, operator: bool) -> None:
        """The provisioner refused the stop of ``gpu_id`` for good (its floor): it is no
        longer to be released. An operator's stop becomes the operator's hold: the drain is
        no longer this scheduler's."""
        self.unreleased.pop(gpu_id, None)
        if operator:
            self.our_drains.discard(gpu_id)

    def release_failed(self, gpu_id: str, now: float) -> float | None:
        """A release attempt that did not go through: the pause before the next one, or None
        when ``gpu_id`` is no longer to be released (gone meanwhile, or the core took it back)."""
        pending = self.unreleased.get(gpu_id)
        if pending is None:
            return None
        attempts = pending.attempts + 1
        base = max(RELEASE_RETRY_MIN_S, RELEASE_RETRY_TICKS * self.tick_s)
        pause = min(RELEASE_RETRY_MAX_S, base * 2.0 ** (attempts - 1))
        self.unreleased[gpu_id] = PendingRelease(now + pause, attempts)
        return pause

    def releases_due(self, now: float, in_flight: Collection[str]) -> list[str]:
        """The releases to try again now. One whose worker is gone (or not up: it is given back
        if it comes), or that the core holds again (a failed evacuation), is no longer a
        release to finish and is forgotten, unless an attempt is ``in_flight``."""
        due = []
        for gpu_id, pending in list(self.unreleased.items()):
            if gpu_id not in self.workers or self.view.state_of(gpu_id) is not None:
                if gpu_id not in in_flight:
                    del self.unreleased[gpu_id]
            elif pending.due <= now:
                due.append(gpu_id)
        return due

    # -- migrations -----------------------------------------------------------------------------
    def migration_ended(self, sid: str) -> None:
        """A migration of ``sid`` ended (whichever way)."""
        left = self.moving.get(sid, 0) - 1
        if left > 0:
            self.moving[sid] = left
        else:
            self.moving.pop(sid, None)

    # -- the quality budget ---------------------------------------------------------------------
    def want_steps(self, gpu_id: str, steps: int) -> None:
        """``gpu_id``'s step budget is set (a ``SetSteps``); a STEPS command follows."""
        self.steps_wanted[gpu_id] = steps
        self.steps_sending.add(gpu_id)

    def steps_sent(self, gpu_id: str, now: float) -> None:
        """A STEPS command to ``gpu_id`` was answered (or given up)."""
        self.steps_sending.discard(gpu_id)
        self.steps_answered[gpu_id] = now

    def steps_superseded(self, gpu_id: str, steps: int) -> bool:
        """Whether a STEPS command of ``steps`` is no longer what the core wants (a resend of
        the full count, with none set by the core, is)."""
        return self.steps_wanted.get(gpu_id, steps) != steps or not self.knows(gpu_id)

    def note_pass(self, wid: str, ends_at: float) -> None:
        """A known worker's pass in flight ends at ``ends_at``: the next boundary where a
        session can join its batch (the policy's ``note_pass``). Not a decision."""
        if wid in self.workers:
            self.policy.note_pass(wid, ends_at)

    def _heard(self, seen: WorkerSeen) -> list[Command]:
        wid = seen.worker_id
        if not self.knows(wid):
            return []
        if seen.pass_ends_at is not None:
            self.note_pass(wid, seen.pass_ends_at)
        steps = self.steps_to_resend(seen)
        if steps is None:
            return []
        self.want_steps(wid, steps)
        return [SetSteps(wid, steps)]

    def steps_to_resend(self, seen: WorkerSeen) -> int | None:
        """The step budget to send ``seen``'s worker again, or None when it runs the one the
        core set (its full count when the core set none). A worker that restarted, or a STEPS
        command that was lost, shows in its heartbeat; one sent after the beat was taken does
        not count against it, and the worker's own floor and full count bound what it can run.
        A worker that does not report steps (``full_steps`` 0) is never sent any."""
        wid = seen.worker_id
        if seen.full_steps <= 0 or wid not in self.workers or wid in self.steps_sending:
            return None
        if seen.at <= self.steps_answered.get(wid, -math.inf):
            return None
        wanted = self.steps_wanted.get(wid, seen.full_steps)
        runnable = min(seen.full_steps, max(seen.min_steps, wanted))
        if seen.steps == runnable:
            return None
        return wanted
