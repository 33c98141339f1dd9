"""Who may publish on a session's chunk subject: the owner the registry names, cached per feed.

Any worker credential can publish on any session's chunk subject, under any worker id and
epoch. A feed relays a chunk or notice only if the (worker id, epoch) it carries is an owner
the registry gave the session. The registry gives each epoch one owner for good (every
ownership change bumps the epoch), so what a feed has read once decides every later message
at or below that epoch without Redis:

- an epoch the feed has read: admitted if the worker is the owner the registry named for it;
- an epoch above the last one read: the registry may have moved on (a new owner's first
  notice or chunk), so it is read again, once, within a per-feed budget, then decided;
- an epoch below the last one read that the feed never read: an owner from before the feed
  looked. Admitted only while the feed replays what the stream retained (its history), never
  live.

A registry that cannot answer (Redis restarting, or restarted empty and not yet given the
record back by its owner's heartbeat) is not a verdict: ownership may have moved before it
went away. The message waits, and the feed behind it, while the registry is asked again, for
up to UNANSWERED_WAIT_S; only then is it dropped. A forger cannot make Redis go away, so this
wait is not one it can spend.

The cost: one small read when a feed starts (or resubscribes) and one per ownership change,
as the new owner's first message arrives (its notice, before its first chunk). Forged
messages cost nothing below the epoch last read, and above it at most the budget: a flood of
them cannot become a flood of Redis reads.
"""

from __future__ import annotations

import asyncio
import time

from redis.exceptions import RedisError

from shared.registry import Registry

# Re-reads a feed may spend at once, and the time one takes to come back: a legitimate owner
# change takes one (two when a migration aborts); a forger exhausts them and waits.
REREAD_BURST = 3
REREAD_EVERY_S = 0.5
# A re-read that takes longer is given up on and counts as unanswered (asked again, below).
REREAD_TIMEOUT_S = 1.0
# How long a message waits for a registry that does not answer (or holds no record of the
# session: restarted empty, its owner's heartbeat writes it back within a second or two), and
# the longest pause between its asks.
UNANSWERED_WAIT_S = 15.0
UNANSWERED_PAUSE_S = 1.0
# Epochs whose owner a feed keeps: the current one and the few before it (late messages of
# the owner a session just left).
KNOWN_EPOCHS = 8


class Owners:
    """One feed's view of its session's owners, as read from the registry."""

    def __init__(self, registry: Registry, session_id: str) -> None:
        self.registry = registry
        self.session_id = session_id
        self.by_epoch: dict[int, str] = {}  # epoch -> owner ("" none: pending)
        self.read_epoch = -1  # the registry's epoch at the newest read (-1: none yet)
        self.reads = 0
        self._tokens = float(REREAD_BURST)
        self._refilled_at = time.monotonic()

    @property
    def current(self) -> tuple[str, int]:
        """The newest owner read and its epoch (``""``, -1: none read)."""
        return self.by_epoch.get(self.read_epoch, ""), self.read_epoch

    async def load(self) -> None:
        """Read the session's owner (a feed's start; raises what Redis raises)."""
        self.reads += 1
        found = await self.registry.session_owner(self.session_id)
        if found is not None:
            self.note(*found)

    def note(self, owner: str, epoch: int) -> None:
        """What the registry said (a read of this feed's, or the hub's quiet check)."""
        if epoch < self.read_epoch:
            return  # an older read that came back late
        self.read_epoch = epoch
        self.by_epoch[epoch] = owner
        while len(self.by_epoch) > KNOWN_EPOCHS:
            del self.by_epoch[min(self.by_epoch)]

    def verdict(self, worker_id: str, epoch: int, history: bool) -> bool | None:
        """Whether ``worker_id`` owned the session at ``epoch``, from what was read; None when
        only the registry can say (an epoch above the newest read). ``history``: the message
        was in the stream before the feed's subscription (replayed)."""
        owner = self.by_epoch.get(epoch)
        if owner is not None:
            return owner == worker_id
        if epoch > self.read_epoch:
            return None
        return history

    async def admits(self, worker_id: str, epoch: int, history: bool) -> bool:
        """:meth:`verdict`, reading the registry again when it must (and the budget allows)."""
        known = self.verdict(worker_id, epoch, history)
        if known is not None:
            return known
        if not self._spend():
            return False
        give_up = time.monotonic() + UNANSWERED_WAIT_S
        pause = 0.1
        while True:
            self.reads += 1
            try:
                found = await asyncio.wait_for(
                    self.registry.session_owner(self.session_id), REREAD_TIMEOUT_S
                )
            except (RedisError, TimeoutError):
                found = None  # unanswered: the registry may have moved on before it went away
            if found is not None:
                self.note(*found)
                return self.verdict(worker_id, epoch, history) is True
            if time.monotonic() + pause > give_up:
                return False
            await asyncio.sleep(pause)
            pause = min(UNANSWERED_PAUSE_S, pause * 2)

    def _spend(self) -> bool:
        now = time.monotonic()
        self._tokens = min(
            float(REREAD_BURST), self._tokens + (now - self._refilled_at) / REREAD_EVERY_S
        )
        self._refilled_at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True
