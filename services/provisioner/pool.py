"""The provisioner's book of workers and its rules, without I/O.

Every worker the provisioner manages has a :class:`Slot` in the :class:`Pool`: BOOTING from the
request on, READY from its first READY heartbeat (DRAINING while it says so), STOPPING once a
STOP was accepted, and no slot once gone. The rules for START and STOP live here, so they are
tested without processes, NATS or Redis:

- START never grows the pool past ``max_workers`` (nor past the GPUs a backend has), never
  starts an id twice (a repeat is ``unchanged``), and never takes an id another live worker
  uses (two workers with one id would both pass the epoch fencing).
- STOP never takes a worker that holds a session (the scheduler drains it first) and never
  shrinks the pool below ``min_workers``; stopping a worker that is already stopping or gone is
  ``unchanged``.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from shared.wire import WorkerStatus

# Refusal codes (stable: they travel in replies and events).
MAX_WORKERS = "max_workers"
NO_GPU = "no_gpu"
ID_IN_USE = "id_in_use"
KIND_UNAVAILABLE = "kind_unavailable"
NOT_DRAINED = "not_drained"
MIN_WORKERS = "min_workers"
SHUTTING_DOWN = "shutting_down"


class SlotState(enum.StrEnum):
    BOOTING = "booting"
    READY = "ready"
    DRAINING = "draining"
    STOPPING = "stopping"


# What a refused STOP reports as the worker's status (it is still there).
STATUS_OF = {
    SlotState.BOOTING: WorkerStatus.BOOTING,
    SlotState.READY: WorkerStatus.READY,
    SlotState.DRAINING: WorkerStatus.DRAINING,
    SlotState.STOPPING: WorkerStatus.DRAINING,
}


@dataclass
class Slot:
    worker_id: str
    requested_at: float  # wall clock: it costs from here
    state: SlotState = SlotState.BOOTING
    command_id: str = ""
    ready_at: float | None = None
    launched: bool = False  # the backend started it (after the boot delay)
    where: str = ""  # what the backend says about it: "pid 123", "pod ts-worker-..."
    # Held while the backend launches or terminates it, so a STOP waits for a launch to end.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    ready: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def live(self) -> bool:
        """Counts toward ``min_workers``: not on its way out."""
        return self.state is not SlotState.STOPPING


@dataclass(frozen=True, slots=True)
class Refusal:
    code: str
    worker_id: str = ""
    detail: str = ""


@dataclass
class Plan:
    """What one command does: ``accepted`` ids change state, ``unchanged`` ones are already as
    asked, ``refused`` ones are not touched."""

    accepted: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)


class Pool:
    def __init__(self, min_workers: int, max_workers: int, capacity: int | None = None,
                 emulated: str = "") -> None:
        self.min_workers = min_workers
        self.max_workers = max_workers
        self.capacity = capacity  # what the backend can host (local GPUs); None: no own limit
        self.emulated = emulated
        self.slots: dict[str, Slot] = {}

    @property
    def max_size(self) -> int:
        """The most workers at once: ``max_workers``, or fewer when the backend has fewer GPUs."""
        if self.capacity is None:
            return self.max_workers
        return min(self.max_workers, self.capacity)

    @property
    def size(self) -> int:
        """Workers holding a GPU (stopping ones too: the GPU is theirs until they are gone)."""
        return len(self.slots)

    @property
    def live(self) -> int:
        return sum(1 for s in self.slots.values() if s.live)

    @property
    def deficit(self) -> int:
        """Workers to start to get back to ``min_workers``."""
        return max(0, min(self.min_workers, self.max_size) - self.live)

    def get(self, worker_id: str) -> Slot | None:
        return self.slots.get(worker_id)

    def counts(self) -> dict[SlotState, int]:
        out = dict.fromkeys(SlotState, 0)
        for slot in self.slots.values():
            out[slot.state] += 1
        return out

    # -- START --------------------------------------------------------------------------------
    def start(
        self,
        worker_ids: Sequence[str],
        count: int,
        *,
        now: float,
        new_id: Callable[[], str],
        in_use: Iterable[str] = (),
        gpu_kind: str | None = None,
        command_id: str = "",
    ) -> Plan:
        """Add BOOTING slots for ``worker_ids`` (or ``count`` new ids when none is named)."""
        plan = Plan()
        if gpu_kind and self.emulated and gpu_kind.lower() != self.emulated.lower():
            detail = f"this pool emulates {self.emulated!r}, not {gpu_kind!r}"
            ids = list(dict.fromkeys(worker_ids)) or [""] * count
            plan.refused = [Refusal(KIND_UNAVAILABLE, wid, detail) for wid in ids]
            return plan
        taken = set(in_use) - set(self.slots)
        wanted = list(dict.fromkeys(worker_ids)) if worker_ids else [new_id() for _ in range(count)]
        for wid in wanted:
            slot = self.slots.get(wid)
            if slot is not None and slot.state is SlotState.STOPPING:
                plan.refused.append(Refusal(ID_IN_USE, wid, "still stopping: ask again once gone"))
            elif slot is not None:
                plan.unchanged.append(wid)
            elif wid in taken:
                plan.refused.append(Refusal(ID_IN_USE, wid, "a live worker has this id"))
            elif self.size >= self.max_size:
                plan.refused.append(self._full(wid if worker_ids else ""))
            else:
                self.slots[wid] = Slot(wid, requested_at=now, command_id=command_id)
                plan.accepted.append(wid)
        return plan

    def _full(self, worker_id: str) -> Refusal:
        if self.capacity is not None and self.capacity < self.max_workers:
            return Refusal(NO_GPU, worker_id, f"all {self.capacity} GPUs of this host are in use")
        return Refusal(MAX_WORKERS, worker_id, f"the pool is at max_workers={self.max_workers}")

    # -- STOP ---------------------------------------------------------------------------------
    def stop(self, worker_ids: Sequence[str], holdings: Mapping[str, Sequence[str]]) -> Plan:
        """Mark the named workers STOPPING, unless one holds sessions (``holdings``: worker id
        -> the sessions the registry says it holds) or the pool would fall below its minimum."""
        plan = Plan()
        for wid in dict.fromkeys(worker_ids):
            slot = self.slots.get(wid)
            if slot is None or slot.state is SlotState.STOPPING:
                plan.unchanged.append(wid)
                continue
            held = holdings.get(wid, ())
            if held:
                shown = ", ".join(sorted(held)[:5]) + (", ..." if len(held) > 5 else "")
                plan.refused.append(Refusal(NOT_DRAINED, wid, f"holds {len(held)} session(s): {shown}"))
            elif self.live <= self.min_workers:
                plan.refused.append(Refusal(
                    MIN_WORKERS, wid, f"the pool would fall below min_workers={self.min_workers}"))
            else:
                slot.state = SlotState.STOPPING
                plan.accepted.append(wid)
        return plan

    # -- what the workers do --------------------------------------------------------------------
    def mark_ready(self, worker_id: str, now: float) -> Slot | None:
        """A READY heartbeat: the slot, when this was its first one (else None)."""
        slot = self.slots.get(worker_id)
        if slot is None or slot.state is not SlotState.BOOTING:
            return None
        slot.state = SlotState.READY
        slot.ready_at = now
        slot.ready.set()
        return slot

    def mark_status(self, worker_id: str, status: WorkerStatus) -> None:
        """A later heartbeat: a READY worker may say it is DRAINING, and back."""
        slot = self.slots.get(worker_id)
        if slot is None or slot.state in (SlotState.BOOTING, SlotState.STOPPING):
            return
        if status is WorkerStatus.DRAINING:
            slot.state = SlotState.DRAINING
        elif status is WorkerStatus.READY:
            slot.state = SlotState.READY

    def remove(self, worker_id: str) -> Slot | None:
        return self.slots.pop(worker_id, None)
