"""Sessions waiting for a worker, as the scheduler last read them: what it writes back when
Redis lost them.

A session that runs has an owner that writes it back after Redis restarted empty (the worker,
with its epoch and progress). A pending one has none, and its ``created`` event was taken from
the sessions stream (a work queue) when the scheduler heard it: the scheduler keeps the record
of every session pending in the registry as it last read it (at its ``created`` event, its
requeue and every repair pass), drops it when it places or closes the session, and writes back
those the registry no longer has, as pending, before it tries the lease again (a Redis
restarted empty took the lease too). The copy outlives a leadership in the process, and is
dropped when another scheduler is found leading (it places sessions this one does not see).
"""

from __future__ import annotations

from shared.logging import get_logger
from shared.registry import Registry, SessionRecord
from shared.states import SessionState

log = get_logger("turboserve.scheduler")


class Unplaced:
    """The records of the sessions pending in the registry, by id, as this scheduler last
    read them."""

    def __init__(self) -> None:
        self.records: dict[str, SessionRecord] = {}

    def __len__(self) -> int:
        return len(self.records)

    def note(self, record: SessionRecord) -> None:
        """``record`` as just read: kept while pending, dropped otherwise."""
        if record.state is SessionState.PENDING:
            self.records[record.id] = record
        else:
            self.records.pop(record.id, None)

    def drop(self, session_id: str) -> None:
        """The session was placed or closed: nothing to write back for it."""
        self.records.pop(session_id, None)

    def clear(self) -> None:
        self.records.clear()

    async def refresh(self, registry: Registry, pending: list[str]) -> None:
        """Follow the registry's pending set ``pending``, as just read: those no longer in it
        are dropped, the records of those not kept yet are read."""
        wanted = set(pending)
        for sid in [sid for sid in self.records if sid not in wanted]:
            del self.records[sid]
        for record in (
            await registry.sessions([s for s in pending if s not in self.records])
        ).values():
            self.note(record)

    async def write_back(self, registry: Registry) -> list[str]:
        """Those kept that the registry lost, written back as pending; returns their ids."""
        if not self.records:
            return []
        restored = []
        for sid in await registry.missing_sessions(sorted(self.records)):
            record = self.records.get(sid)
            if record is not None and await registry.restore_pending(record):
                restored.append(sid)
                log.warning("pending_session_written_back", session_id=sid, epoch=record.epoch)
        return restored
