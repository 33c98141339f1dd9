"""The live scheduler's book of its pool: which workers it knows, when each was last heard,
which GPUs it asked for and waits on, and which it gave back that still run.

Pure bookkeeping: no asyncio, no NATS, no Redis; every question that depends on time takes
``now`` (seconds, the wall clock the heartbeats carry). The live scheduler asks it what to do
(who fell silent, whose boot took too long, which release to try again) and does it.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from shared.wire import Heartbeat, WorkerStatus

if TYPE_CHECKING:
    from shared.registry import WorkerRecord

# How often one release asks the provisioner to stop a worker that still looks busy to it
# (its heartbeat lagging the last migration off it) before the release counts as failed.
RELEASE_STOP_ATTEMPTS = 10
# A release that did not go through (a session still there, a refused stop) is tried again
# after a pause that starts at a few ticks (at least this) and doubles up to the maximum.
RELEASE_RETRY_MIN_S = 1.0
RELEASE_RETRY_MAX_S = 60.0
RELEASE_RETRY_TICKS = 4


@dataclass
class KnownWorker:
    """A worker the core knows as a GPU (ready or draining)."""

    kind: str
    seen_at: float  # when it joined or was last heard


class PendingRelease(NamedTuple):
    """A GPU the core gave back whose worker has not stopped yet."""

    due: float  # when to try again (inf: the first attempt is under way)
    attempts: int  # attempts that did not go through


class PoolLedger:
    """What the live scheduler knows of its workers, beyond the core's view of them as GPUs."""

    def __init__(self, worker_timeout_s: float, boot_timeout_s: float, tick_s: float) -> None:
        self.worker_timeout_s = worker_timeout_s
        self.boot_timeout_s = boot_timeout_s
        self.tick_s = tick_s
        self.workers: dict[str, KnownWorker] = {}  # GPUs the core knows (ready or draining)
        self.beats: dict[str, Heartbeat] = {}  # latest heartbeat of every worker heard
        self.heard: dict[str, float] = {}  # when each worker's last NATS heartbeat came
        self.booting: dict[str, float] = {}  # requested GPU id -> when
        self.our_drains: set[str] = set()  # drains this scheduler decided (not an operator)
        self.unreleased: dict[str, PendingRelease] = {}
        # The quality budget: the step count the core set for each GPU (absent: full steps),
        # the GPUs with a STEPS command under way, and when each GPU's last one was answered.
        self.steps_wanted: dict[str, int] = {}
        self.steps_sending: set[str] = set()
        self.steps_answered: dict[str, float] = {}

    # -- workers --------------------------------------------------------------------------------
    def knows(self, wid: str | None) -> bool:
        return wid is not None and wid in self.workers

    def hear(self, beat: Heartbeat, now: float) -> bool:
        """Record a heartbeat heard on NATS; whether its worker is one the core knows."""
        self.beats[beat.worker_id] = beat
        self.heard[beat.worker_id] = now
        known = self.workers.get(beat.worker_id)
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
        self.beats.pop(wid, None)
        self.our_drains.discard(wid)
        self.unreleased.pop(wid, None)
        self.steps_wanted.pop(wid, None)
        self.steps_answered.pop(wid, None)
        return was_known or was_booting

    def silent(self, now: float) -> list[str]:
        """Known workers not heard from for longer than the worker timeout."""
        out = []
        for wid, worker in self.workers.items():
            beat = self.beats.get(wid)
            last = max(worker.seen_at, beat.at) if beat is not None else worker.seen_at
            if now - last > self.worker_timeout_s:
                out.append(wid)
        return out

    def heard_lately(self, wid: str, now: float) -> bool:
        """Whether a heartbeat of ``wid`` came on NATS within the worker timeout."""
        return now - self.heard.get(wid, 0.0) < self.worker_timeout_s

    def expired(self, records: Mapping[str, WorkerRecord], now: float) -> list[str]:
        """Known workers gone from the registry (or no longer alive there) and silent on NATS
        too. A worker heard on NATS whose record is missing is one Redis lost: it writes it
        back at its next beat."""
        out = []
        for wid in self.workers:
            record = records.get(wid)
            if (record is None or not record.alive) and not self.heard_lately(wid, now):
                out.append(wid)
        return out

    def lost_records(self, records: Mapping[str, WorkerRecord], now: float) -> list[str]:
        """Registry records of workers silent beyond the timeout that the core never had (or
        no longer has): workers that died while no scheduler led, or before they were ready.
        They are to be shown lost, then forgotten."""
        out = []
        for wid, record in records.items():
            if (
                wid not in self.workers
                and not record.alive
                and record.status is not WorkerStatus.LOST
                and now - max(record.updated_at, self.heard.get(wid, 0.0)) > self.worker_timeout_s
            ):
                out.append(wid)
        return out

    def joining(self, records: Mapping[str, WorkerRecord]) -> list[tuple[str, str]]:
        """Ready workers in the registry that the core does not know, as (id, kind): a
        heartbeat missed on NATS is still in Redis. Their record stands in for a heartbeat
        until one is heard."""
        out = []
        for wid, record in records.items():
            if wid in self.workers or not record.alive or record.status is not WorkerStatus.READY:
                continue
            if wid not in self.beats:
                self.beats[wid] = Heartbeat(
                    worker_id=wid,
                    status=record.status,
                    capacity=record.capacity,
                    active=record.active,
                    sessions=list(record.sessions),
                    device=record.device,
                    chunk_ms=dict(record.chunk_ms),
                    gpu_kind=record.gpu_kind,
                    at=record.updated_at,
                )
            out.append((wid, record.gpu_kind))
        return out

    def beats_by_kind(self) -> dict[str, list[Heartbeat]]:
        """The latest heartbeats of the known workers, by their kind."""
        out: dict[str, list[Heartbeat]] = {}
        for wid, worker in self.workers.items():
            beat = self.beats.get(wid)
            if beat is not None:
                out.setdefault(worker.kind, []).append(beat)
        return out

    def parking_for(self, leaving: str, ready: Iterable[str]) -> str | None:
        """Among the ``ready`` GPUs, the known one with the fewest sessions parked in its host
        memory, for the idle sessions of one that is ``leaving``; ties go to the smaller id."""
        best: tuple[int, str] | None = None
        for gpu_id in ready:
            if gpu_id == leaving or gpu_id not in self.workers:
                continue
            beat = self.beats.get(gpu_id)
            parked = len(beat.suspended) if beat is not None else 0
            if best is None or (parked, gpu_id) < best:
                best = (parked, gpu_id)
        return None if best is None else best[1]

    # -- drains ---------------------------------------------------------------------------------
    def drain_mode(
        self, wid: str, record: WorkerRecord | None, operator_drains: Mapping[str, str]
    ) -> str | None:
        """How an operator drains ``wid`` (``hold`` or ``stop``), None when nobody does. A
        worker found draining that nobody recorded and this scheduler did not drain is an
        operator's too: held."""
        mode = operator_drains.get(wid)
        if (
            mode is None
            and record is not None
            and record.status is WorkerStatus.DRAINING
            and wid not in self.our_drains
        ):
            return "hold"
        return mode

    # -- GPUs asked for -------------------------------------------------------------------------
    def request(self, gpu_ids: Iterable[str], now: float) -> None:
        for gpu_id in gpu_ids:
            self.booting[gpu_id] = now

    def refused(self, gpu_id: str) -> bool:
        """The provisioner would not start ``gpu_id``; whether it was still awaited."""
        return self.booting.pop(gpu_id, None) is not None

    def boot_overdue(self, now: float) -> list[str]:
        """Requested GPUs not ready within the boot timeout."""
        return [g for g, since in self.booting.items() if now - since > self.boot_timeout_s]

    # -- GPUs given back ------------------------------------------------------------------------
    def release(self, gpu_id: str) -> None:
        """The core gave ``gpu_id`` back: its first release attempt starts now. It stays a
        known worker until the provisioner reports it gone."""
        self.booting.pop(gpu_id, None)
        self.unreleased[gpu_id] = PendingRelease(math.inf, 0)

    def release_unwanted(self, gpu_id: str) -> None:
        """A worker came up that the core does not take (given back while it booted): it is to
        be released, unless that is under way already."""
        self.unreleased.setdefault(gpu_id, PendingRelease(0.0, 0))

    def released(self, gpu_id: str) -> None:
        """The provisioner took the stop of ``gpu_id``."""
        self.unreleased.pop(gpu_id, None)
        self.our_drains.discard(gpu_id)

    def kept(self, gpu_id: str) -> None:
        """The provisioner refused the stop of ``gpu_id`` for good (its floor): it is no
        longer to be released."""
        self.unreleased.pop(gpu_id, None)

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

    def releases_due(
        self, now: float, held: Collection[str], in_flight: Collection[str]
    ) -> list[str]:
        """The releases to try again now. One whose worker is gone (or not up: it is given back
        if it comes), or that the core ``held`` again (a failed evacuation), is no longer a
        release to finish and is forgotten, unless an attempt is ``in_flight``."""
        due = []
        for gpu_id, pending in list(self.unreleased.items()):
            if gpu_id not in self.workers or gpu_id in held:
                if gpu_id not in in_flight:
                    del self.unreleased[gpu_id]
            elif pending.due <= now:
                due.append(gpu_id)
        return due

    # -- the quality budget ---------------------------------------------------------------------
    def want_steps(self, gpu_id: str, steps: int) -> None:
        """The core set ``gpu_id``'s step budget (a ``SetSteps``); a STEPS command follows."""
        self.steps_wanted[gpu_id] = steps
        self.steps_sending.add(gpu_id)

    def steps_sent(self, gpu_id: str, now: float) -> None:
        """A STEPS command to ``gpu_id`` was answered (or given up)."""
        self.steps_sending.discard(gpu_id)
        self.steps_answered[gpu_id] = now

    def steps_to_resend(self, beat: Heartbeat) -> int | None:
        """The step budget to send ``beat``'s worker again, or None when it runs the one the
        core set (its full count when the core set none). A worker that restarted, or a STEPS
        command that was lost, shows in its heartbeat; one sent after the beat was taken does
        not count against it, and the worker's own floor and full count bound what it can run.
        A worker that does not report steps (``full_steps`` 0) is never sent any."""
        wid = beat.worker_id
        if beat.full_steps <= 0 or wid not in self.workers or wid in self.steps_sending:
            return None
        if beat.at <= self.steps_answered.get(wid, -math.inf):
            return None
        wanted = self.steps_wanted.get(wid, beat.full_steps)
        runnable = min(beat.full_steps, max(beat.min_steps, wanted))
        if beat.steps == runnable:
            return None
        self.steps_sending.add(wid)
        return wanted
