"""What ``turboserve up`` finds of an earlier run in a Redis it reuses, and what it does with it.

A run that reuses NATS and Redis shares the namespace of the runs before it, so their sessions
are still there. Before any service starts, ``settle_earlier_sessions`` applies the gateways'
lifetime rules to each session the gateways still track, as the reaper would on its first pass
(``services/gateway/lifetimes.py``), so that the scheduler, when it takes the lead, never
places a session nobody watches:

- watched now (a viewer on a gateway replica that is alive): left as it is;
- unwatched for longer than its lifetime (``idle_after_s + close_after_s``): closed;
- unwatched for longer than ``idle_after_s``: idle (the scheduler restores it idle; its viewer
  coming back brings it back, from its recovery log or its prompt);
- unwatched for less: left as it is (its viewer has until ``idle_after_s`` to come back).

The unwatched time is the same whichever run's gateway it was watched through: a gateway that
stops records when (``GatewayStore.replica_gone``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from services.gateway.store import GatewayStore
from shared.registry import Registry, StaleEpoch
from shared.runner import redis_client
from shared.states import IllegalTransition, SessionState
from shared.tls import TlsFiles


@dataclass(frozen=True, slots=True)
class EarlierSessions:
    """The sessions an earlier run left, by what was done with each."""

    found: int = 0
    closed: int = 0  # unwatched past their lifetime
    idled: int = 0  # unwatched past idle_after_s: idle until watched again
    kept: int = 0  # watched now, or unwatched for less than idle_after_s

    def line(self, idle_after_s: float, close_after_s: float) -> str | None:
        """The banner's line about them (None when there were none)."""
        if not self.found:
            return None
        return (
            f"Sessions: found {self.found} from an earlier run in this Redis: closed "
            f"{self.closed} unwatched past their lifetime ({idle_after_s + close_after_s:.0f} s), "
            f"{self.idled} idle until watched again (unwatched over {idle_after_s:.0f} s), "
            f"{self.kept} kept as they were"
        )


async def settle_earlier_sessions(
    redis_url: str,
    namespace: str,
    idle_after_s: float,
    close_after_s: float,
    now: float | None = None,
    tls: TlsFiles | None = None,
) -> EarlierSessions:
    """Close, idle or keep each session an earlier run left in ``namespace`` (see above)."""
    now = time.time() if now is None else now
    client = redis_client(redis_url, tls)
    try:
        store = GatewayStore(client, namespace)
        registry = Registry(client, namespace)
        close_before = now - idle_after_s - close_after_s
        closed = idled = kept = 0
        tracked = await store.tracked()
        for session_id in tracked:
            live, seen = await store.settle(session_id, now)
            if live or seen is None or seen > now - idle_after_s:
                kept += 1
            elif seen <= close_before and await store.claim_close(session_id, close_before, now):
                await _terminate(registry, store, session_id)
                closed += 1
            else:
                await store.go_idle_if_unwatched(session_id, now)  # no-op for a paused one
                idled += 1
        return EarlierSessions(len(tracked), closed, idled, kept)
    finally:
        await client.aclose()


async def _terminate(registry: Registry, store: GatewayStore, session_id: str) -> None:
    """Close a session no service holds now: terminated in the registry (which fences off any
    worker that still had it), the gateways' keys dropped."""
    record = await registry.get_session(session_id)
    if record is not None and record.state is not SessionState.TERMINATED:
        try:
            record = await registry.transition(session_id, SessionState.TERMINATED)
        except (IllegalTransition, StaleEpoch):
            record = await registry.get_session(session_id) or record
    await store.forget(session_id, record.owner_key if record is not None else "")
