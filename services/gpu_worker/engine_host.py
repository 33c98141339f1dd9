"""The worker's side of a migration: :class:`StateHost` over the engine and generation loop.

Every change to a session happens on the generation thread, at a pass boundary (a freeze at
the session's own chunk boundary), through controls in the inbox; the event loop awaits them.
A frozen session keeps its slot and sits out of every pass, so an aborted handoff resumes it
exactly where it stopped, and its exported copy never changes under the transfer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from services.gpu_worker.engine import Engine, EngineError
from services.gpu_worker.generation import GenerationLoop, OwnedSession
from services.gpu_worker.handoff.codes import HandoffCode
from services.gpu_worker.handoff.host import FrozenSession, HostRefused, Refusal
from services.gpu_worker.inbox import CommandInbox, Control
from services.gpu_worker.pacing import PlaybackClock
from shared.logging import get_logger
from shared.registry import Registry
from shared.wire import NoticeKind

log = get_logger("turboserve.worker")

T = TypeVar("T")


class EngineHost:
    def __init__(
        self,
        worker_id: str,
        engine: Engine,
        generation: GenerationLoop,
        inbox: CommandInbox,
        is_draining: Callable[[], bool],
        registry: Registry | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.device = engine.device
        self.engine = engine
        self.generation = generation
        self.inbox = inbox
        self.is_draining = is_draining
        self.registry = registry
        self._reserved: dict[str, bool] = {}  # session id -> arrives suspended

    # -- source ---------------------------------------------------------------------------------
    async def freeze(self, session_id: str, epoch: int, *, on_device: bool) -> FrozenSession:
        task = asyncio.ensure_future(self._call(
            "freeze", lambda: self._freeze(session_id, epoch), session_id=session_id))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            # Cancellation-safe: whenever the freeze lands, undo it (same epoch).
            task.add_done_callback(lambda t: self._unfreeze_after_cancel(t, session_id, epoch))
            raise

    def _unfreeze_after_cancel(self, task: asyncio.Future[Any], session_id: str, epoch: int) -> None:
        if not task.cancelled() and task.exception() is None:
            self.inbox.put(Control("unfreeze", lambda: self._unfreeze(session_id, epoch),
                                   _ignore, _ignore))

    def _freeze(self, session_id: str, epoch: int) -> FrozenSession:
        """On the generation thread, at the session's chunk boundary."""
        owned = self.generation.owned.get(session_id)
        if owned is None or not self.engine.has_session(session_id):
            raise HostRefused(HandoffCode.UNKNOWN_SESSION, f"{session_id} is not on this worker")
        if owned.epoch != epoch:
            raise HostRefused(HandoffCode.STALE_EPOCH,
                              f"{session_id} is here at epoch {owned.epoch}, not {epoch}")
        if owned.frozen:
            raise HostRefused(HandoffCode.BUSY, f"{session_id} is already being handed off")
        snapshot = self.engine.export_state(session_id)
        owned.frozen = True
        owned.suspend_pending = False
        suspended = session_id in self.engine.suspended_sessions()
        return FrozenSession(snapshot=snapshot, next_seq=owned.seq_base + snapshot.seq,
                             due_at=owned.clock.due, suspended=suspended)

    async def unfreeze(self, session_id: str, epoch: int) -> None:
        await self._call("unfreeze", lambda: self._unfreeze(session_id, epoch))

    def _unfreeze(self, session_id: str, epoch: int) -> None:
        owned = self.generation.owned.get(session_id)
        if owned is not None:
            owned.frozen = False
            moved_on, owned.epoch = epoch != owned.epoch, epoch
            log.info("session_unfrozen", session_id=session_id, epoch=epoch)
            if moved_on and self.engine.has_session(session_id):
                # The handoff failed after the registry moved the epoch: the session stays here
                # under a new epoch, and its viewers hear so before its next chunk.
                self.generation.announce(
                    session_id, NoticeKind.PLACED,
                    owned.seq_base + self.engine.next_seq(session_id),
                    detail=f"a migration did not complete; continues on {self.worker_id}")

    async def release(self, session_id: str) -> None:
        await self._call("release", lambda: self.generation.drop(session_id, reason="migrated"))

    # -- destination ----------------------------------------------------------------------------
    def admission(self, incoming: FrozenSession) -> Refusal | None:
        sid = incoming.snapshot.session_id
        if self.is_draining():
            return Refusal(HandoffCode.DRAINING, f"{self.worker_id} is draining")
        status = self.generation.status()
        if sid in status.sessions or sid in self._reserved:
            return Refusal(HandoffCode.EXISTS, f"{sid} is already on {self.worker_id}")
        if not incoming.suspended:
            taken = len(status.active) + sum(1 for s in self._reserved.values() if not s)
            if taken >= self.engine.capacity:
                return Refusal(HandoffCode.FULL,
                               f"all {self.engine.capacity} slots of {self.worker_id} are taken")
        try:
            self.engine.check_compatible(incoming.snapshot)
        except EngineError as exc:
            return Refusal(HandoffCode.INCOMPATIBLE, str(exc))
        return None

    def receive_buffers(self, incoming: FrozenSession, device: str) -> list[torch.Tensor] | None:
        """Let the endpoint allocate (the engine copies the state into a slot on adopt)."""
        return None

    def reserve(self, session_id: str) -> None:
        # Counted as an executing session until adopted: the safe side for admission.
        self._reserved.setdefault(session_id, False)

    def unreserve(self, session_id: str) -> None:
        self._reserved.pop(session_id, None)

    async def adopt(self, frozen: FrozenSession, epoch: int) -> None:
        record = None
        if self.registry is not None:  # the session's client credentials, for its record
            record = await self.registry.get_session(frozen.snapshot.session_id)
        token_hash = record.token_hash if record is not None else ""
        owner_key = record.owner_key if record is not None else ""
        try:
            await self._call("adopt", lambda: self._adopt(frozen, epoch, token_hash, owner_key))
        finally:
            self.unreserve(frozen.snapshot.session_id)

    def _adopt(self, frozen: FrozenSession, epoch: int, token_hash: str = "",
               owner_key: str = "") -> None:
        snapshot = frozen.snapshot
        sid = snapshot.session_id
        self.engine.import_state(snapshot, suspended=frozen.suspended)
        owned = OwnedSession(epoch=epoch, seq_base=frozen.next_seq - snapshot.seq,
                             clock=PlaybackClock(frozen.due_at), token_hash=token_hash,
                             owner_key=owner_key)
        self.generation.owned[sid] = owned
        self.generation.announce(sid, NoticeKind.MIGRATED, frozen.next_seq,
                                 detail=f"now on {self.worker_id}")
        log.info("session_adopted", session_id=sid, epoch=epoch, next_seq=frozen.next_seq,
                 suspended=frozen.suspended)

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
