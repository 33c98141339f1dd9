"""The Redis registry: sessions, the placement map and workers.

Keys (``ns`` = ``TURBOSERVE_REDIS_NAMESPACE``):

- ``{ns}:session:{id}``   hash: state, owner, epoch, prompt, seed, input, strength, last_seq,
                          created_at, updated_at
- ``{ns}:session:{id}:recovery``  hash: what rebuilds the session after its last chunk (written
                          with ``last_seq`` by its owner; deleted when the session ends)
- ``{ns}:placement``      hash: session id -> worker id, for every session that has an owner
- ``{ns}:pending``        sorted set: sessions waiting for a worker, by time
- ``{ns}:worker:{id}``    hash: status, capacity, device, gpu_kind, chunk_ms, memory, updated_at
- ``{ns}:worker:{id}:alive``  key with a TTL, refreshed by each heartbeat
- ``{ns}:workers``        set of known worker ids
- ``{ns}:operator_drains`` hash: worker id -> ``hold`` (an operator drained it and keeps it) or
                          ``stop`` (drained to be given back), until undrained or gone
- ``{ns}:pool``           hash: the pool's limits as the provisioner enforces them (min_workers,
                          max_workers, backend), for admission control and operators
- ``{ns}:cluster_events`` list (newest first, capped): migrations and scale events, as JSON
- ``{ns}:counters``       hash: operator counters (migrations, scale events, peak GPUs)

Read here, owned by the gateways (``services/gateway/store.py``): ``{ns}:gw:activity``, each
open session's ``active``, ``idle`` (no viewer) or ``paused`` (by its client); and the leader
lease (``shared/leader.py``), which workers check commands against (:meth:`Registry.fencing`).

Every ownership or state change is one Lua script: it checks the expected epoch and the allowed
source states, then writes the session, the placement map and the pending set together. The
epoch grows by one on every ownership change, and a worker's writes carry the epoch it was given,
so a worker whose session was taken away (fenced) can no longer write: two workers can never both
own a session.

An assignment's claim and the worker's check of it are one round trip each: the scheduler's
:meth:`Registry.place` reads and claims the session in one script, which returns the record it
wrote (as every change does); the worker's :meth:`Registry.fencing` reads the leading term and
the session's owner and epoch in another.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, cast

import orjson
import redis.asyncio as aioredis

from shared.leader import leader_key
from shared.logging import get_logger
from shared.states import IllegalTransition, SessionState, sources_of
from shared.wire import DEFAULT_STRENGTH, SessionInput, WorkerStatus

KEEP: Final = object()  # sentinel: leave the owner as it is

# Terminated sessions stay readable this long, then Redis forgets them.
TERMINATED_TTL_S = 3600
# A session's recovery log outlives a silent worker this long (renewed by every chunk).
RECOVERY_TTL_S = 3600
# Cluster events kept for operators (``/v1/cluster``, ``turboserve ctl status``).
CLUSTER_EVENTS_KEPT = 200

_TRANSITION_LUA = """
if ARGV[9] ~= '' and redis.call('GET', KEYS[4]) ~= ARGV[9] then return {'guard', '', ''} end
local cur = redis.call('HMGET', KEYS[1], 'state', 'epoch', 'owner')
if not cur[1] then return {'missing', '', ''} end
if ARGV[2] ~= '' and cur[2] ~= ARGV[2] then return {'epoch', cur[2], cur[1]} end
local allowed = false
for s in string.gmatch(ARGV[3], '[^,]+') do
  if s == cur[1] then allowed = true end
end
if not allowed then return {'state', cur[2], cur[1], redis.call('HGETALL', KEYS[1])} end
local epoch = tonumber(cur[2])
if ARGV[7] == '1' then epoch = epoch + 1 end
local owner = cur[3] or ''
if ARGV[5] ~= '\\0keep' then owner = ARGV[5] end
redis.call('HSET', KEYS[1], 'state', ARGV[4], 'epoch', epoch, 'owner', owner, 'updated_at', ARGV[6])
if ARGV[4] == 'terminated' or owner == '' then
  redis.call('HDEL', KEYS[2], ARGV[1])
else
  redis.call('HSET', KEYS[2], ARGV[1], owner)
end
if ARGV[4] == 'pending' then
  redis.call('ZADD', KEYS[3], ARGV[6], ARGV[1])
else
  redis.call('ZREM', KEYS[3], ARGV[1])
end
if ARGV[4] == 'terminated' then
  redis.call('EXPIRE', KEYS[1], ARGV[8])
  redis.call('DEL', KEYS[5])
end
return {'ok', tostring(epoch), ARGV[4], redis.call('HGETALL', KEYS[1])}
"""

# What a worker checks a command against, in one step: the term that leads the scheduling (the
# digits before the lease's ':'), and the session's state, owner and epoch.
_FENCING_LUA = """
local lead = redis.call('GET', KEYS[1])
local term = ''
if lead then term = string.match(lead, '^(%d+):') or string.match(lead, '^(%d+)$') or '' end
if KEYS[2] == nil then return {term} end
local cur = redis.call('HMGET', KEYS[2], 'state', 'owner', 'epoch')
if not cur[1] then return {term} end
return {term, cur[1], cur[2] or '', cur[3]}
"""

# Create only if absent: a MULTI would not abort after a failed HSETNX and would overwrite.
_CREATE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[2])
return 1
"""

OPERATOR_DRAIN_MODES: Final = ("hold", "stop")

# A lost worker's record: status lost, no sessions, an expiry; only if it still exists.
_MARK_LOST = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'sessions', '[]', 'suspended', '[]',
           'active', 0, 'waiting', 0, 'updated_at', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('DEL', KEYS[2])
return 1
"""
# An id whose record expired leaves the set of workers, unless it registered again meanwhile.
_FORGET_EXPIRED = """
if redis.call('EXISTS', KEYS[2]) == 0 then redis.call('SREM', KEYS[1], ARGV[1]) end
return 1
"""

# A worker records its progress only while it still owns the session at its epoch.
_PROGRESS_LUA = """
local cur = redis.call('HMGET', KEYS[1], 'state', 'epoch', 'owner', 'last_seq')
if not cur[1] then return -1 end
if cur[3] ~= ARGV[1] or cur[2] ~= ARGV[2] or cur[1] == 'terminated' then
  return 0
end
if tonumber(ARGV[3]) > tonumber(cur[4]) then
  redis.call('HSET', KEYS[1], 'last_seq', ARGV[3], 'updated_at', ARGV[4])
  if #ARGV > 5 then
    redis.call('DEL', KEYS[2])
    redis.call('HSET', KEYS[2], unpack(ARGV, 6))
    redis.call('EXPIRE', KEYS[2], ARGV[5])
  end
end
return 1
"""


# Put back a session record that Redis lost (restarted empty), as its owner knows it; nothing
# is written when the record exists (the registry's own state always wins).
_REANNOUNCE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
"""


async def written(
    client: aioredis.Redis,
    script: Any,
    keys: list[str],
    args: list[Any],
    wait_replicas: int,
    wait_ms: int,
) -> Any:
    """``script``'s reply; with ``wait_replicas`` > 0, once that many replicas have its write,
    waited for on the write's own connection (``WAIT``), for at most ``wait_ms``. A write not
    replicated in time is kept, and logged (``registry_write_unreplicated``, its first key)."""
    if wait_replicas <= 0:
        return await script(keys=keys, args=args)
    async with client.pipeline(transaction=False) as pipe:
        await script(keys=keys, args=args, client=pipe)
        await pipe.execute_command("WAIT", wait_replicas, wait_ms)
        reply, acked = await pipe.execute()
    if int(acked) < wait_replicas:
        log.warning(
            "registry_write_unreplicated",
            key=keys[0],
            replicas=int(acked),
            wanted=wait_replicas,
            waited_ms=wait_ms,
        )
    return reply


class RegistryError(RuntimeError):
    retryable = False


class SessionNotFound(RegistryError):
    def __init__(self, session_id: str) -> None:
        super().__init__(f"no session {session_id!r}")
        self.session_id = session_id


class SessionExists(RegistryError):
    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} already exists")
        self.session_id = session_id


class GuardFailed(RegistryError):
    """The caller's guard (e.g. its scheduler leadership) no longer holds: nothing written."""

    def __init__(self, key: str) -> None:
        super().__init__(f"guard {key!r} no longer holds")
        self.key = key


class StaleEpoch(RegistryError):
    """The session moved on (another owner or state change) since the caller last read it."""

    def __init__(self, session_id: str, expected: int, actual: int) -> None:
        super().__init__(
            f"session {session_id!r}: expected epoch {expected}, registry has {actual}"
        )
        self.session_id = session_id
        self.expected = expected
        self.actual = actual


@dataclass(frozen=True, slots=True)
class SessionRecord:
    id: str
    state: SessionState
    owner: str | None
    epoch: int
    prompt: str
    seed: int
    last_seq: int
    created_at: float
    updated_at: float
    token_hash: str = ""  # never shown: to_public leaves it out
    owner_key: str = ""
    input: SessionInput = SessionInput.TEXT  # what the session generates from
    strength: float | None = None  # a video session's strength (None: the model's default)

    @property
    def effective_strength(self) -> float | None:
        """A video session's strength, the model's default when none was set; None for text."""
        if self.input is not SessionInput.VIDEO:
            return None
        return DEFAULT_STRENGTH if self.strength is None else self.strength

    def to_public(self) -> dict[str, object]:
        return {
            "id": self.id,
            "state": str(self.state),
            "worker_id": self.owner,
            "epoch": self.epoch,
            "prompt": self.prompt,
            "seed": self.seed,
            "input": str(self.input),
            "strength": self.effective_strength,
            "last_seq": self.last_seq,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
        }


@dataclass(frozen=True, slots=True)
class Placed:
    """A placement's claim: ``won`` when the session was pending and is now the worker's,
    ``record`` as it is after the claim, or as found when it was not pending (None: no such
    session)."""

    won: bool
    record: SessionRecord | None


@dataclass(frozen=True, slots=True)
class Fencing:
    """What a worker checks a command against, read in one step: the term that leads the
    scheduling (None: nobody leads) and the session's owner and epoch (``found`` False: no
    such session, or none asked for)."""

    term: int | None
    found: bool = False
    owner: str | None = None
    epoch: int = 0


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    id: str
    status: WorkerStatus
    capacity: int
    device: str = "cpu"
    gpu_kind: str = "cpu"
    alive: bool = False
    active: int = 0
    chunk_ms: dict[int, float] = field(default_factory=dict)
    mem_free_bytes: int | None = None
    updated_at: float = 0.0
    sessions: tuple[str, ...] = ()  # every session it holds (executing and suspended)
    suspended: tuple[str, ...] = ()
    waiting: int = 0  # sessions ahead of playback, sitting out of the batch
    pass_ms: dict[int, float] = field(default_factory=dict)
    keeping_pace: bool = True
    emulated: str = ""  # the GPU kind it emulates, empty when real
    handoff_addr: str = ""
    # The quality budget: the denoising steps per chunk in force and the model's full count
    # (0: not reported).
    steps: int = 0
    full_steps: int = 0
    # Chunks it made but could not publish since it started (its viewers were told of each).
    chunks_unpublished: int = 0


@dataclass(frozen=True, slots=True)
class PoolLimits:
    min_workers: int
    max_workers: int
    backend: str = "local"


def _str(value: bytes | str) -> str:
    """A Redis value or key that is there: as text."""
    return value.decode() if isinstance(value, bytes) else value


log = get_logger("turboserve.registry")


class Registry:
    """Async access to the registry; one instance per service, sharing its Redis client.

    ``wait_replicas``: a session's creation, every transition (the compare-and-set that
    fences owners by epoch) and a lost record's write-back (:meth:`reannounce_session`,
    :meth:`restore_pending`) wait, on the write's own connection (``WAIT``), until that many
    replicas have it, for at most ``wait_ms``; a write not replicated in time is kept and
    logged (``registry_write_unreplicated``). A Sentinel failover then promotes a replica
    that has it. 0: no wait (one Redis, or a replica's lag accepted). A session's progress
    (``last_seq``, its recovery log) does not wait: it is written with every chunk, and the
    next chunk writes it again."""

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
        self._create = client.register_script(_CREATE_LUA)
        self._transition = client.register_script(_TRANSITION_LUA)
        self._progress = client.register_script(_PROGRESS_LUA)
        self._reannounce = client.register_script(_REANNOUNCE_LUA)
        self._fencing = client.register_script(_FENCING_LUA)

    # -- keys ---------------------------------------------------------------------------------
    def session_key(self, session_id: str) -> str:
        return f"{self.ns}:session:{session_id}"

    def recovery_key(self, session_id: str) -> str:
        return f"{self.ns}:session:{session_id}:recovery"

    @property
    def placement_key(self) -> str:
        return f"{self.ns}:placement"

    @property
    def pending_key(self) -> str:
        return f"{self.ns}:pending"

    def worker_key(self, worker_id: str) -> str:
        return f"{self.ns}:worker:{worker_id}"

    def alive_key(self, worker_id: str) -> str:
        return f"{self.ns}:worker:{worker_id}:alive"

    @property
    def workers_key(self) -> str:
        return f"{self.ns}:workers"

    # -- sessions -----------------------------------------------------------------------------
    async def create_session(
        self,
        session_id: str,
        prompt: str,
        seed: int,
        *,
        token_hash: str = "",
        owner_key: str = "",
        input: SessionInput = SessionInput.TEXT,
        strength: float | None = None,
    ) -> SessionRecord:
        """Create a pending session; :class:`SessionExists` (and nothing written) if the id is taken.

        ``token_hash``: a digest of the session's client token (the token itself is never
        stored); ``owner_key``: the name of the API key that created it; ``input`` and
        ``strength``: what it generates from (a video session's strength, None: the model's
        default)."""
        now = time.time()
        record = {
            "id": session_id,
            "state": SessionState.PENDING.value,
            "owner": "",
            "epoch": 0,
            "prompt": prompt,
            "seed": seed,
            "input": input.value,
            "strength": _strength_field(strength),
            "last_seq": -1,
            "created_at": now,
            "updated_at": now,
            "token_hash": token_hash,
            "owner_key": owner_key,
        }
        flat = [str(x) for kv in record.items() for x in kv]
        created = await self._written(
            self._create,
            [self.session_key(session_id), self.pending_key],
            [repr(now), session_id, *flat],
        )
        if not created:
            raise SessionExists(session_id)
        return _session_from(record)

    async def get_session(self, session_id: str) -> SessionRecord | None:
        raw = await self.r.hgetall(self.session_key(session_id))
        if not raw or b"state" not in raw:
            return None
        return _session_from({_str(k): _str(v) for k, v in raw.items()})

    async def session_owner(self, session_id: str) -> tuple[str, int] | None:
        """The session's owner (``""``: none) and epoch, in one small read; None: no such
        session."""
        owner, epoch = await self.r.hmget(self.session_key(session_id), ["owner", "epoch"])
        if epoch is None:
            return None
        return (_str(owner) if owner else ""), int(epoch)

    async def transition(
        self,
        session_id: str,
        target: SessionState,
        *,
        expected_epoch: int | None = None,
        owner: object = KEEP,
        bump_epoch: bool = True,
        guard: tuple[str, str] | None = None,
    ) -> SessionRecord:
        """Atomically move a session to ``target`` (compare-and-set on state and epoch).

        ``owner``: a worker id, ``None`` to clear it, or :data:`KEEP`. ``guard``: a
        ``(key, value)`` that must hold in the same step (a scheduler's leadership), else
        :class:`GuardFailed`. Raises :class:`SessionNotFound`, :class:`StaleEpoch` or
        :class:`IllegalTransition`. One round trip: the script returns the record it wrote.
        """
        status, record = await self._move(
            session_id, target, sources_of(target), expected_epoch, owner, bump_epoch, guard
        )
        if status == "state":
            raise IllegalTransition(record.state, target)
        return record

    async def claim(
        self,
        session_id: str,
        worker_id: str,
        expected_epoch: int,
        guard: tuple[str, str] | None = None,
    ) -> SessionRecord:
        """Give a pending (or re-placed) session to ``worker_id``; exactly one claimant wins."""
        return await self.transition(
            session_id,
            SessionState.EXECUTING,
            expected_epoch=expected_epoch,
            owner=worker_id,
            guard=guard,
        )

    async def place(
        self, session_id: str, worker_id: str, guard: tuple[str, str] | None = None
    ) -> Placed:
        """A placement's read and claim in one step: a pending session goes to ``worker_id``
        (its epoch + 1, whatever it was); any other is left as it is and returned as found,
        for the caller to decide. Raises :class:`GuardFailed` (nothing written)."""
        pending = frozenset({SessionState.PENDING})
        try:
            status, record = await self._move(
                session_id, SessionState.EXECUTING, pending, None, worker_id, True, guard
            )
        except SessionNotFound:
            return Placed(won=False, record=None)
        return Placed(won=status == "ok", record=record)

    async def _move(
        self,
        session_id: str,
        target: SessionState,
        sources: Iterable[SessionState],
        expected_epoch: int | None,
        owner: object,
        bump_epoch: bool,
        guard: tuple[str, str] | None,
    ) -> tuple[str, SessionRecord]:
        """The transition script: ``("ok", record written)`` or ``("state", record as found)``
        when its state is not one of ``sources``; the other refusals raise."""
        allowed = ",".join(sorted(s.value for s in sources))
        owner_arg = "\0keep" if owner is KEEP else str(owner or "")
        guard_key, guard_value = guard if guard is not None else (self.pending_key, "")
        reply = await self._written(
            self._transition,
            [
                self.session_key(session_id),
                self.placement_key,
                self.pending_key,
                guard_key,
                self.recovery_key(session_id),
            ],
            [
                session_id,
                "" if expected_epoch is None else str(expected_epoch),
                allowed,
                target.value,
                owner_arg,
                repr(time.time()),
                "1" if bump_epoch else "0",
                TERMINATED_TTL_S,
                guard_value,
            ],
        )
        status = _str(reply[0])
        if status == "guard":
            raise GuardFailed(guard_key)
        if status == "missing":
            raise SessionNotFound(session_id)
        if status == "epoch":
            raise StaleEpoch(session_id, expected_epoch or 0, int(_str(reply[1])))
        flat = [_str(x) for x in reply[3]]
        return status, _session_from(dict(zip(flat[0::2], flat[1::2], strict=True)))

    async def _written(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """``script``'s reply; with ``wait_replicas``, once that many replicas have its write
        (or ``wait_ms`` passed: logged, the write kept)."""
        return await written(self.r, script, keys, args, self.wait_replicas, self.wait_ms)

    async def fencing(self, session_id: str | None = None) -> Fencing:
        """The term that leads the scheduling and ``session_id``'s owner and epoch, read in
        one step (a worker checks each command against them)."""
        keys = [leader_key(self.ns)]
        if session_id is not None:
            keys.append(self.session_key(session_id))
        raw = [_str(x) for x in await self._fencing(keys=keys, args=[])]
        term = int(raw[0]) if raw[0] else None
        if len(raw) == 1:
            return Fencing(term)
        return Fencing(term, found=True, owner=raw[2] or None, epoch=int(raw[3]))

    async def record_progress(
        self,
        session_id: str,
        worker_id: str,
        epoch: int,
        seq: int,
        recovery: Mapping[str, bytes | str] | None = None,
    ) -> bool:
        """Record ``seq`` as generated; False when the worker no longer owns the session.

        ``recovery``: what rebuilds the session after that chunk (the worker's recovery log),
        written in the same step, so the log and ``last_seq`` always agree."""
        args: list[bytes | str] = [worker_id, str(epoch), str(seq), repr(time.time())]
        if recovery:
            args.append(str(RECOVERY_TTL_S))
            for key, value in recovery.items():
                args += [key, value]
        ok = await self._progress(
            keys=[self.session_key(session_id), self.recovery_key(session_id)],
            args=args,
        )
        if ok == -1:
            # No record at all: Redis lost it (restarted empty), not another owner. The owner
            # keeps the session and puts its record back (``reannounce_session``).
            return True
        return bool(ok)

    async def missing_sessions(self, session_ids: list[str]) -> list[str]:
        """Those of ``session_ids`` the registry has no record of (e.g. Redis restarted)."""
        if not session_ids:
            return []
        async with self.r.pipeline(transaction=False) as pipe:
            for sid in session_ids:
                pipe.exists(self.session_key(sid))
            found = await pipe.execute()
        return [sid for sid, there in zip(session_ids, found, strict=True) if not there]

    async def reannounce_session(
        self,
        session_id: str,
        *,
        owner: str,
        epoch: int,
        state: SessionState,
        prompt: str,
        seed: int,
        last_seq: int,
        token_hash: str = "",
        owner_key: str = "",
        input: SessionInput = SessionInput.TEXT,
        strength: float | None = None,
    ) -> bool:
        """Write back a session its owner holds but the registry lost (True when written)."""
        now = time.time()
        record = {
            "id": session_id,
            "state": state.value,
            "owner": owner,
            "epoch": epoch,
            "prompt": prompt,
            "seed": seed,
            "input": input.value,
            "strength": _strength_field(strength),
            "last_seq": last_seq,
            "created_at": now,
            "updated_at": now,
            "token_hash": token_hash,
            "owner_key": owner_key,
        }
        flat = [str(x) for kv in record.items() for x in kv]
        done = await self._written(
            self._reannounce,
            [self.session_key(session_id), self.placement_key],
            [session_id, owner, *flat],
        )
        return bool(done)

    async def restore_pending(self, record: SessionRecord) -> bool:
        """Write back a session waiting for a worker that the registry lost (Redis restarted
        empty, or a failover lost its write), as ``record`` had it: pending, with no owner,
        its epoch and its client's token digest. Nothing is written when the registry has the
        session (its own state always wins); True when written."""
        fields = {
            "id": record.id,
            "state": SessionState.PENDING.value,
            "owner": "",
            "epoch": record.epoch,
            "prompt": record.prompt,
            "seed": record.seed,
            "input": record.input.value,
            "strength": _strength_field(record.strength),
            "last_seq": record.last_seq,
            "created_at": repr(record.created_at),
            "updated_at": repr(time.time()),
            "token_hash": record.token_hash,
            "owner_key": record.owner_key,
        }
        flat = [str(x) for kv in fields.items() for x in kv]
        done = await self._written(
            self._create,
            [self.session_key(record.id), self.pending_key],
            [repr(record.created_at), record.id, *flat],
        )
        return bool(done)

    async def sessions(self, session_ids: list[str]) -> dict[str, SessionRecord]:
        """The records of those of ``session_ids`` the registry has, in one round trip."""
        if not session_ids:
            return {}
        async with self.r.pipeline(transaction=False) as pipe:
            for sid in session_ids:
                pipe.hgetall(self.session_key(sid))
            found = await pipe.execute()
        return {
            sid: _session_from({_str(k): _str(v) for k, v in raw.items()})
            for sid, raw in zip(session_ids, found, strict=True)
            if raw and b"state" in raw
        }

    async def recovery_log(self, session_id: str) -> dict[str, bytes] | None:
        """The session's recovery log as its worker last wrote it (None: none)."""
        raw = cast(dict[bytes, bytes], await self.r.hgetall(self.recovery_key(session_id)))
        return {_str(k): v for k, v in raw.items()} if raw else None

    async def set_prompt(
        self, session_id: str, prompt: str, *, strength: float | None = None
    ) -> None:
        """The session's prompt, and with ``strength`` (a video session's) its strength."""
        mapping: dict[str, str] = {"prompt": prompt, "updated_at": repr(time.time())}
        if strength is not None:
            mapping["strength"] = _strength_field(strength)
        await self.r.hset(self.session_key(session_id), mapping=cast(Any, mapping))

    async def placement(self) -> dict[str, str]:
        raw = await self.r.hgetall(self.placement_key)
        return {_str(k): _str(v) for k, v in raw.items()}

    async def pending_sessions(self) -> list[str]:
        members = cast(list[bytes], await self.r.zrange(self.pending_key, 0, -1))
        return [_str(m) for m in members]

    @property
    def activity_key(self) -> str:
        return f"{self.ns}:gw:activity"

    async def unwatched(self, session_ids: list[str]) -> set[str]:
        """Those of ``session_ids`` that the gateways hold idle (no viewer) or paused (by its
        client): sessions that wait for nobody, not for a worker."""
        if not session_ids:
            return set()
        raw = cast(list[bytes | None], await self.r.hmget(self.activity_key, session_ids))
        return {
            sid
            for sid, value in zip(session_ids, raw, strict=True)
            if value is not None and _str(value) in ("idle", "paused")
        }

    # -- workers ------------------------------------------------------------------------------
    async def register_worker(self, worker: WorkerRecord, ttl_s: float) -> None:
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.sadd(self.workers_key, worker.id)
            pipe.hset(self.worker_key(worker.id), mapping=cast(Any, _worker_fields(worker)))
            # A worker declared lost that beats again (it was only cut off) is kept for good.
            pipe.persist(self.worker_key(worker.id))
            pipe.set(self.alive_key(worker.id), "1", px=int(ttl_s * 1000))
            await pipe.execute()

    async def heartbeat(self, worker: WorkerRecord, ttl_s: float) -> None:
        """Refresh the worker's record and its liveness TTL."""
        await self.register_worker(worker, ttl_s)

    async def set_worker_status(self, worker_id: str, status: WorkerStatus) -> None:
        await self.r.hset(
            self.worker_key(worker_id), mapping={"status": status.value, "updated_at": time.time()}
        )

    async def mark_worker_lost(self, worker_id: str, shown_s: float) -> bool:
        """The scheduler declared ``worker_id`` lost: its record says ``lost``, holds no
        sessions, and expires after ``shown_s`` (every view drops it then). Nothing happens
        to a record that is already gone (a worker that removed itself on a clean stop);
        False then."""
        marked = await self.r.eval(
            _MARK_LOST,
            2,
            self.worker_key(worker_id),
            self.alive_key(worker_id),
            WorkerStatus.LOST.value,
            repr(time.time()),
            str(max(1, int(shown_s * 1000))),
        )
        return bool(marked)

    @property
    def operator_drains_key(self) -> str:
        return f"{self.ns}:operator_drains"

    async def set_operator_drain(self, worker_id: str, mode: str) -> None:
        """An operator drains ``worker_id``: ``hold`` keeps it (empty, out of placement) until
        undrained, ``stop`` gives it back once empty. The scheduler reads it every tick."""
        if mode not in OPERATOR_DRAIN_MODES:
            raise ValueError(f"drain mode must be one of {OPERATOR_DRAIN_MODES}, not {mode!r}")
        await self.r.hset(self.operator_drains_key, worker_id, mode)

    async def clear_operator_drain(self, worker_id: str) -> None:
        await self.r.hdel(self.operator_drains_key, worker_id)

    async def operator_drains(self) -> dict[str, str]:
        raw = await self.r.hgetall(self.operator_drains_key)
        return {_str(k): _str(v) for k, v in raw.items()}

    async def remove_worker(self, worker_id: str) -> None:
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.srem(self.workers_key, worker_id)
            pipe.delete(self.worker_key(worker_id), self.alive_key(worker_id))
            await pipe.execute()

    # -- pool and cluster events ----------------------------------------------------------------
    @property
    def pool_key(self) -> str:
        return f"{self.ns}:pool"

    @property
    def cluster_events_key(self) -> str:
        return f"{self.ns}:cluster_events"

    async def set_pool_limits(self, limits: PoolLimits) -> None:
        await self.r.hset(
            self.pool_key,
            mapping={
                "min_workers": limits.min_workers,
                "max_workers": limits.max_workers,
                "backend": limits.backend,
            },
        )

    async def pool_limits(self) -> PoolLimits | None:
        raw = await self.r.hgetall(self.pool_key)
        if not raw:
            return None
        d = {_str(k): _str(v) for k, v in raw.items()}
        return PoolLimits(int(d["min_workers"]), int(d["max_workers"]), d.get("backend", "local"))

    @property
    def scheduler_status_key(self) -> str:
        return f"{self.ns}:scheduler"

    async def set_scheduler_status(self, status: dict[str, object], ttl_s: float) -> None:
        """What the leading scheduler sees and aims for (rho_max, rho_hat, GPU target, leader),
        as JSON with a TTL, so that a dead scheduler's view does not linger."""
        await self.r.set(self.scheduler_status_key, orjson.dumps(status), px=int(ttl_s * 1000))

    async def scheduler_status(self) -> dict[str, object] | None:
        raw = await self.r.get(self.scheduler_status_key)
        return None if raw is None else orjson.loads(raw)

    @property
    def counters_key(self) -> str:
        return f"{self.ns}:counters"

    async def bump_counters(self, **deltas: int) -> None:
        """Add to operator counters (migrations, scale events, ...); they outlive any process."""
        async with self.r.pipeline(transaction=True) as pipe:
            for name, delta in deltas.items():
                pipe.hincrby(self.counters_key, name, delta)
            await pipe.execute()

    async def raise_counter(self, name: str, value: int) -> None:
        """Keep the largest value seen (a peak)."""
        await self.r.eval(
            "local v = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '-1') "
            "if tonumber(ARGV[2]) > v then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end "
            "return 1",
            1,
            self.counters_key,
            name,
            value,
        )

    async def counters(self) -> dict[str, int]:
        raw = await self.r.hgetall(self.counters_key)
        return {_str(k): int(v) for k, v in raw.items()}

    async def record_cluster_event(self, kind: str, **fields_: object) -> None:
        """Append an operator-visible event (``migration``, ``scale_out``, ``scale_in``, ...)."""
        entry = orjson.dumps({"kind": kind, "at": time.time(), **fields_})
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.lpush(self.cluster_events_key, entry)
            pipe.ltrim(self.cluster_events_key, 0, CLUSTER_EVENTS_KEPT - 1)
            await pipe.execute()

    async def cluster_events(self, limit: int = 50) -> list[dict[str, object]]:
        """The newest ``limit`` cluster events, newest first."""
        raw = await self.r.lrange(self.cluster_events_key, 0, max(0, limit - 1))
        return [orjson.loads(item) for item in raw]

    async def workers(self) -> list[WorkerRecord]:
        ids = sorted(_str(m) for m in await self.r.smembers(self.workers_key))
        if not ids:
            return []
        async with self.r.pipeline(transaction=False) as pipe:
            for wid in ids:
                pipe.hgetall(self.worker_key(wid))
                pipe.exists(self.alive_key(wid))
            raw = await pipe.execute()
        out, expired = [], []
        for wid, fields_, alive in zip(ids, raw[0::2], raw[1::2], strict=True):
            if fields_:
                out.append(
                    _worker_from(wid, {_str(k): _str(v) for k, v in fields_.items()}, bool(alive))
                )
            else:
                expired.append(wid)
        for wid in expired:  # a lost worker's record expired: its id goes too
            await self.r.eval(_FORGET_EXPIRED, 2, self.workers_key, self.worker_key(wid), wid)
        return out


def _session_from(d: dict[str, Any]) -> SessionRecord:
    return SessionRecord(
        id=str(d["id"]),
        state=SessionState(d["state"]),
        owner=d.get("owner") or None,
        epoch=int(d["epoch"]),
        prompt=str(d.get("prompt", "")),
        seed=int(d.get("seed", 0)),
        last_seq=int(d.get("last_seq", -1)),
        created_at=float(d["created_at"]),
        updated_at=float(d["updated_at"]),
        token_hash=str(d.get("token_hash") or ""),
        owner_key=str(d.get("owner_key") or ""),
        input=SessionInput(d.get("input") or SessionInput.TEXT.value),
        strength=float(d["strength"]) if d.get("strength") not in (None, "") else None,
    )


def _strength_field(strength: float | None) -> str:
    """A strength as the session hash keeps it (``""``: none set, the model's default)."""
    return "" if strength is None else repr(float(strength))


def _worker_fields(w: WorkerRecord) -> dict[str, str | bytes | int | float]:
    return {
        "status": w.status.value,
        "capacity": w.capacity,
        "device": w.device,
        "gpu_kind": w.gpu_kind,
        "active": w.active,
        "chunk_ms": orjson.dumps({str(k): v for k, v in w.chunk_ms.items()}),
        "mem_free_bytes": -1 if w.mem_free_bytes is None else w.mem_free_bytes,
        "updated_at": time.time(),
        "sessions": orjson.dumps(list(w.sessions)),
        "suspended": orjson.dumps(list(w.suspended)),
        "waiting": w.waiting,
        "pass_ms": orjson.dumps({str(k): v for k, v in w.pass_ms.items()}),
        "keeping_pace": int(w.keeping_pace),
        "emulated": w.emulated,
        "handoff_addr": w.handoff_addr,
        "steps": w.steps,
        "full_steps": w.full_steps,
        "chunks_unpublished": w.chunks_unpublished,
    }


def _worker_from(worker_id: str, d: dict[str, Any], alive: bool) -> WorkerRecord:
    mem = int(d.get("mem_free_bytes", -1))
    return WorkerRecord(
        id=worker_id,
        status=WorkerStatus(d.get("status", WorkerStatus.BOOTING.value)),
        capacity=int(d.get("capacity", 0)),
        device=d.get("device", "cpu"),
        gpu_kind=d.get("gpu_kind", "cpu"),
        alive=alive,
        active=int(d.get("active", 0)),
        chunk_ms={int(k): float(v) for k, v in orjson.loads(d.get("chunk_ms") or "{}").items()},
        mem_free_bytes=None if mem < 0 else mem,
        updated_at=float(d.get("updated_at", 0.0)),
        sessions=tuple(orjson.loads(d.get("sessions") or "[]")),
        suspended=tuple(orjson.loads(d.get("suspended") or "[]")),
        waiting=int(d.get("waiting", 0)),
        pass_ms={int(k): float(v) for k, v in orjson.loads(d.get("pass_ms") or "{}").items()},
        keeping_pace=d.get("keeping_pace", "1") != "0",
        emulated=d.get("emulated", ""),
        handoff_addr=d.get("handoff_addr", ""),
        steps=int(d.get("steps", 0)),
        full_steps=int(d.get("full_steps", 0)),
        chunks_unpublished=int(d.get("chunks_unpublished", 0)),
    )
