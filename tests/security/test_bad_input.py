"""Bad input on every NATS subject a service listens on, against the real services.

The four services run in-process on the real NATS and Redis (one mesh for the module, its own
subject prefix and Redis namespace), with one live session streaming to an SSE client the whole
time. Each test sends one subject's listeners garbage, truncated JSON, oversized payloads,
wrong-version and wrongly typed messages, then valid messages that are stale (an old epoch, a
term that does not lead, a session or worker that is not there), and asserts that:

- each bad message is logged and dropped (``bad_message_dropped`` with its subject) or refused
  (a reply with a stable code);
- no registry state changed (the namespace's Redis keys before and after, less what moves on
  its own: heartbeats, leases, the live session's progress);
- the service keeps serving: a normal request still works afterwards, the live session's
  stream goes on with every seq once and in order, and a new session streams end to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
import nats
import orjson
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from structlog.testing import capture_logs

from services.gateway.service import GatewayService
from services.gpu_worker.service import WorkerService
from services.provisioner.service import ProvisionerService
from services.scheduler.service import SchedulerService
from shared.leader import leader_key, parse_term
from shared.registry import Registry
from shared.runner import running
from shared.settings import GatewaySettings, ProvisionerSettings, SchedulerSettings, WorkerSettings
from shared.wire import (
    PROTOCOL_VERSION,
    Chunk,
    CommandReply,
    HandoffAnswer,
    HandoffOffer,
    HandoffOutcome,
    Heartbeat,
    MigrationReport,
    ProvisionerCmdKind,
    ProvisionerCommand,
    ProvisionerEvent,
    ProvisionerReply,
    SessionEvent,
    SessionEventKind,
    Subjects,
    TensorSpec,
    WorkerCmdKind,
    WorkerCommand,
    WorkerStatus,
    decode,
    encode,
)
from tests.eventually import eventually
from tools.launcher import Mesh
from tools.servers import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

API_KEY = "k-bad-input-0123456789"
WORKER = "wbad"
# Redis keys that change on their own while nothing happens (timers), not because of input.
VOLATILE_KEYS = ("scheduler", "scheduler:leader", "gw:replicas")
VOLATILE_PREFIXES = ("gw:latency:", "gw:rate:")
# A worker's record is rewritten by each heartbeat; these fields say what it holds and is.
WORKER_FIELDS = (
    b"status",
    b"capacity",
    b"device",
    b"gpu_kind",
    b"sessions",
    b"suspended",
    b"handoff_addr",
)
# A live session's progress, written with every chunk.
PROGRESS_FIELDS = (b"last_seq", b"updated_at")
# Gauges the scheduler's tick raises on its own.
VOLATILE_COUNTERS = (b"peak_gpus",)


# -- the mesh ----------------------------------------------------------------------------------


@dataclass
class Stream:
    """An SSE client of one session, reading in the background: every event, in order."""

    events: list[tuple[str, str, str]] = field(default_factory=list)  # (event, id, data)
    task: asyncio.Task[None] | None = None

    def chunk_seqs(self) -> list[int]:
        return [int(i) for e, i, _ in self.events if e == "chunk"]


@dataclass
class BadInputMesh:
    subjects: Subjects
    ns: str
    nc: Any  # a plain client: what a misbehaving or stale peer would send from
    redis: aioredis.Redis
    registry: Registry
    http: aiohttp.ClientSession
    worker: WorkerService
    live_id: str  # a session streaming the whole time
    live: Stream


async def _read_sse(resp: aiohttp.ClientResponse, stream: Stream) -> None:
    current: dict[str, str] = {}
    async for raw in resp.content:
        line = raw.decode(errors="replace").rstrip("\n")
        if not line:
            if current:
                stream.events.append(
                    (current.get("event", ""), current.get("id", ""), current.get("data", ""))
                )
            current = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "data" and "data" in current:  # an event's lines, joined as SSE says
                value = current["data"] + "\n" + value
            current[name] = value


async def _open_stream(http: aiohttp.ClientSession, sid: str, token: str) -> Stream:
    resp = await http.get(
        f"/v1/sessions/{sid}/stream",
        headers={"Authorization": f"Bearer {token}"},
        timeout=aiohttp.ClientTimeout(total=None, sock_read=None),
    )
    assert resp.status == 200, await resp.text()
    stream = Stream()
    stream.task = asyncio.create_task(_read_sse(resp, stream))
    stream.task.add_done_callback(lambda _: resp.release())
    return stream


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def mesh(infra: Mesh) -> AsyncIterator[BadInputMesh]:
    tag = "t" + uuid.uuid4().hex[:10]
    env = {
        "TURBOSERVE_NATS_URL": infra.nats_url,
        "TURBOSERVE_REDIS_URL": infra.redis_url,
        "TURBOSERVE_SUBJECT_PREFIX": tag,
        "TURBOSERVE_REDIS_NAMESPACE": tag,
        "TURBOSERVE_LOG_LEVEL": "warning",
        "TURBOSERVE_METRICS_PORT": "-1",
    }
    port = free_port()
    gateway = GatewaySettings.from_env(
        env, port=port, api_keys=f"alice:{API_KEY}", control_wait_s=5.0
    )
    # No autoscaling: the provisioner must never start a worker process of its own here.
    scheduler = SchedulerSettings.from_env(env, policy="no_autoscale", tick_s=0.2, max_workers=1)
    provisioner = ProvisionerSettings.from_env(env, min_workers=0, max_workers=1, gpus="none")
    worker_settings = WorkerSettings.from_env(
        env, worker_id=WORKER, preset="tiny", device="cpu", chunk_period_s=0.25
    )
    worker = WorkerService(worker_settings)
    redis = aioredis.from_url(infra.redis_url, socket_timeout=30)
    nc = await nats.connect(infra.nats_url)
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(running(SchedulerService(scheduler), scheduler))
        await stack.enter_async_context(running(ProvisionerService(provisioner), provisioner))
        await stack.enter_async_context(running(worker, worker_settings))
        await stack.enter_async_context(running(GatewayService(gateway), gateway))
        http = await stack.enter_async_context(aiohttp.ClientSession(f"http://127.0.0.1:{port}"))
        resp = await http.post(
            "/v1/sessions",
            json={"prompt": "a lighthouse", "seed": 7},
            headers={"Authorization": f"Bearer {API_KEY}"},
        )
        live = await resp.json()
        stream = await _open_stream(http, live["id"], live["token"])
        m = BadInputMesh(
            Subjects(tag), tag, nc, redis, Registry(redis, tag), http, worker, live["id"], stream
        )
        await eventually(lambda: len(stream.chunk_seqs()) >= 2, 30, "the live session streams")

        async def listed() -> bool:
            return live["id"] in text(await redis.hget(f"{tag}:worker:{WORKER}", "sessions"))

        await eventually(listed, 30, "the worker's record listing the live session")
        try:
            yield m
        finally:
            assert stream.task is not None
            stream.task.cancel()
            await asyncio.wait({stream.task}, timeout=5)
    js = nc.jetstream()
    for name in (Subjects(tag).sessions_stream, Subjects(tag).chunks_stream):
        with contextlib.suppress(Exception):
            await js.delete_stream(name)
    await nc.close()
    keys = [k async for k in redis.scan_iter(match=f"{tag}:*", count=500)]
    if keys:
        await redis.delete(*keys)
    await redis.aclose()


# -- what is compared, what is sent -----------------------------------------------------------


def text(reply: bytes | str | None) -> str:
    """A Redis reply as text (this client answers bytes)."""
    return reply.decode() if isinstance(reply, bytes) else reply or ""


async def registry_state(m: BadInputMesh) -> dict[str, Any]:
    """The namespace's keys and values, less what changes on its own (see the constants)."""
    out: dict[str, Any] = {}
    async for raw_key in m.redis.scan_iter(match=f"{m.ns}:*", count=500):
        key = raw_key.decode()
        name = key[len(m.ns) + 1 :]
        if name in VOLATILE_KEYS or name.startswith(VOLATILE_PREFIXES):
            continue
        if name == f"session:{m.live_id}:recovery":
            continue  # the live session's recovery log, rewritten with every chunk
        kind = text(await m.redis.type(key))
        value: Any
        if kind == "hash":
            value = await m.redis.hgetall(key)
            if name.startswith("worker:"):
                value = {f: v for f, v in value.items() if f in WORKER_FIELDS}
            elif name == f"session:{m.live_id}":
                value = {f: v for f, v in value.items() if f not in PROGRESS_FIELDS}
            elif name == "counters":
                value = {f: v for f, v in value.items() if f not in VOLATILE_COUNTERS}
                if not value:
                    continue
        elif kind == "string":
            value = await m.redis.get(key)
        elif kind == "set":
            value = sorted(await m.redis.smembers(key))
        elif kind == "zset":
            value = await m.redis.zrange(key, 0, -1, withscores=True)
        elif kind == "list":
            value = await m.redis.lrange(key, 0, -1)
        else:
            value = kind
        out[name] = value
    return out


def changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What differs between two registry states: key -> (before, after)."""
    return {
        k: (before.get(k), after.get(k))
        for k in sorted(before.keys() | after.keys())
        if before.get(k) != after.get(k)
    }


def assert_unchanged(before: dict[str, Any], after: dict[str, Any]) -> None:
    diff = changes(before, after)
    assert not diff, "\n".join(f"{k}:\n  before {b}\n  after  {a}" for k, (b, a) in diff.items())


def bad_variants(valid: msgspec.Struct, id_field: str) -> dict[str, bytes]:
    """Ways to get a message of ``valid``'s kind wrong; ``id_field`` is one of its id fields
    (ids are at most 128 characters: a huge one makes a near-limit payload invalid)."""
    raw = encode(valid)
    body = orjson.loads(raw)
    foreign = (
        SessionEvent(session_id="s1", kind=SessionEventKind.IDLE)
        if not isinstance(valid, SessionEvent)
        else Heartbeat(worker_id="w1", status=WorkerStatus.READY, capacity=1, active=0)
    )
    return {
        "garbage": b"\x00\xff\xfe not json at all \x01",
        "empty": b"",
        "not an object": b"[1, 2, 3]",
        "truncated": raw[: len(raw) // 2],
        "unknown type": orjson.dumps({**body, "type": "no_such_message"}),
        "another message": encode(foreign),  # valid, but not one this subject carries
        "wrong version": orjson.dumps({**body, "v": PROTOCOL_VERSION + 1}),
        "version as text": orjson.dumps({**body, "v": "1"}),
        "missing field": orjson.dumps({k: v for k, v in body.items() if k != id_field}),
        "id not a subject token": orjson.dumps({**body, id_field: "a b.*>"}),
        "oversized": orjson.dumps({**body, id_field: "x" * 900_000}),
    }


def dropped(logs: list[dict[str, Any]], subject: str) -> int:
    return sum(
        1 for e in logs if e.get("event") == "bad_message_dropped" and e.get("subject") == subject
    )


async def send_bad(
    m: BadInputMesh,
    logs: list[dict[str, Any]],
    subject: str,
    variants: dict[str, bytes],
    listeners: int,
) -> None:
    """Publish every variant on ``subject``; wait until each was dropped by every listener."""
    for payload in variants.values():
        await m.nc.publish(subject, payload)
    await m.nc.flush()
    want = len(variants) * listeners
    await eventually(lambda: dropped(logs, subject) >= want, 30, f"{want} drops on {subject}")
    await asyncio.sleep(0.3)  # nothing more arrives late
    assert dropped(logs, subject) == want


async def live_session(m: BadInputMesh) -> Any:
    record = await m.registry.get_session(m.live_id)
    assert record is not None and record.owner == WORKER and record.state.value == "executing"
    return record


async def assert_still_serving(m: BadInputMesh, since: int) -> None:
    """The live stream went on past ``since`` (its number of chunks then) with every seq once,
    in order; a new session streams end to end; the gateway is healthy."""
    await eventually(lambda: len(m.live.chunk_seqs()) >= since + 3, 30, "the live stream goes on")
    seqs = m.live.chunk_seqs()
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"gap or repeat in {seqs}"
    assert not [e for e in m.live.events if e[0] == "end"], "the live session ended"
    resp = await m.http.post(
        "/v1/sessions",
        json={"prompt": "after the bad input"},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert resp.status == 201, await resp.text()
    fresh = await resp.json()
    stream = await _open_stream(m.http, fresh["id"], fresh["token"])
    try:
        await eventually(lambda: stream.chunk_seqs()[:1] == [0], 30, "a new session streams")
    finally:
        assert stream.task is not None
        stream.task.cancel()
        await asyncio.wait({stream.task}, timeout=5)
    resp = await m.http.delete(
        f"/v1/sessions/{fresh['id']}", headers={"Authorization": f"Bearer {fresh['token']}"}
    )
    assert resp.status == 200
    assert (await m.http.get("/healthz")).status == 200
    await settle_closed(m, fresh["id"])


async def settle_closed(m: BadInputMesh, sid: str) -> None:
    """Wait until a closed session is gone from the worker and from its registry record (a
    heartbeat after the worker let it go rewrote the record), so that a registry comparison
    that starts now sees no change of its own making."""
    assert m.worker.generation is not None
    generation = m.worker.generation
    await eventually(lambda: sid not in generation.status().sessions, 30, "the worker lets it go")
    dropped_at = time.time()

    async def record_rewritten() -> bool:
        record = await m.redis.hmget(f"{m.ns}:worker:{WORKER}", ["updated_at", "sessions"])
        return float(record[0] or 0) > dropped_at and sid not in text(record[1])

    await eventually(
        record_rewritten, 30, "the worker's record without the closed session", interval=0.1
    )


async def request(
    m: BadInputMesh, subject: str, msg: msgspec.Struct, reply_type: Any, timeout: float = 10.0
) -> Any:
    reply = await m.nc.request(subject, encode(msg), timeout=timeout)
    return decode(reply.subject, reply.data, reply_type)


# -- one test per subject ----------------------------------------------------------------------


async def test_worker_command_subject(mesh):
    m = mesh
    subject = m.subjects.worker_cmd(WORKER)
    record = await live_session(m)
    since = len(m.live.chunk_seqs())
    before = await registry_state(m)
    valid = WorkerCommand(
        kind=WorkerCmdKind.PROMPT,
        worker_id=WORKER,
        epoch=record.epoch,
        session_id=m.live_id,
        prompt="hijacked",
    )
    with capture_logs() as logs:
        await send_bad(m, logs, subject, bad_variants(valid, "worker_id"), listeners=1)
        # Valid commands that are stale: each refused with its code, none acted on.
        raw = await m.redis.get(leader_key(m.ns))
        term = parse_term(raw)
        stale = {
            "stale_epoch": [
                WorkerCommand(
                    kind=kind,
                    worker_id=WORKER,
                    epoch=record.epoch - 1,
                    session_id=m.live_id,
                    prompt="hijacked",
                    seq=0,
                    target="wother",
                )
                for kind in (
                    WorkerCmdKind.ASSIGN,
                    WorkerCmdKind.PROMPT,
                    WorkerCmdKind.SUSPEND,
                    WorkerCmdKind.MIGRATE,
                    WorkerCmdKind.STOP,
                )
            ],
            "stale_leader": [
                WorkerCommand(
                    kind=WorkerCmdKind.STOP,
                    worker_id=WORKER,
                    epoch=record.epoch,
                    session_id=m.live_id,
                    term=term + 7,
                )
            ],
            "misaddressed": [
                WorkerCommand(
                    kind=WorkerCmdKind.STOP,
                    worker_id="wother",
                    epoch=record.epoch,
                    session_id=m.live_id,
                )
            ],
        }
        for code, commands in stale.items():
            for cmd in commands:
                reply = await request(m, subject, cmd, CommandReply)
                assert (reply.ok, reply.code) == (False, code), (cmd.kind, reply)
    assert_unchanged(before, await registry_state(m))
    assert (await live_session(m)).prompt == "a lighthouse"
    # a normal command is still answered
    reply = await request(
        m, subject, WorkerCommand(kind=WorkerCmdKind.UNDRAIN, worker_id=WORKER), CommandReply
    )
    assert reply.ok
    await assert_still_serving(m, since)


async def test_worker_handoff_subject(mesh):
    m = mesh
    subject = m.subjects.worker_handoff(WORKER, "wother")
    record = await live_session(m)
    since = len(m.live.chunk_seqs())
    before = await registry_state(m)
    offer = HandoffOffer(
        transfer_id="t1",
        session_id=m.live_id,
        epoch=record.epoch - 1,
        src="wother",
        dst=WORKER,
        transport="auto",
        tensors=[TensorSpec(shape=[4], dtype="float32")],
        nbytes=16,
        next_seq=0,
        prompt="p",
        seed=1,
        rendezvous={"store": "127.0.0.1:1", "new_link": "ab12", "tag": "0", "device": "cpu"},
        secret="ab" * 32,  # well-formed: a secret and a checksum (that nothing will match)
        checksum="cd" * 32,
    )
    with capture_logs() as logs:
        variants = bad_variants(offer, "session_id")
        await send_bad(m, logs, subject, variants, listeners=1)
        # sent as requests, a bad offer is refused at once, so its sender does not wait
        for payload in variants.values():
            reply = await m.nc.request(subject, payload, timeout=10)
            answer = decode(reply.subject, reply.data, HandoffAnswer)
            assert (answer.accepted, answer.code) == (False, "invalid_offer")
        # a well-formed offer at an old epoch, of a session this worker holds and that is not
        # migrating from its sender: refused
        answer = await request(m, subject, offer, HandoffAnswer)
        assert not answer.accepted and answer.code in ("exists", "stale_epoch"), answer
        # the same offer from a worker that is not its source (the subject names the sender):
        # refused before anything else is looked at
        forged = m.subjects.worker_handoff(WORKER, "wthird")
        answer = await request(m, forged, offer, HandoffAnswer)
        assert (answer.accepted, answer.code) == (False, "invalid_offer"), answer
        # an outcome for a transfer nobody started: dropped
        await m.nc.publish(
            subject,
            encode(
                HandoffOutcome(
                    transfer_id="never-started",
                    session_id=m.live_id,
                    committed=True,
                    epoch=record.epoch + 5,
                )
            ),
        )
        await eventually(
            lambda: any(e.get("event") == "late_outcome_dropped" for e in logs),
            30,
            "the stale outcome is dropped",
        )
    assert_unchanged(before, await registry_state(m))
    await assert_still_serving(m, since)


async def test_heartbeat_subject(mesh):
    m = mesh
    subject = m.subjects.worker_heartbeat("wghost")
    since = len(m.live.chunk_seqs())
    before = await registry_state(m)
    beat = Heartbeat(worker_id="wghost", status=WorkerStatus.READY, capacity=4, active=0)
    with capture_logs() as logs:
        # the scheduler and the provisioner both listen
        await send_bad(m, logs, subject, bad_variants(beat, "worker_id"), listeners=2)
        # stale: the last beat of a worker that is gone (long ago), and one of the live worker
        # from long ago that says it holds nothing (its session must not be taken from it)
        long_ago = time.time() - 3600
        for late in (
            Heartbeat(
                worker_id="wghost", status=WorkerStatus.GONE, capacity=4, active=0, at=long_ago
            ),
            Heartbeat(
                worker_id=WORKER,
                status=WorkerStatus.READY,
                capacity=8,
                active=0,
                sessions=[],
                at=long_ago,
            ),
        ):
            await m.nc.publish(m.subjects.worker_heartbeat(late.worker_id), encode(late))
        await m.nc.flush()
        await asyncio.sleep(1.0)  # the wait is the test: the stale ones change nothing meanwhile
        # In another worker's name: the live worker "gone", on the ghost's subject. Both
        # listeners drop it (a worker's NATS user could publish only on its own subject).
        forged = Heartbeat(worker_id=WORKER, status=WorkerStatus.GONE, capacity=8, active=0)
        await m.nc.publish(subject, encode(forged))
        await m.nc.flush()

        def mismatches() -> int:
            return sum(
                1
                for e in logs
                if e.get("event") == "worker_id_mismatch"
                and e.get("subject") == subject
                and e.get("claimed") == WORKER
            )

        await eventually(lambda: mismatches() >= 2, 30, "the forged beat dropped by both")
    assert_unchanged(before, await registry_state(m))
    await assert_still_serving(m, since)


async def test_provisioner_command_subject(mesh):
    m = mesh
    subject = m.subjects.provisioner_cmd
    since = len(m.live.chunk_seqs())
    before = await registry_state(m)
    start = ProvisionerCommand(kind=ProvisionerCmdKind.START, count=0, worker_ids=["wnew"])
    with capture_logs() as logs:
        variants = bad_variants(start, "command_id")
        variants["id not a subject token"] = orjson.dumps(
            {**orjson.loads(encode(start)), "worker_ids": ["a b.*>"]}
        )
        variants["oversized"] = orjson.dumps(
            {**orjson.loads(encode(start)), "worker_ids": ["x" * 900_000]}
        )
        variants["count over the limit"] = orjson.dumps(
            {**orjson.loads(encode(start)), "worker_ids": [], "count": 10**9}
        )
        del variants["missing field"]  # command_id is optional
        await send_bad(m, logs, subject, variants, listeners=1)
        # stale: stopping a worker that is not there changes nothing
        reply = await request(
            m,
            subject,
            ProvisionerCommand(
                kind=ProvisionerCmdKind.STOP, worker_ids=["wlong-gone"], command_id="old"
            ),
            ProvisionerReply,
        )
        assert reply.started == [] and reply.stopping == []
    assert_unchanged(before, await registry_state(m))
    # a normal request is still answered: start nothing new
    reply = await request(
        m, subject, ProvisionerCommand(kind=ProvisionerCmdKind.START, count=0), ProvisionerReply
    )
    assert reply.ok and reply.started == []
    await assert_still_serving(m, since)


async def test_provisioner_event_subject(mesh):
    m = mesh
    subject = m.subjects.provisioner_events
    since = len(m.live.chunk_seqs())
    before = await registry_state(m)
    event = ProvisionerEvent(worker_id="wghost", status=WorkerStatus.GONE, code="stopped")
    with capture_logs() as logs:
        # the scheduler and the worker both listen
        await send_bad(m, logs, subject, bad_variants(event, "worker_id"), listeners=2)
        # stale: a worker that was never there is reported gone, and booting long ago
        for late in (
            event,
            ProvisionerEvent(
                worker_id="wghost", status=WorkerStatus.BOOTING, at=time.time() - 3600
            ),
        ):
            await m.nc.publish(subject, encode(late))
        await m.nc.flush()
        await asyncio.sleep(1.0)  # the wait is the test: the stale ones change nothing meanwhile
    assert_unchanged(before, await registry_state(m))
    await assert_still_serving(m, since)


async def test_migration_report_subject(mesh):
    m = mesh
    subject = m.subjects.migrations(WORKER)
    record = await live_session(m)
    since = len(m.live.chunk_seqs())
    before = await registry_state(m)
    report = MigrationReport(
        session_id=m.live_id,
        src=WORKER,
        dst="wother",
        ok=True,
        command_id="never-sent",
        epoch=record.epoch - 1,
    )
    with capture_logs() as logs:
        await send_bad(m, logs, subject, bad_variants(report, "session_id"), listeners=1)
        # stale: a report nobody waits for (its command was never sent), at an old epoch
        await m.nc.publish(subject, encode(report))
        await m.nc.flush()
        await asyncio.sleep(1.0)  # the wait is the test: the stale ones change nothing meanwhile
    assert_unchanged(before, await registry_state(m))
    await assert_still_serving(m, since)


async def test_session_event_stream(mesh):
    m = mesh
    subject = m.subjects.session_events
    since = len(m.live.chunk_seqs())
    js = m.nc.jetstream()
    terminated = await m.http.post(
        "/v1/sessions", json={"prompt": "soon over"}, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    gone = await terminated.json()
    resp = await m.http.delete(
        f"/v1/sessions/{gone['id']}", headers={"Authorization": f"Bearer {gone['token']}"}
    )
    assert resp.status == 200
    await settle_closed(m, gone["id"])
    before = await registry_state(m)
    event = SessionEvent(session_id="sghost", kind=SessionEventKind.CREATED, prompt="p", seed=1)
    with capture_logs() as logs:
        variants = bad_variants(event, "session_id")
        for payload in variants.values():  # through JetStream, as the gateway publishes
            await js.publish(subject, payload)
        # each dropped once: the scheduler terminates it rather than have it redelivered
        await eventually(
            lambda: dropped(logs, subject) >= len(variants), 30, "drops of session events"
        )
        # stale: events about a session that does not exist, or that is over
        stale = [
            SessionEvent(session_id="sghost", kind=kind, prompt="p") for kind in SessionEventKind
        ]
        stale += [
            SessionEvent(session_id=gone["id"], kind=kind, prompt="again", seed=1)
            for kind in SessionEventKind
        ]
        for late in stale:
            await js.publish(subject, encode(late))

        async def all_handled() -> bool:  # the scheduler acks an event once it has handled it
            info = await js.consumer_info(m.subjects.sessions_stream, "scheduler")
            return info.num_pending == 0 and info.num_ack_pending == 0  # nothing stuck

        await eventually(all_handled, 30, "every session event handled and acked")
        assert dropped(logs, subject) == len(variants)
    assert_unchanged(before, await registry_state(m))
    await assert_still_serving(m, since)


async def test_chunk_subject_the_gateway_reads(mesh):
    m = mesh
    subject = m.subjects.chunks(m.live_id)
    record = await live_session(m)
    await eventually(lambda: len(m.live.chunk_seqs()) >= 2, 30, "chunks")
    since = len(m.live.chunk_seqs())
    top = m.live.chunk_seqs()[-1]
    before = await registry_state(m)
    now = time.time()
    chunk = Chunk(
        session_id=m.live_id,
        seq=top,
        worker_id=WORKER,
        epoch=record.epoch,
        width=16,
        height=16,
        fps=16.0,
        gen_ms=1.0,
        batch=1,
        due_at=now,
        done_at=now,
        fmp4=b"not-a-real-fragment",
    )
    body = orjson.loads(encode(chunk))
    variants = bad_variants(chunk, "session_id")
    variants["fmp4 missing"] = orjson.dumps({k: v for k, v in body.items() if k != "fmp4"})
    variants["fmp4 not a string"] = orjson.dumps({**body, "fmp4": ["QUJD"]})
    variants["fmp4 not base64"] = orjson.dumps({**body, "fmp4": "not base64 !"})
    with capture_logs() as logs:
        await send_bad(m, logs, subject, variants, listeners=1)
        # stale: a chunk from the owner before this one
        await m.nc.publish(subject, encode(msgspec.structs.replace(chunk, epoch=record.epoch - 1)))
        await m.nc.flush()
        await eventually(
            lambda: any(e.get("event") == "stale_owner_dropped" for e in logs),
            30,
            "the stale chunk is dropped",
        )
    assert_unchanged(before, await registry_state(m))
    await assert_still_serving(m, since)
    for event, _, data in m.live.events:
        if event == "chunk":
            assert orjson.loads(data)["worker_id"] == WORKER  # each a well-formed chunk


@contextlib.asynccontextmanager
async def watched_session(m: BadInputMesh) -> AsyncIterator[tuple[dict[str, Any], Stream]]:
    resp = await m.http.post(
        "/v1/sessions", json={"prompt": "watched"}, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    session = await resp.json()
    stream = await _open_stream(m.http, session["id"], session["token"])
    try:
        await eventually(lambda: len(stream.chunk_seqs()) >= 2, 30, "the watched session streams")
        yield session, stream
    finally:
        assert stream.task is not None
        stream.task.cancel()
        await asyncio.wait({stream.task}, timeout=5)
        await m.http.delete(
            f"/v1/sessions/{session['id']}", headers={"Authorization": f"Bearer {session['token']}"}
        )


async def test_gateway_relays_no_chunk_whose_fragment_breaks_the_contract(mesh):
    """The gateway relays a fragment verbatim (SSE) or decodes it late (WebSocket, JPEG): one
    that is not a compact, non-empty base64 string is dropped before any client sees it."""
    m = mesh
    async with watched_session(m) as (session, stream):
        record = await m.registry.get_session(session["id"])
        top = stream.chunk_seqs()[-1]
        now = time.time()
        good = Chunk(
            session_id=session["id"],
            seq=top + 1000,
            worker_id=WORKER,
            epoch=record.epoch,
            width=16,
            height=16,
            fps=16.0,
            gen_ms=1.0,
            batch=1,
            due_at=now,
            done_at=now,
            fmp4=b"\x00\x00\x00\x18ftyp",
        )
        body = orjson.loads(encode(good))
        subject = m.subjects.chunks(session["id"])
        with capture_logs() as logs:
            await m.nc.publish(subject, orjson.dumps({**body, "fmp4": ["QUJD"]}))
            await m.nc.publish(subject, orjson.dumps({**body, "fmp4": ""}))  # no video
            await m.nc.flush()
            await eventually(lambda: dropped(logs, subject) >= 2, 30, "both dropped")
        await eventually(lambda: len(stream.chunk_seqs()) >= 4, 30, "the stream goes on")
        assert top + 1000 not in stream.chunk_seqs()
        for event, _, data in stream.events:
            if event == "chunk":
                assert isinstance(orjson.loads(data)["frames"], list)  # a JPEG viewer's


async def test_gateway_relays_no_chunk_from_a_stale_owner(mesh):
    """A worker that lost the session (its epoch is older than the chunks already seen) is
    fenced off: what it still publishes never reaches the viewer (a far seq would otherwise
    freeze the viewer until the real stream passed it)."""
    m = mesh
    async with watched_session(m) as (session, stream):
        record = await m.registry.get_session(session["id"])
        top = stream.chunk_seqs()[-1]
        now = time.time()
        stale = Chunk(
            session_id=session["id"],
            seq=top + 50,
            worker_id="wstale",
            epoch=record.epoch - 1,
            width=16,
            height=16,
            fps=16.0,
            gen_ms=1.0,
            batch=1,
            due_at=now,
            done_at=now,
            fmp4=b"\x00\x00\x00\x18ftyp",
        )
        with capture_logs() as logs:
            await m.nc.publish(m.subjects.chunks(session["id"]), encode(stale))
            await m.nc.flush()
            await eventually(
                lambda: any(e.get("event") == "stale_owner_dropped" for e in logs),
                30,
                "the stale chunk is dropped",
            )
        since = len(stream.chunk_seqs())
        await eventually(lambda: len(stream.chunk_seqs()) >= since + 3, 30, "the stream goes on")
        seqs = stream.chunk_seqs()
        assert top + 50 not in seqs
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
