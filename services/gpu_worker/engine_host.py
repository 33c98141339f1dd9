"""The worker's side of a migration: :class:`StateHost` over the generation loop.

This runs on the event loop and never touches the engine: every change to a session (freeze,
unfreeze, release, adopt) is a control in the inbox that the generation thread, which owns the
engine, runs at a pass boundary (a freeze at the session's own chunk boundary); the event loop
awaits its answer. Admission reads only the loop's published status and the engine's immutable
state layout; an arriving state is received into a slot held by the engine's thread-safe
``SlotReservations``. A frozen session keeps its slot and sits out of every pass, so an aborted handoff
resumes it exactly where it stopped, and its exported copy never changes under the transfer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from services.gpu_worker.engine import EngineError, StateLayout
from services.gpu_worker.engine.slots import SlotReservations
from services.gpu_worker.generation import GenerationLoop
from services.gpu_worker.handoff.codes import HandoffCode
from services.gpu_worker.handoff.host import FrozenSession, HandoffRefusal, HostRefused
from services.gpu_worker.inbox import CommandInbox, Control
from services.gpu_worker.outbox import Flushed
from shared.logging import get_logger
from shared.registry import Registry

log = get_logger("turboserve.worker")

T = TypeVar("T")
# How long a freeze waits for the session's chunks made before it to go out.
FLUSH_WAIT_S = 2.0


class EngineHost:
    def __init__(
        self,
        worker_id: str,
        generation: GenerationLoop,
        inbox: CommandInbox,
        is_draining: Callable[[], bool],
        *,
        device: str,
        capacity: int,
        layout: StateLayout,
        registry: Registry | None = None,
        reservations: SlotReservations | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.device = device
        self.capacity = capacity
        self.layout = layout
        self.generation = generation
        self.inbox = inbox
        self.is_draining = is_draining
        self.registry = registry
        self.reservations = reservations  # the engine's slots held for arriving states
        self._reserved: dict[str, bool] = {}  # session id -> arrives suspended

    # -- source ---------------------------------------------------------------------------------
    async def freeze(self, session_id: str, epoch: int, *, on_device: bool) -> FrozenSession:
        task = asyncio.ensure_future(
            self._call(
                "freeze",
                lambda: self.generation.freeze(session_id, epoch, on_device=on_device),
                session_id=session_id,
            )
        )
        try:
            frozen = await asyncio.shield(task)
            await self._flushed(session_id)
            return frozen
        except asyncio.CancelledError:
            # Cancellation-safe: whenever the freeze lands (or has landed), undo it (same epoch).
            task.add_done_callback(lambda t: self._unfreeze_after_cancel(t, session_id, epoch))
            raise

    async def _flushed(self, session_id: str) -> None:
        """Wait until every chunk the session made before its freeze is out (published, or
        told as unpublished), for at most ``FLUSH_WAIT_S``. A chunk still being encoded when
        the session froze would otherwise reach the viewers after the new owner's ``migrated``
        notice: its viewers would hear of the new owner, then get the old one's last chunk.
        Past the wait (NATS away), the handoff goes on: the order is then not kept."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.generation.outbox.put(Flushed(done))
        try:
            await asyncio.wait_for(done, FLUSH_WAIT_S)
        except TimeoutError:
            log.warning("freeze_flush_timed_out", session_id=session_id, wait_s=FLUSH_WAIT_S)

    def _unfreeze_after_cancel(
        self, task: asyncio.Future[Any], session_id: str, epoch: int
    ) -> None:
        if not task.cancelled() and task.exception() is None:
            self.inbox.put(
                Control(
                    "unfreeze",
                    lambda: self.generation.unfreeze(session_id, epoch),
                    _ignore,
                    _ignore,
                )
            )

    async def unfreeze(self, session_id: str, epoch: int) -> None:
        await self._call("unfreeze", lambda: self.generation.unfreeze(session_id, epoch))

    async def release(self, session_id: str) -> None:
        await self._call("release", lambda: self.generation.drop(session_id, reason="migrated"))

    # -- destination ----------------------------------------------------------------------------
    def admission(self, incoming: FrozenSession) -> HandoffRefusal | None:
        sid = incoming.snapshot.session_id
        if self.is_draining():
            return HandoffRefusal(HandoffCode.DRAINING, f"{self.worker_id} is draining")
        status = self.generation.status()
        if sid in status.sessions or sid in self._reserved:
            return HandoffRefusal(HandoffCode.EXISTS, f"{sid} is already on {self.worker_id}")
        if not incoming.suspended:
            taken = len(status.active) + sum(1 for s in self._reserved.values() if not s)
            capacity = status.capacity or self.capacity  # lowered after a pass out of memory
            if taken >= capacity:
                return HandoffRefusal(
                    HandoffCode.FULL, f"all {capacity} slots of {self.worker_id} are taken"
                )
        try:
            self.layout.check(incoming.snapshot)
        except EngineError as exc:
            return HandoffRefusal(HandoffCode.INCOMPATIBLE, str(exc))
        return None

    def receive_buffers(self, incoming: FrozenSession, device: str) -> list[torch.Tensor] | None:
        """The rows of a slot the engine holds for the session, when the state arrives where
        the engine keeps it (NCCL or CUDA IPC on a GPU worker, gloo on a CPU one): received
        straight into its slot, adopted without a copy or fresh buffers. None (the endpoint
        allocates; adopt copies) for a session that arrives suspended (it stays in host memory),
        for state received elsewhere, or when no slot is free."""
        if self.reservations is None or incoming.suspended:
            return None
        if torch.device(device) != self.reservations.pool.device:
            return None
        return self.reservations.reserve(incoming.snapshot.session_id)

    def reserve(self, session_id: str) -> None:
        # Counted as an executing session until adopted: the safe side for admission.
        self._reserved.setdefault(session_id, False)

    def unreserve(self, session_id: str) -> None:
        self._reserved.pop(session_id, None)
        if self.reservations is not None:
            self.reservations.release(session_id)

    async def adopt(self, frozen: FrozenSession, epoch: int) -> None:
        record = None
        if self.registry is not None:  # the session's client credentials, for its record
            record = await self.registry.get_session(frozen.snapshot.session_id)
        token_hash = record.token_hash if record is not None else ""
        owner_key = record.owner_key if record is not None else ""
        try:
            await self._call(
                "adopt", lambda: self.generation.adopt(frozen, epoch, token_hash, owner_key)
            )
        finally:
            self.unreserve(frozen.snapshot.session_id)

    # -- plumbing -------------------------------------------------------------------------------
    async def _call(self, name: str, fn: Callable[[], T], session_id: str | None = None) -> T:
        """Run ``fn`` on the generation thread (at ``session_id``'s chunk boundary if given)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def resolve(value: T) -> None:
            loop.call_soon_threadsafe(_settle, future, value, None)

        def reject(exc: BaseException) -> None:
            loop.call_soon_threadsafe(_settle, future, None, exc)

        self.inbox.put(Control(name, fn, resolve, reject, session_id=session_id))
        return await future


def _settle(future: asyncio.Future[Any], value: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        if isinstance(exc, LookupError):
            exc = HostRefused(HandoffCode.UNKNOWN_SESSION, str(exc))
        future.set_exception(exc)
    else:
        future.set_result(value)


def _ignore(_: object) -> None:
    return None
