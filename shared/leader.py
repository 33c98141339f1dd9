"""The scheduler's leader lease in Redis: one active scheduler, standbys ready to take over.

Keys (``ns`` = ``TURBOSERVE_REDIS_NAMESPACE``):

- ``{ns}:scheduler:leader``  ``"<term>:<scheduler id>"`` with a TTL, renewed by the leader;
- ``{ns}:scheduler:term``    a counter: every new leadership gets a larger term (from the clock
  when the counter is behind it, so terms outgrow a Redis restarted empty).

Fencing: the leader's registry writes carry the lease as a guard (``Registry.transition(...,
guard=lease.guard)``), so a deposed leader changes no ownership; and its worker commands carry
its term, which a worker checks against this key, so it issues no command a worker accepts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis

# Terms only grow, even across a Redis that restarted empty (the counter then starts again
# from the clock, in ms), so a term is never handed out twice.
_ACQUIRE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return '' end
local term = redis.call('INCR', KEYS[2])
local floor = tonumber(ARGV[3])
if term < floor then
  redis.call('SET', KEYS[2], ARGV[3])
  term = floor
end
local value = tostring(term) .. ':' .. ARGV[1]
redis.call('SET', KEYS[1], value, 'PX', ARGV[2])
return value
"""

_RENEW_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

_RESIGN_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True, slots=True)
class Lease:
    """A leadership held: its term and the value that proves it."""

    key: str
    value: str

    @property
    def term(self) -> int:
        return int(self.value.split(":", 1)[0])

    @property
    def guard(self) -> tuple[str, str]:
        return self.key, self.value


def parse_term(value: bytes | str | None) -> int | None:
    if value is None:
        return None
    text = value.decode() if isinstance(value, bytes) else value
    head = text.split(":", 1)[0]
    return int(head) if head.isdigit() else None


class LeaderElection:
    def __init__(
        self, client: aioredis.Redis, namespace: str, candidate: str, ttl_s: float
    ) -> None:
        self.r = client
        self.key = f"{namespace}:scheduler:leader"
        self.term_key = f"{namespace}:scheduler:term"
        self.candidate = candidate
        self.ttl_ms = int(ttl_s * 1000)
        self._acquire = client.register_script(_ACQUIRE_LUA)
        self._renew = client.register_script(_RENEW_LUA)
        self._resign = client.register_script(_RESIGN_LUA)

    async def try_acquire(self) -> Lease | None:
        """The lease, if nobody holds it now."""
        value = await self._acquire(
            keys=[self.key, self.term_key],
            args=[self.candidate, self.ttl_ms, int(time.time() * 1000)],
        )
        text = value.decode() if isinstance(value, bytes) else value
        return Lease(self.key, text) if text else None

    async def renew(self, lease: Lease) -> bool:
        """Extend the lease; False when it was lost (expired and taken, or deleted)."""
        return bool(await self._renew(keys=[self.key], args=[lease.value, self.ttl_ms]))

    async def resign(self, lease: Lease) -> None:
        await self._resign(keys=[self.key], args=[lease.value])

    async def current_term(self) -> int | None:
        """The term of whoever leads now (None: nobody)."""
        return parse_term(await self.r.get(self.key))


def leader_key(namespace: str) -> str:
    return f"{namespace}:scheduler:leader"
