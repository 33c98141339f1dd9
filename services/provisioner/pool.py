"""The provisioner's book of workers and its rules, without I/O.

Every worker the provisioner manages has a :class:`ManagedWorker` in the :class:`Pool`: BOOTING
from the request on, READY from its first READY heartbeat (DRAINING while it says so), STOPPING once a
STOP was accepted, and none once gone. The rules for START and STOP live here, so they are
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


class ManagedState(enum.StrEnum):
    """Where a managed worker is in its life, as the provisioner sees it."""

    BOOTING = "booting"
    READY = "ready"
    DRAINING = "draining"
    STOPPING = "stopping"


# What a refused STOP reports as the worker's status (it is still there).
STATUS_OF = {
    ManagedState.BOOTING: WorkerStatus.BOOTING,
    ManagedState.READY: WorkerStatus.READY,
    ManagedState.DRAINING: WorkerStatus.DRAINING,
    ManagedState.STOPPING: WorkerStatus.DRAINING,
}


@dataclass
class ManagedWorker:
    """The provisioner's record of one worker it started (its process or pod)."""

    worker_id: str
    requested_at: float  # wall clock: it costs from here
    state: ManagedState = ManagedState.BOOTING
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
        return self.state is not ManagedState.STOPPING


@dataclass(frozen=True, slots=True)
class PoolRefusal:
    """A worker a START or STOP does not touch, and why (``code``: one of the codes above)."""

    code: str
    worker_id: str = ""
    detail: str = ""


@dataclass
class PoolVerdict:
    """What one command does: ``accepted`` ids change state, ``unchanged`` ones are already as
    asked, ``refused`` ones are not touched."""

    accepted: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    refused: list[PoolRefusal] = field(default_factory=list)


class Pool:
    def __init__(
        self, min_workers: int, max_workers: int, capacity: int | None = None, emulated: str = ""
    ) -> None:
        self.min_workers = min_workers
        self.max_workers = max_workers
        self.capacity = capacity  # what the backend can host (local GPUs); None: no own limit
        self.emulated = emulated
        self.workers: dict[str, ManagedWorker] = {}

    @property
    def max_size(self) -> int:
        """The most workers at once: ``max_workers``, or fewer when the backend has fewer GPUs."""
        if self.capacity is None:
            return self.max_workers
        return min(self.max_workers, self.capacity)

    @property
    def size(self) -> int:
        """Workers holding a GPU (stopping ones too: the GPU is theirs until they are gone)."""
        return len(self.workers)

    @property
    def live(self) -> int:
        return sum(1 for s in self.workers.values() if s.live)

    @property
    def deficit(self) -> int:
        """Workers to start to get back to ``min_workers``."""
        return max(0, min(self.min_workers, self.max_size) - self.live)

    def get(self, worker_id: str) -> ManagedWorker | None:
        return self.workers.get(worker_id)

    def counts(self) -> dict[ManagedState, int]:
        out = dict.fromkeys(ManagedState, 0)
        for managed in self.workers.values():
            out[managed.state] += 1
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
    ) -> PoolVerdict:
        """Add BOOTING managed workers for ``worker_ids`` (or ``count`` new ids when none is named)."""
        verdict = PoolVerdict()
        if gpu_kind and self.emulated and gpu_kind.lower() != self.emulated.lower():
            detail = f"this pool emulates {self.emulated!r}, not {gpu_kind!r}"
            ids = list(dict.fromkeys(worker_ids)) or [""] * count
            verdict.refused = [PoolRefusal(KIND_UNAVAILABLE, wid, detail) for wid in ids]
            return verdict
        taken = set(in_use) - set(self.workers)
        wanted = list(dict.fromkeys(worker_ids)) if worker_ids else [new_id() for _ in range(count)]
        for wid in wanted:
            managed = self.workers.get(wid)
            if managed is not None and managed.state is ManagedState.STOPPING:
                verdict.refused.append(
                    PoolRefusal(ID_IN_USE, wid, "still stopping: ask again once gone")
                )
            elif managed is not None:
                verdict.unchanged.append(wid)
            elif wid in taken:
                verdict.refused.append(PoolRefusal(ID_IN_USE, wid, "a live worker has this id"))
            elif self.size >= self.max_size:
                verdict.refused.append(self._full(wid if worker_ids else ""))
            else:
                self.workers[wid] = ManagedWorker(wid, requested_at=now, command_id=command_id)
                verdict.accepted.append(wid)
        return verdict

    def _full(self, worker_id: str) -> PoolRefusal:
        if self.capacity is not None and self.capacity < self.max_workers:
            return PoolRefusal(
                NO_GPU, worker_id, f"all {self.capacity} GPUs of this host are in use"
            )
        return PoolRefusal(MAX_WORKERS, worker_id, f"the pool is at max_workers={self.max_workers}")

    # -- STOP ---------------------------------------------------------------------------------
    def stop(self, worker_ids: Sequence[str], holdings: Mapping[str, Sequence[str]]) -> PoolVerdict:
        """Mark the named workers STOPPING, unless one holds sessions (``holdings``: worker id
        -> the sessions the registry says it holds) or the pool would fall below its minimum."""
        verdict = PoolVerdict()
        for wid in dict.fromkeys(worker_ids):
            managed = self.workers.get(wid)
            if managed is None or managed.state is ManagedState.STOPPING:
                verdict.unchanged.append(wid)
                continue
            held = holdings.get(wid, ())
            if held:
                shown = ", ".join(sorted(held)[:5]) + (", ..." if len(held) > 5 else "")
                verdict.refused.append(
                    PoolRefusal(NOT_DRAINED, wid, f"holds {len(held)} session(s): {shown}")
                )
            elif self.live <= self.min_workers:
                verdict.refused.append(
                    PoolRefusal(
                        MIN_WORKERS,
                        wid,
                        f"the pool would fall below min_workers={self.min_workers}",
                    )
                )
            else:
                managed.state = ManagedState.STOPPING
                verdict.accepted.append(wid)
        return verdict

    # -- what the workers do --------------------------------------------------------------------
    def mark_ready(self, worker_id: str, now: float) -> ManagedWorker | None:
        """A READY heartbeat: the worker's record, when this was its first one (else None)."""
        managed = self.workers.get(worker_id)
        if managed is None or managed.state is not ManagedState.BOOTING:
            return None
        managed.state = ManagedState.READY
        managed.ready_at = now
        managed.ready.set()
        return managed

    def mark_status(self, worker_id: str, status: WorkerStatus) -> None:
        """A later heartbeat: a READY worker may say it is DRAINING, and back."""
        managed = self.workers.get(worker_id)
        if managed is None or managed.state in (ManagedState.BOOTING, ManagedState.STOPPING):
            return
        if status is WorkerStatus.DRAINING:
            managed.state = ManagedState.DRAINING
        elif status is WorkerStatus.READY:
            managed.state = ManagedState.READY

    def remove(self, worker_id: str) -> ManagedWorker | None:
        return self.workers.pop(worker_id, None)
