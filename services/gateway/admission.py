"""Admission control: refuse a new session (429) rather than push every running one past its
deadline, and keep each API key within its share.

The pool check is a pure function of what the registry says (workers from their heartbeats,
the provisioner's pool limits, the pending sessions); the per-key checks live in Redis so that
they hold across gateway replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway import errors
from services.gateway.state import Gateway
from shared.registry import PoolLimits, WorkerRecord
from shared.states import SessionState
from shared.wire import WorkerStatus


@dataclass(frozen=True, slots=True)
class PoolRoom:
    """Whether the pool has room for another session, and the figures a refusal gives."""

    full: bool
    live_workers: int
    max_workers: int | None
    pending: int


def judge_pool(
    workers: list[WorkerRecord],
    limits: PoolLimits | None,
    pending: int,
    placement: dict[str, str] | None = None,
) -> PoolRoom:
    """Full when the pool cannot grow (its live workers, booting ones included, reach
    ``max_workers``) and the ready workers have no slot left for another session after the
    sessions already waiting for one. A worker holds the sessions its heartbeat lists and those
    the placement map gives it (a session just placed is in the map before the next heartbeat).
    Without pool limits (no provisioner has written them) the pool may grow: never full."""
    placed: dict[str, set[str]] = {}
    for session_id, worker_id in (placement or {}).items():
        placed.setdefault(worker_id, set()).add(session_id)
    live = [w for w in workers if w.alive and w.status is not WorkerStatus.GONE]
    free = sum(
        max(0, w.capacity - len(set(w.sessions) | placed.get(w.id, set())))
        for w in live
        if w.status is WorkerStatus.READY
    )
    if limits is None:
        return PoolRoom(False, len(live), None, pending)
    full = len(live) >= limits.max_workers and free - pending <= 0
    return PoolRoom(full, len(live), limits.max_workers, pending)


async def check_pool(gw: Gateway) -> None:
    """Refuse a new session (:class:`errors.PoolFull`) when the pool has no room for it."""
    registry = gw.registry
    workers = await registry.workers()
    limits = await registry.pool_limits()
    pending = await gw.redis.zcard(registry.pending_key)
    room = judge_pool(workers, limits, int(pending), await registry.placement())
    if room.full:
        raise errors.PoolFull(
            "every worker is at capacity and the pool is at its maximum; retry later",
            retry_after_s=gw.settings.admission_retry_after_s,
            workers=room.live_workers,
            max_workers=room.max_workers,
            pending=room.pending,
        )


async def reserve_session(gw: Gateway, key_name: str, session_id: str) -> None:
    """Count a new session against its key's limit of open sessions, or refuse it (429).
    Sessions that ended without the gateways knowing (closed by another tool) are pruned
    before refusing."""
    limit = gw.settings.max_sessions_per_key
    if await gw.store.reserve_session(key_name, session_id, limit):
        return
    await prune_key_sessions(gw, key_name)
    if await gw.store.reserve_session(key_name, session_id, limit):
        return
    raise errors.TooManySessions(
        f"this key has {limit} open sessions, its limit; close one first",
        retry_after_s=gw.settings.admission_retry_after_s,
        limit=limit,
    )


async def prune_key_sessions(gw: Gateway, key_name: str) -> None:
    registry = gw.registry
    for session_id in await gw.store.key_sessions(key_name):
        record = await registry.get_session(session_id)
        if record is None or record.state is SessionState.TERMINATED:
            await gw.store.forget(session_id, key_name)
