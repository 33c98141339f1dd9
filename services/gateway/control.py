"""Steering a session: prompt, pause, resume, close. The REST routes, the WebSocket controls and
the lifetime reaper all go through here, so the three behave the same.

The gateway flips what it owns (the registry's prompt, the session's activity in the shared
store) and tells the scheduler with a session event; the scheduler has the owning worker act at
a chunk boundary, and the worker announces it with a :class:`SessionNotice` on the session's
chunk subject. A control waits (``control_wait_s``) for that notice to say from which seq the
change holds; without it the answer says the change is accepted but not yet confirmed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, cast

from services.gateway import errors
from services.gateway.state import Gateway
from services.gateway.store import Activity
from shared.logging import get_logger
from shared.registry import SessionRecord, StaleEpoch
from shared.runner import subscriptions_live
from shared.states import IllegalTransition, SessionState
from shared.wire import (
    ChunkStreamMsg,
    NoticeKind,
    SessionEvent,
    SessionEventKind,
    SessionInput,
    SessionNotice,
    StreamEnd,
    decode_or_drop,
    encode,
)

log = get_logger("turboserve.gateway")


@dataclass(frozen=True, slots=True)
class ControlAnswer:
    """What a control did, the API's ``ControlAnswer``. ``confirmed``: the worker's notice
    came, ``next_seq`` is the first chunk the change holds for; otherwise the change is
    accepted and will apply later."""

    confirmed: bool
    next_seq: int | None = None

    def body(self, what: str) -> dict[str, Any]:
        body: dict[str, Any] = {"confirmed": self.confirmed, "next_seq": self.next_seq}
        if not self.confirmed:
            body["message"] = (
                f"{what} accepted; the worker has not confirmed it yet, so the seq "
                "it applies from is unknown"
            )
        return body

    @property
    def status(self) -> int:
        return 200 if self.confirmed else 202


async def publish_event(
    gw: Gateway,
    session_id: str,
    kind: SessionEventKind,
    *,
    prompt: str | None = None,
    seed: int | None = None,
    input: SessionInput = SessionInput.TEXT,
    strength: float | None = None,
    required: bool = True,
) -> bool:
    """Send a session event to the scheduler. ``required``: a failure is a 503 (the scheduler
    would never learn of the change); otherwise it is logged (the registry is enough)."""
    event = SessionEvent(
        session_id=session_id,
        kind=kind,
        prompt=prompt,
        seed=seed,
        input=input,
        strength=strength,
    )
    try:
        await gw.ctx.js.publish(gw.ctx.subjects.session_events, encode(event), timeout=2)
    except Exception as exc:  # noqa: BLE001 - NATS errors of every kind end the same way
        log.warning(
            "session_event_publish_failed", session_id=session_id, kind=str(kind), error=str(exc)
        )
        if required:
            raise errors.Unavailable(
                "could not reach the scheduler; retry", session_id=session_id
            ) from None
        return False
    return True


class NoticeWaiter:
    """Waits for the first notice of given kinds on a session's chunk subject (core NATS:
    only what is published after it subscribed)."""

    def __init__(self, kinds: frozenset[NoticeKind]) -> None:
        self.kinds = kinds
        self.found: asyncio.Future[SessionNotice | None] = (
            asyncio.get_running_loop().create_future()
        )

    async def on_msg(self, msg: Any) -> None:
        if self.found.done():
            return
        # cast: mypy reads a union written as a value as a UnionType, not a type to decode as.
        item = decode_or_drop(
            msg.subject, msg.data, cast("type[ChunkStreamMsg]", ChunkStreamMsg), log
        )
        if isinstance(item, SessionNotice) and item.kind in self.kinds:
            self.found.set_result(item)
        elif isinstance(item, StreamEnd):
            self.found.set_result(None)

    async def wait(self, within_s: float) -> SessionNotice | None:
        try:
            return await asyncio.wait_for(asyncio.shield(self.found), within_s)
        except TimeoutError:
            return None


@contextlib.asynccontextmanager
async def notice_waiter(
    gw: Gateway, session_id: str, *kinds: NoticeKind
) -> AsyncIterator[NoticeWaiter]:
    waiter = NoticeWaiter(frozenset(kinds))
    sub = await gw.ctx.nc.subscribe(gw.ctx.subjects.chunks(session_id), cb=waiter.on_msg)
    try:
        # The server must hold the interest before the caller sets off the notice: a worker
        # answers on its own connection, and could otherwise beat this SUB to the server.
        with contextlib.suppress(Exception):
            await subscriptions_live(gw.ctx.nc, timeout_s=2)
        yield waiter
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


def _require_open(record: SessionRecord, action: str) -> None:
    if record.state is SessionState.TERMINATED:
        raise errors.SessionClosed(
            f"session {record.id} is closed; cannot {action} it",
            session_id=record.id,
            state=str(record.state),
        )


async def _activity_flip(
    gw: Gateway, record: SessionRecord, sources: tuple[Activity, ...], target: Activity
) -> Activity:
    before = await gw.store.flip(record.id, sources, target)
    if before is None:  # created before this store knew it (another tool, an upgrade): track it
        await gw.store.track(record.id)
        before = await gw.store.flip(record.id, sources, target) or Activity.ACTIVE
    return before


async def change_prompt(
    gw: Gateway, record: SessionRecord, prompt: str, strength: float | None = None
) -> ControlAnswer:
    """A new prompt and, for a video session, a new ``strength`` (None: unchanged), both from
    the next chunk boundary."""
    _require_open(record, "steer")
    if strength is not None and record.input is not SessionInput.VIDEO:
        raise errors.NotVideoSession(
            f"session {record.id} generates from text: only a video session has a strength",
            session_id=record.id,
            field="strength",
        )
    await gw.registry.set_prompt(record.id, prompt, strength=strength)
    async with notice_waiter(gw, record.id, NoticeKind.PROMPT) as waiter:
        await publish_event(
            gw, record.id, SessionEventKind.PROMPT, prompt=prompt, strength=strength
        )
        notice = await waiter.wait(gw.settings.control_wait_s)
    log.info(
        "session_prompt_changed",
        session_id=record.id,
        prompt_chars=len(prompt),
        strength=strength,
        next_seq=notice.next_seq if notice else None,
    )
    return ControlAnswer(notice is not None, notice.next_seq if notice else None)


async def pause(gw: Gateway, record: SessionRecord) -> ControlAnswer:
    """Active or idle -> paused. Only an active session needs the scheduler: an idle one is
    suspended already, and stays so until its client resumes it."""
    _require_open(record, "pause")
    before = await _activity_flip(gw, record, (Activity.ACTIVE, Activity.IDLE), Activity.PAUSED)
    if before is not Activity.ACTIVE:
        return ControlAnswer(record.state is SessionState.SUSPENDED)
    async with notice_waiter(gw, record.id, NoticeKind.SUSPENDED) as waiter:
        try:
            await publish_event(gw, record.id, SessionEventKind.IDLE)
        except errors.Unavailable:
            await gw.store.flip(record.id, (Activity.PAUSED,), Activity.ACTIVE)
            raise
        # A session on no worker (waiting for a GPU) has nothing to suspend: no notice comes,
        # and the scheduler simply does not place it while it is paused.
        notice = (
            await waiter.wait(gw.settings.control_wait_s)
            if record.state is not SessionState.PENDING
            else None
        )
    log.info("session_paused", session_id=record.id, confirmed=notice is not None)
    return ControlAnswer(notice is not None, notice.next_seq if notice else None)


async def resume(gw: Gateway, record: SessionRecord) -> ControlAnswer:
    _require_open(record, "resume")
    before = await _activity_flip(gw, record, (Activity.PAUSED, Activity.IDLE), Activity.ACTIVE)
    if before is Activity.ACTIVE:
        return ControlAnswer(record.state is not SessionState.SUSPENDED)
    # A suspended session resumes where it is (RESUMED); one on no worker is placed (PLACED).
    async with notice_waiter(gw, record.id, NoticeKind.RESUMED, NoticeKind.PLACED) as waiter:
        try:
            await publish_event(gw, record.id, SessionEventKind.ACTIVE)
        except errors.Unavailable:
            await gw.store.flip(record.id, (Activity.ACTIVE,), before)
            raise
        notice = await waiter.wait(gw.settings.control_wait_s)
    log.info("session_resumed", session_id=record.id, confirmed=notice is not None)
    return ControlAnswer(notice is not None, notice.next_seq if notice else None)


async def close(gw: Gateway, record: SessionRecord, reason: str = "closed") -> SessionRecord:
    """Close a session (idempotent): terminated in the registry, its streams ended, the
    scheduler told (it stops the worker), the gateways' keys dropped."""
    ctx = gw.ctx
    if record.state is not SessionState.TERMINATED:
        try:
            # Terminating bumps the epoch: the worker is fenced off at once, whatever it does.
            # The owner stays on record so that the scheduler knows which worker to stop.
            record = await gw.registry.transition(record.id, SessionState.TERMINATED)
        except (IllegalTransition, StaleEpoch):
            again = await gw.registry.get_session(record.id)  # someone else closed it first
            record = again or record
        else:
            # Streams end first (the StreamEnd is what open clients wait for); the event to the
            # scheduler is best effort: a worker that misses its STOP is fenced at its next
            # chunk anyway, since a terminated session takes no progress.
            end = StreamEnd(session_id=record.id, last_seq=record.last_seq, reason=reason)
            await ctx.nc.publish(ctx.subjects.chunks(record.id), encode(end))
            await publish_event(gw, record.id, SessionEventKind.CLOSED, required=False)
            log.info(
                "session_closed", session_id=record.id, last_seq=record.last_seq, reason=reason
            )
    await gw.store.forget(record.id, record.owner_key)
    return record
