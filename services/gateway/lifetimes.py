"""Session lifetimes across gateway replicas: viewers attach and detach, abandoned sessions go
idle and then close by themselves.

Each open stream or socket is an attachment in Redis, held by its replica; a replica says it is
alive every ``attach_ttl_s / 3`` (one write, however many viewers it holds), so every replica
sees every viewer, and the viewers of a replica that dies stop counting within ``attach_ttl_s``.
Each replica runs the reaper; it is idempotent:

1. a session with no viewer for ``idle_after_s`` goes idle (one replica wins the flip and
   sends ``idle``; the scheduler suspends it to host memory);
2. a viewer attaching to an idle session brings it back (``active``); a paused one stays paused
   until its client resumes it;
3. a session with no viewer for ``idle_after_s + close_after_s`` is closed (one replica wins the
   claim), whether it was idle or paused.

The unwatched time starts when the last viewer detaches, or, when its replica died instead,
when the reaper finds it gone (up to ``idle_after_s`` later).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.gateway import control
from services.gateway.feeds import Viewer
from services.gateway.state import Gateway
from services.gateway.store import Activity
from shared.logging import get_logger
from shared.registry import RegistryError
from shared.wire import SessionEventKind

log = get_logger("turboserve.gateway")


async def attach(gw: Gateway, session_id: str) -> str:
    """Record a viewer of ``session_id`` on this replica; returns the attachment id."""
    attachment_id = uuid.uuid4().hex[:16]
    gw.attachments[attachment_id] = session_id
    if await gw.store.attach(session_id, attachment_id, gw.instance_id):
        log.info("session_active_again", session_id=session_id)
        await control.publish_event(gw, session_id, SessionEventKind.ACTIVE, required=False)
    return attachment_id


async def detach(gw: Gateway, attachment_id: str) -> None:
    session_id = gw.attachments.pop(attachment_id, None)
    if session_id is not None:
        await gw.store.detach(session_id, attachment_id)


@contextlib.asynccontextmanager
async def watching(
    gw: Gateway, session_id: str, last_seq: int, transport: str, jpeg: bool = False
) -> AsyncIterator[Viewer]:
    """A viewer of the session's chunks after ``last_seq`` for as long as the block runs:
    attached (the session counts as watched) and counted among ``transport``'s clients
    (``jpeg``: it takes JPEG frames, which this gateway then makes)."""
    viewer = await gw.hub.join(session_id, last_seq, jpeg)
    try:
        attachment = await attach(gw, session_id)
    except BaseException:
        await gw.hub.leave(viewer)
        raise
    gw.metrics.clients.labels(transport).inc()
    try:
        yield viewer
    finally:
        gw.metrics.clients.labels(transport).dec()
        await gw.hub.leave(viewer)
        await detach(gw, attachment)


async def alive(gw: Gateway) -> None:
    if await gw.store.replica_alive(gw.instance_id, gw.settings.attach_ttl_s) and gw.attachments:
        # Redis did not know this replica while it holds viewers: it restarted empty. Record
        # them again, so that their sessions are neither idled nor closed as abandoned.
        for attachment_id, session_id in list(gw.attachments.items()):
            await gw.store.track(session_id)
            await gw.store.attach(session_id, attachment_id, gw.instance_id)
        log.warning("viewers_reannounced", viewers=len(gw.attachments))


async def reap_once(gw: Gateway, now: float | None = None) -> dict[str, list[str]]:
    """One pass of the reaper; returns the sessions it made idle and those it closed."""
    now = time.time() if now is None else now
    s = gw.settings
    close_before = now - s.idle_after_s - s.close_after_s
    idled: list[str] = []
    closed: list[str] = []
    candidates = await gw.store.unwatched_since(now - s.idle_after_s)
    activities = await gw.store.activities([sid for sid, _ in candidates])
    for (session_id, last_watched), activity in zip(candidates, activities, strict=True):
        try:
            if last_watched <= close_before:
                if await gw.store.claim_close(session_id, close_before, now):
                    record = await gw.registry.get_session(session_id)
                    if record is not None:
                        await control.close(gw, record, reason="abandoned")
                    closed.append(session_id)
            elif activity is Activity.ACTIVE and await gw.store.go_idle_if_unwatched(
                session_id, now
            ):
                log.info(
                    "session_idle", session_id=session_id, unwatched_s=round(now - last_watched, 1)
                )
                await control.publish_event(gw, session_id, SessionEventKind.IDLE, required=False)
                idled.append(session_id)
        except RegistryError as exc:  # this session only (it vanished meanwhile, say)
            log.warning("reap_failed", session_id=session_id, error=str(exc))
    return {"idle": idled, "closed": closed}


async def _every(period_s: float, stopping: asyncio.Event) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stopping.wait(), timeout=period_s)


async def run(gw: Gateway, stopping: asyncio.Event) -> None:
    """Keep this replica (and its viewers) alive, flush chunk latencies and reap, until
    ``stopping``."""
    s = gw.settings
    alive_every = s.attach_ttl_s / 3
    last_alive = 0.0
    while not stopping.is_set():
        started = time.monotonic()
        try:
            if started - last_alive >= alive_every:
                await alive(gw)
                last_alive = started
            await gw.store.record_latency(gw.take_latency())
            await reap_once(gw)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            # Redis away for a moment: the next pass catches up (a replica stays alive for
            # attach_ttl_s, three of its beats). Anything else is a bug and stops the service.
            log.warning("lifetimes_pass_failed", error=str(exc))
        await _every(min(s.reap_interval_s, alive_every), stopping)
