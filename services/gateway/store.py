"""What gateway replicas share in Redis: viewers, lifetimes, per-key limits, chunk latency.

Every gateway reads and writes these keys, so any replica can serve any session and the
lifetimes hold however many replicas run. Keys (``ns`` = ``TURBOSERVE_REDIS_NAMESPACE``):

- ``{ns}:gw:sessions``           sorted set: open session id -> when it was last seen watched
                                 (its creation until then)
- ``{ns}:gw:replicas``           sorted set: gateway replica id -> until when it is alive (each
                                 replica pushes this forward while it runs)
- ``{ns}:gw:viewers:{id}``       hash: attachment id -> the replica that holds it
- ``{ns}:gw:activity``           hash: session id -> ``active``, ``idle`` (no viewer) or
                                 ``paused`` (asked by its client)
- ``{ns}:gw:key_sessions:{key}`` set: the open sessions of one API key
- ``{ns}:gw:rate:{key}``         the key's rate limiter (GCRA: the theoretical arrival time)
- ``{ns}:gw:latency:{worker}``   sorted set: unix second -> the worst chunk latency (ms) seen

A viewer counts while its replica is alive: a replica refreshes one entry, however many streams
it holds, and when it dies its viewers go with it. Each change that two replicas could race on
is one Lua script: a session goes idle only while no viewer is attached, comes back when one
attaches, and is closed by exactly one replica.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import cast

import redis.asyncio as aioredis

# Shared by the scripts below: count the live viewers of a session (KEYS[1] its viewers,
# KEYS[2] the replicas, ARGV[1] now), dropping those whose replica died or stopped. A viewer of
# a replica that is no longer alive watched until that replica last said it was (a replica
# that stops says when): the session counts as seen then, so its unwatched time is the same
# whichever run's gateway it was watched through, and a replica forgotten long ago leaves the
# time as it was. When some viewers are live it counts as seen now, so the reaper leaves it
# alone for a while.
_LIVE_VIEWERS = """
local function live_viewers(viewers, replicas, sessions, session_id, now)
  local all = redis.call('HGETALL', viewers)
  local live, gone_at = 0, nil
  for i = 1, #all, 2 do
    local until_ = redis.call('ZSCORE', replicas, all[i + 1])
    if until_ and tonumber(until_) > tonumber(now) then
      live = live + 1
    else
      redis.call('HDEL', viewers, all[i])
      if until_ then
        gone_at = math.max(gone_at or 0, math.min(tonumber(until_), tonumber(now)))
      end
    end
  end
  if live > 0 then
    redis.call('ZADD', sessions, 'XX', now, session_id)
  elseif gone_at then
    local seen = redis.call('ZSCORE', sessions, session_id)
    if seen and gone_at > tonumber(seen) then
      redis.call('ZADD', sessions, 'XX', gone_at, session_id)
    end
  end
  return live
end
"""

# KEYS: viewers, replicas, sessions, activity. ARGV: session id, now.
_IDLE_IF_UNWATCHED_LUA = (
    _LIVE_VIEWERS
    + """
local seen = redis.call('ZSCORE', KEYS[3], ARGV[1])
if live_viewers(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2]) > 0 then return 0 end
if redis.call('ZSCORE', KEYS[3], ARGV[1]) ~= seen then return 0 end  -- its clock restarted
if redis.call('HGET', KEYS[4], ARGV[1]) ~= 'active' then return 0 end
redis.call('HSET', KEYS[4], ARGV[1], 'idle')
return 1
"""
)

# KEYS: viewers, replicas, sessions, activity. ARGV: session id, now, attachment id, replica.
_ATTACH_LUA = """
redis.call('HSET', KEYS[1], ARGV[3], ARGV[4])
redis.call('ZADD', KEYS[3], 'XX', ARGV[2], ARGV[1])
if redis.call('HGET', KEYS[4], ARGV[1]) == 'idle' then
  redis.call('HSET', KEYS[4], ARGV[1], 'active')
  return 1
end
return 0
"""

# Claim the close of an abandoned session: exactly one replica gets 1.
# KEYS: viewers, replicas, sessions. ARGV: session id, now, unwatched before.
_CLAIM_CLOSE_LUA = (
    _LIVE_VIEWERS
    + """
if live_viewers(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2]) > 0 then return 0 end
local seen = redis.call('ZSCORE', KEYS[3], ARGV[1])
if not seen or tonumber(seen) > tonumber(ARGV[3]) then return 0 end
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[1])
return 1
"""
)

# The live viewers of a session and when it was last seen watched, its dead viewers dropped.
# KEYS: viewers, replicas, sessions. ARGV: session id, now.
_SETTLE_LUA = (
    _LIVE_VIEWERS
    + """
local live = live_viewers(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2])
local seen = redis.call('ZSCORE', KEYS[3], ARGV[1])
return {live, seen or ''}
"""
)

# KEYS: viewers, replicas. ARGV: now.
_COUNT_LUA = """
local all = redis.call('HGETALL', KEYS[1])
local live = 0
for i = 1, #all, 2 do
  local until_ = redis.call('ZSCORE', KEYS[2], all[i + 1])
  if until_ and tonumber(until_) > tonumber(ARGV[1]) then live = live + 1 end
end
return live
"""

# Compare-and-set of a session's activity: ARGV[2] is a comma-separated list of the states it
# may come from. Returns the state it was in (empty when unknown).
_FLIP_LUA = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return '' end
for from in string.gmatch(ARGV[2], '[^,]+') do
  if cur == from then
    redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
    return cur
  end
end
return cur
"""

_RESERVE_LUA = """
if redis.call('SCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('SADD', KEYS[1], ARGV[2])
return 1
"""

# GCRA: one request costs ``interval``; ``burst`` requests may come at once. Returns
# {1, 0} when allowed, else {0, milliseconds until one more would be}.
_RATE_LUA = """
local now, interval, burst = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local tat = tonumber(redis.call('GET', KEYS[1]) or ARGV[1])
if tat < now then tat = now end
local allow_at = tat - (burst - 1) * interval
if now < allow_at then return {0, math.ceil((allow_at - now) * 1000)} end
local new_tat = tat + interval
redis.call('SET', KEYS[1], tostring(new_tat), 'PX', math.ceil((new_tat - now) * 1000) + 1000)
return {1, 0}
"""

_LATENCY_KEEP_S = 600
# A replica silent this long leaves the replicas set (its viewers stopped counting long before).
REPLICAS_KEPT_S = 3600


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class Activity(enum.StrEnum):
    ACTIVE = "active"
    IDLE = "idle"  # no viewer for a while: the scheduler suspends it
    PAUSED = "paused"  # its client asked; only its client brings it back


@dataclass(frozen=True, slots=True)
class RateVerdict:
    allowed: bool
    retry_after_s: float = 0.0


class GatewayStore:
    """The gateways' shared keys; one per gateway, on the service's Redis client."""

    def __init__(self, client: aioredis.Redis, namespace: str) -> None:
        self.r = client
        self.ns = namespace
        self._idle_if_unwatched = client.register_script(_IDLE_IF_UNWATCHED_LUA)
        self._attach = client.register_script(_ATTACH_LUA)
        self._claim_close = client.register_script(_CLAIM_CLOSE_LUA)
        self._flip = client.register_script(_FLIP_LUA)
        self._count = client.register_script(_COUNT_LUA)
        self._settle = client.register_script(_SETTLE_LUA)
        self._reserve = client.register_script(_RESERVE_LUA)
        self._rate = client.register_script(_RATE_LUA)

    # -- keys ---------------------------------------------------------------------------------
    @property
    def sessions_key(self) -> str:
        return f"{self.ns}:gw:sessions"

    @property
    def replicas_key(self) -> str:
        return f"{self.ns}:gw:replicas"

    def viewers_key(self, session_id: str) -> str:
        return f"{self.ns}:gw:viewers:{session_id}"

    @property
    def activity_key(self) -> str:
        return f"{self.ns}:gw:activity"

    def key_sessions_key(self, key_name: str) -> str:
        return f"{self.ns}:gw:key_sessions:{key_name}"

    def rate_key(self, key_name: str) -> str:
        return f"{self.ns}:gw:rate:{key_name}"

    def latency_key(self, worker_id: str) -> str:
        return f"{self.ns}:gw:latency:{worker_id}"

    def _lifetime_keys(self, session_id: str) -> list[str]:
        return [
            self.viewers_key(session_id),
            self.replicas_key,
            self.sessions_key,
            self.activity_key,
        ]

    # -- replicas, sessions and their lifetimes ---------------------------------------------------
    async def replica_alive(self, replica_id: str, ttl_s: float, now: float | None = None) -> bool:
        """This replica (and every viewer it holds) is alive for ``ttl_s`` more; replicas dead
        for a long while are forgotten. True when Redis did not know the replica (its first
        beat, or Redis restarted empty: its viewers must be recorded again)."""
        now = time.time() if now is None else now
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.zadd(self.replicas_key, {replica_id: now + ttl_s})
            pipe.zremrangebyscore(self.replicas_key, "-inf", now - REPLICAS_KEPT_S)
            added, _ = await pipe.execute()
        return bool(added)

    async def replica_gone(self, replica_id: str, now: float | None = None) -> None:
        """This replica stops: its viewers count no more, and were watched until now (the
        replica is kept as dead from now, so the next run's reaper knows when)."""
        now = time.time() if now is None else now
        await self.r.zadd(self.replicas_key, {replica_id: now})

    async def track(self, session_id: str, now: float | None = None) -> None:
        """A new session: active, and its unwatched clock starts now."""
        now = time.time() if now is None else now
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.zadd(self.sessions_key, {session_id: now})
            pipe.hset(self.activity_key, session_id, Activity.ACTIVE.value)
            await pipe.execute()

    async def forget(self, session_id: str, key_name: str) -> None:
        """The session is closed: drop everything the gateways kept about it."""
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.zrem(self.sessions_key, session_id)
            pipe.hdel(self.activity_key, session_id)
            pipe.delete(self.viewers_key(session_id))
            pipe.srem(self.key_sessions_key(key_name), session_id)
            await pipe.execute()

    async def activity(self, session_id: str) -> Activity | None:
        raw = await self.r.hget(self.activity_key, session_id)
        return None if raw is None else Activity(raw.decode() if isinstance(raw, bytes) else raw)

    async def activities(self, session_ids: list[str]) -> list[Activity | None]:
        if not session_ids:
            return []
        raw = cast(list[bytes | None], await self.r.hmget(self.activity_key, session_ids))
        return [None if v is None else Activity(_text(v)) for v in raw]

    async def flip(
        self, session_id: str, sources: tuple[Activity, ...], target: Activity
    ) -> Activity | None:
        """Set the activity to ``target`` if it is one of ``sources``; returns what it was
        (None when the session is not tracked). It changed iff the result is in ``sources``."""
        raw = await self._flip(
            keys=[self.activity_key],
            args=[session_id, ",".join(s.value for s in sources), target.value],
        )
        value = raw.decode() if isinstance(raw, bytes) else raw
        return Activity(value) if value else None

    async def attach(
        self, session_id: str, attachment_id: str, replica_id: str, now: float | None = None
    ) -> bool:
        """Record a viewer held by ``replica_id``; True when this brought an idle session back
        to active (a paused one stays paused)."""
        now = time.time() if now is None else now
        flipped = await self._attach(
            keys=self._lifetime_keys(session_id),
            args=[session_id, repr(now), attachment_id, replica_id],
        )
        return bool(flipped)

    async def detach(self, session_id: str, attachment_id: str, now: float | None = None) -> None:
        now = time.time() if now is None else now
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hdel(self.viewers_key(session_id), attachment_id)
            pipe.zadd(self.sessions_key, {session_id: now}, xx=True)
            await pipe.execute()

    async def viewers(self, session_id: str, now: float | None = None) -> int:
        """Viewers attached now, on every replica."""
        now = time.time() if now is None else now
        return int(
            await self._count(
                keys=[self.viewers_key(session_id), self.replicas_key], args=[repr(now)]
            )
        )

    async def settle(self, session_id: str, now: float | None = None) -> tuple[int, float | None]:
        """The session's live viewers, and when it was last seen watched (None: the gateways
        do not track it); viewers of replicas no longer alive are dropped first."""
        now = time.time() if now is None else now
        live, seen = await self._settle(
            keys=self._lifetime_keys(session_id)[:3], args=[session_id, repr(now)]
        )
        seen_text = _text(seen) if isinstance(seen, bytes) else str(seen)
        return int(live), float(seen_text) if seen_text else None

    async def unwatched_since(self, cutoff: float, limit: int = 1000) -> list[tuple[str, float]]:
        """Sessions not seen watched since ``cutoff`` (oldest first), with that time."""
        raw = cast(
            list[tuple[bytes, float]],
            await self.r.zrangebyscore(
                self.sessions_key, "-inf", cutoff, start=0, num=limit, withscores=True
            ),
        )
        return [(_text(member), float(score)) for member, score in raw]

    async def go_idle_if_unwatched(self, session_id: str, now: float | None = None) -> bool:
        """Flip an active session to idle if no viewer is attached; True if it flipped. A
        session found watched (or whose viewers just died) is marked seen now instead."""
        now = time.time() if now is None else now
        flipped = await self._idle_if_unwatched(
            keys=self._lifetime_keys(session_id), args=[session_id, repr(now)]
        )
        return bool(flipped)

    async def claim_close(
        self, session_id: str, unwatched_before: float, now: float | None = None
    ) -> bool:
        """True for exactly one caller when the session has had no viewer since
        ``unwatched_before`` (it leaves the lifetime index)."""
        now = time.time() if now is None else now
        claimed = await self._claim_close(
            keys=self._lifetime_keys(session_id)[:3],
            args=[session_id, repr(now), repr(unwatched_before)],
        )
        return bool(claimed)

    async def tracked(self) -> list[str]:
        members = cast(list[bytes], await self.r.zrange(self.sessions_key, 0, -1))
        return [_text(m) for m in members]

    # -- per-key limits ---------------------------------------------------------------------------
    async def reserve_session(self, key_name: str, session_id: str, limit: int) -> bool:
        """Count ``session_id`` against the key's open sessions unless that makes more than
        ``limit``; False (and nothing written) when the key is at its limit."""
        ok = await self._reserve(keys=[self.key_sessions_key(key_name)], args=[limit, session_id])
        return bool(ok)

    async def release_session(self, key_name: str, session_id: str) -> None:
        await self.r.srem(self.key_sessions_key(key_name), session_id)

    async def key_sessions(self, key_name: str) -> list[str]:
        return sorted(
            m.decode() if isinstance(m, bytes) else m
            for m in await self.r.smembers(self.key_sessions_key(key_name))
        )

    async def take_request(
        self, key_name: str, per_s: float, burst: int, now: float | None = None
    ) -> RateVerdict:
        now = time.time() if now is None else now
        allowed, wait_ms = await self._rate(
            keys=[self.rate_key(key_name)], args=[repr(now), repr(1.0 / per_s), burst]
        )
        return RateVerdict(bool(allowed), int(wait_ms) / 1000.0)

    # -- chunk latency, for the dashboard ---------------------------------------------------------
    async def record_latency(self, worst: dict[tuple[str, int], float]) -> None:
        """Merge per (worker, unix second) worst chunk latencies (ms): each bucket keeps the
        largest value any gateway reported."""
        if not worst:
            return
        async with self.r.pipeline(transaction=False) as pipe:
            for (worker_id, second), ms in worst.items():
                pipe.zadd(self.latency_key(worker_id), {str(second): ms}, gt=True)
                pipe.expire(self.latency_key(worker_id), _LATENCY_KEEP_S)
            await pipe.execute()

    async def latency_series(
        self, worker_ids: list[str], since: int
    ) -> dict[str, list[tuple[int, float]]]:
        """Per worker: (unix second, worst ms) from ``since`` on, oldest first."""
        if not worker_ids:
            return {}
        async with self.r.pipeline(transaction=False) as pipe:
            for wid in worker_ids:
                pipe.zrange(self.latency_key(wid), 0, -1, withscores=True)
            raw = await pipe.execute()
        out: dict[str, list[tuple[int, float]]] = {}
        expired: dict[str, list[bytes]] = {}
        oldest_kept = int(time.time()) - _LATENCY_KEEP_S
        for wid, entries in zip(worker_ids, raw, strict=True):
            points = sorted((int(m), float(s)) for m, s in entries if int(m) >= since)
            if points:
                out[wid] = points
            stale = [m for m, _ in entries if int(m) < oldest_kept]
            if stale:
                expired[wid] = stale
        if expired:  # buckets age out here: the key itself lives on while chunks flow
            async with self.r.pipeline(transaction=False) as pipe:
                for wid, members in expired.items():
                    pipe.zrem(self.latency_key(wid), *members)
                await pipe.execute()
        return out
