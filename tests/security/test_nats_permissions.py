"""Per-service NATS permissions against a real nats-server started with the generated config.

Who may publish and read what is written here from the protocol (docs/security.md), not taken
from shared/security.py, so that a wrong permission in the generated config fails a test.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.js import api

from shared.runner import CredentialsRefused, connect_nats, subscriptions_live
from shared.security import OPERATOR, SERVICE_ROLES, WORKER, inbox_prefix, with_user
from shared.settings import CommonSettings
from shared.streams import ensure_streams
from shared.wire import (
    SessionEvent,
    SessionEventKind,
    Subjects,
    WorkerCmdKind,
    WorkerCommand,
    encode,
)
from tests.eventually import eventually
from tests.security.conftest import PREFIX, CalloutRunning, server_log
from tools.launcher import Mesh

pytestmark = pytest.mark.integration

SUBJECTS = Subjects(PREFIX)
# The worker role is w1, a worker with a user of its own (the auth callout's); w2 and w3 are
# other workers.
ME = "w1"
PROTOCOL = {
    "session_events": SUBJECTS.session_events,
    "chunks": SUBJECTS.chunks("s1"),
    "input": SUBJECTS.session_input("s1"),
    "worker_cmd": SUBJECTS.worker_cmd(ME),
    "other_cmd": SUBJECTS.worker_cmd("w2"),
    "heartbeat": SUBJECTS.worker_heartbeat(ME),
    "other_heartbeat": SUBJECTS.worker_heartbeat("w2"),
    "handoff_in": SUBJECTS.worker_handoff(ME, "w2"),  # from w2 to w1
    "handoff_out": SUBJECTS.worker_handoff("w2", ME),  # from w1 to w2
    "other_handoff": SUBJECTS.worker_handoff("w2", "w3"),  # between two others
    "migrations": SUBJECTS.migrations(ME),
    "other_migrations": SUBJECTS.migrations("w2"),
    "provisioner_cmd": SUBJECTS.provisioner_cmd,
    "provisioner_events": SUBJECTS.provisioner_events,
}
PUBLISHES = {
    "gateway": {"session_events", "chunks", "input"},
    "scheduler": {"worker_cmd", "other_cmd", "provisioner_cmd"},
    "worker": {"chunks", "heartbeat", "migrations", "handoff_out"},
    "provisioner": {"provisioner_events"},
}
SUBSCRIBES = {
    "gateway": {"chunks"},
    "scheduler": {
        "heartbeat",
        "other_heartbeat",
        "provisioner_events",
        "migrations",
        "other_migrations",
    },
    "worker": {"worker_cmd", "handoff_in", "input", "provisioner_events"},
    "provisioner": {"heartbeat", "other_heartbeat", "provisioner_cmd"},
}
# Set by the autouse fixture: w1's URL, with a credential made for it.
WORKER_URL: dict[str, str] = {}


@pytest.fixture(autouse=True)
async def worker_login(callout: CalloutRunning) -> AsyncIterator[CalloutRunning]:
    WORKER_URL[ME] = await callout.login(ME)
    yield callout
    WORKER_URL.clear()


def url_of(mesh: Mesh, role: str) -> str:
    if role == WORKER:
        return WORKER_URL[ME]
    return mesh.nats_url if role == OPERATOR else mesh.service_env(role)["TURBOSERVE_NATS_URL"]


def user_of(role: str) -> str:
    return ME if role == WORKER else role


@contextlib.asynccontextmanager
async def connected(mesh: Mesh, role: str) -> AsyncIterator[tuple[NATS, list[str]]]:
    """A connection as ``role`` (with its inbox prefix) and the errors the server sent it."""
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(
        url_of(mesh, role),
        inbox_prefix=inbox_prefix(user_of(role)),
        error_cb=on_error,
        allow_reconnect=False,
    )
    try:
        yield nc, errors
    finally:
        await nc.close()


@pytest.mark.parametrize("role", SERVICE_ROLES)
async def test_each_service_publishes_only_its_own_subjects(secure_infra, role):
    async with (
        connected(secure_infra, OPERATOR) as (op, _),
        connected(secure_infra, role) as (nc, errors),
    ):
        heard: list[str] = []

        async def on_msg(msg: Any) -> None:
            heard.append(msg.subject)

        for subject in PROTOCOL.values():
            await op.subscribe(subject, cb=on_msg)
        await subscriptions_live(op)
        allowed = PUBLISHES[role]
        # The refused first, then the allowed: one connection's messages arrive in order, so
        # once the allowed ones are in, a refused one that got through would be in too.
        for name in sorted(PROTOCOL, key=lambda n: n in allowed):
            await nc.publish(PROTOCOL[name], b"probe")
        await nc.flush()
        await eventually(lambda: len(heard) >= len(allowed), what="the allowed subjects heard")
        await op.flush()
        assert {n for n, s in PROTOCOL.items() if s in heard} == allowed
        refused = set(PROTOCOL) - allowed
        await eventually(
            lambda: sum("permissions violation" in e for e in errors) >= len(refused),
            what="a violation for each refused subject",
        )


@pytest.mark.parametrize("role", SERVICE_ROLES)
async def test_each_service_reads_only_its_own_subjects_and_inboxes(secure_infra, role):
    async with (
        connected(secure_infra, OPERATOR) as (op, _),
        connected(secure_infra, role) as (nc, errors),
    ):
        heard: list[str] = []

        async def on_msg(msg: Any) -> None:
            heard.append(msg.subject)

        others = [user_of(r) for r in SERVICE_ROLES if r != role]
        stolen = ["_INBOX.>", *(f"{inbox_prefix(r)}.x" for r in others)]
        for subject in [*PROTOCOL.values(), *stolen]:
            await nc.subscribe(subject, cb=on_msg)
        own_inbox = nc.new_inbox()
        await nc.subscribe(own_inbox, cb=on_msg)
        await subscriptions_live(nc)
        for subject in [*PROTOCOL.values(), *(f"{inbox_prefix(r)}.x" for r in others)]:
            await op.publish(subject, b"probe")
        await op.publish(own_inbox, b"barrier")  # last: everything before it has arrived
        await op.flush()
        await eventually(lambda: own_inbox in heard, what="the barrier in its own inbox")
        got = {n for n, s in PROTOCOL.items() if s in heard}
        assert got == SUBSCRIBES[role]
        assert not [s for s in heard if s.startswith("_INBOX.") and s != own_inbox]
        assert sum("permissions violation" in e for e in errors) == len(PROTOCOL) - len(got) + len(
            stolen
        )


async def test_gateway_credentials_cannot_command_a_worker(secure_infra):
    async with (
        connected(secure_infra, "worker") as (worker, _),
        connected(secure_infra, "gateway") as (gateway, errors),
        connected(secure_infra, "scheduler") as (scheduler, _),
    ):
        commands: list[bytes] = []

        async def on_cmd(msg: Any) -> None:
            commands.append(msg.data)
            await msg.respond(b"accepted")  # a worker answers every command it gets

        await worker.subscribe(SUBJECTS.worker_cmd("w1"), cb=on_cmd)
        await subscriptions_live(worker)
        cmd = encode(
            WorkerCommand(kind=WorkerCmdKind.STOP, worker_id="w1", session_id="s1", epoch=9)
        )
        with pytest.raises(nats.errors.TimeoutError):
            await gateway.request(SUBJECTS.worker_cmd("w1"), cmd, timeout=1.0)
        assert commands == []
        assert any(
            "permissions violation for publish" in e and ".worker.w1.cmd" in e for e in errors
        )
        # the scheduler's credentials can, and the worker may answer it
        reply = await scheduler.request(SUBJECTS.worker_cmd("w1"), cmd, timeout=5.0)
        assert reply.data == b"accepted" and commands == [cmd]
    log = server_log(secure_infra, "nats")
    assert '"$G/user:gateway" - Publish Violation - Subject "sec.worker.w1.cmd"' in log


async def test_worker_credentials_cannot_publish_a_session_event(secure_infra):
    async with (
        connected(secure_infra, OPERATOR) as (op, _),
        connected(secure_infra, "worker") as (worker, errors),
        connected(secure_infra, "gateway") as (gateway, _),
    ):
        js = op.jetstream()
        await ensure_streams(js, SUBJECTS)
        before = (await js.stream_info(SUBJECTS.sessions_stream)).state.messages
        event = encode(SessionEvent(session_id="s1", kind=SessionEventKind.CLOSED))
        with pytest.raises(nats.errors.TimeoutError):
            await worker.jetstream().publish(SUBJECTS.session_events, event, timeout=1.0)
        assert any("permissions violation for publish" in e for e in errors)
        assert (await js.stream_info(SUBJECTS.sessions_stream)).state.messages == before
        # the gateway's can: JetStream acknowledges it into the stream
        ack = await gateway.jetstream().publish(SUBJECTS.session_events, event, timeout=5.0)
        assert ack.stream == SUBJECTS.sessions_stream
        assert (await js.stream_info(SUBJECTS.sessions_stream)).state.messages == before + 1
        await js.purge_stream(SUBJECTS.sessions_stream)


async def test_only_the_scheduler_consumes_session_events_and_no_service_deletes_streams(
    secure_infra,
):
    async with connected(secure_infra, OPERATOR) as (op, _):
        await ensure_streams(op.jetstream(), SUBJECTS)
    for role in ("gateway", "worker", "provisioner"):
        async with connected(secure_infra, role) as (nc, errors):
            js = nc.jetstream(timeout=1.0)
            with pytest.raises(nats.errors.TimeoutError):
                await js.pull_subscribe(
                    SUBJECTS.session_events, durable="scheduler", stream=SUBJECTS.sessions_stream
                )
            with pytest.raises(nats.errors.TimeoutError):
                await js.delete_stream(SUBJECTS.chunks_stream)
            assert errors, role
    async with connected(secure_infra, "scheduler") as (nc, _):
        psub = await nc.jetstream().pull_subscribe(
            SUBJECTS.session_events, durable="scheduler", stream=SUBJECTS.sessions_stream
        )
        with pytest.raises(nats.errors.TimeoutError):
            await psub.fetch(1, timeout=0.5)  # allowed: the stream is just empty
    async with connected(secure_infra, "gateway") as (nc, _):
        # a gateway reads the chunk stream through an ephemeral consumer of its own
        sub = await nc.jetstream().subscribe(
            SUBJECTS.chunks("s1"),
            stream=SUBJECTS.chunks_stream,
            config=api.ConsumerConfig(ack_policy=api.AckPolicy.NONE),
        )
        await sub.unsubscribe()


async def test_runner_connects_with_the_users_inbox_prefix(secure_infra):
    """The services' own connect: as gateway it can do a JetStream publish, whose ack comes
    back to ``_INBOX.gateway.*``, the only inboxes it may read."""
    settings = CommonSettings(nats_url=url_of(secure_infra, "gateway"), connect_timeout_s=5.0)
    nc = await connect_nats(settings, "test-gateway")
    try:
        assert nc.new_inbox().startswith("_INBOX.gateway.")
        await ensure_streams(nc.jetstream(), SUBJECTS)
        event = encode(SessionEvent(session_id="s2", kind=SessionEventKind.CLOSED))
        ack = await nc.jetstream().publish(SUBJECTS.session_events, event, timeout=5.0)
        assert ack.seq >= 1
    finally:
        await nc.close()
    async with connected(secure_infra, OPERATOR) as (op, _):
        await op.jetstream().purge_stream(SUBJECTS.sessions_stream)


@pytest.mark.parametrize("case", ["wrong password", "unknown user", "no credentials"])
async def test_wrong_credentials_are_refused_at_once_without_the_secret(secure_infra, case):
    base = secure_infra.secured["nats"]
    url = {
        "wrong password": with_user(base, "gateway", "not-the-password-0123"),
        "unknown user": with_user(base, "mallory", "not-the-password-0123"),
        "no credentials": base,
    }[case]
    settings = CommonSettings(nats_url=url, connect_timeout_s=30.0)
    started = time.monotonic()
    with pytest.raises(CredentialsRefused) as refused:
        await connect_nats(settings, "test-wrong")
    assert time.monotonic() - started < 15  # not retried until the connect timeout
    message = str(refused.value)
    assert "refused" in message and "TURBOSERVE_NATS_URL" in message
    assert "not-the-password" not in message
    assert refused.value.retryable is False


async def test_a_worker_credential_is_refused_once_revoked_and_for_any_other_id(
    secure_infra, worker_login
):
    """The credential made for a worker admits it as itself only, and not after it is
    revoked (its worker stopped or was lost)."""
    url = await worker_login.login("w7")
    async with connected_url(url, "w7") as nc:
        assert nc.is_connected
    password = url.rpartition("@")[0].rpartition(":")[2]
    base = secure_infra.secured["nats"]
    for refused_url in (
        with_user(base, "w8", password),  # another id with w7's password
        with_user(base, "w7", "not-the-password-0123"),
        with_user(base, "gateway", password),  # a role's name: never a worker's
    ):
        with pytest.raises(CredentialsRefused):
            await connect_nats(CommonSettings(nats_url=refused_url, connect_timeout_s=10), "t")
    await worker_login.credentials.revoke("w7")
    with pytest.raises(CredentialsRefused):
        await connect_nats(CommonSettings(nats_url=url, connect_timeout_s=10), "test-revoked")
    log = server_log(secure_infra, "nats")
    assert "Auth callout service returned an error: not authorized" in log


@contextlib.asynccontextmanager
async def connected_url(url: str, user: str) -> AsyncIterator[NATS]:
    nc = await nats.connect(url, inbox_prefix=inbox_prefix(user), allow_reconnect=False)
    try:
        yield nc
    finally:
        await nc.close()
