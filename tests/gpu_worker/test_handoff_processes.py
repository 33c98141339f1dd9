"""Handoffs between worker processes (stand-in workers over the real NATS, Redis and gloo),
and the worker deaths one process cannot stage: the destination killed during the transfer,
the source killed once its offer was accepted."""

from __future__ import annotations

import subprocess

import pytest

from services.gpu_worker.handoff.codes import HandoffCode
from shared.registry import Registry
from shared.states import SessionState
from shared.wire import Subjects, WorkerCmdKind, WorkerCommand
from tests.eventually import eventually
from tools.handoff import harness
from tools.handoff.synthetic import Layout

from .handoff_child import EXIT_CODE
from .handoff_support import assert_state, migrate, place, start_worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BIG = Layout(nbytes=128 << 20, layers=8)  # long enough a transfer to die in


@pytest.fixture
def registry(redis_client, isolation):
    return Registry(redis_client, isolation["TURBOSERVE_REDIS_NAMESPACE"])


@pytest.fixture
def env(infra, isolation, nats_client):  # nats_client: deletes the test's streams after it
    return {
        "TURBOSERVE_NATS_URL": infra.nats_url,
        "TURBOSERVE_REDIS_URL": infra.redis_url,
        "TURBOSERVE_LOG_LEVEL": "warning",
        "TURBOSERVE_HANDOFF_TIMEOUT_S": "8",
        **isolation,
    }


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.terminate()
    for proc in started:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def start_peer(procs, nats_client, isolation, env, worker_id, fault=None):
    if fault:
        proc = harness.spawn_peer(
            worker_id,
            env,
            checksum=True,
            module="tests.gpu_worker.handoff_child",
            extra=("--fault", fault),
        )
    else:
        proc = harness.spawn_peer(worker_id, env, checksum=True)
    procs.append(proc)
    await harness.wait_ready(
        nats_client, Subjects(isolation["TURBOSERVE_SUBJECT_PREFIX"]), worker_id, proc
    )
    return proc


async def test_a_handoff_between_two_worker_processes(procs, nats_client, isolation, env, registry):
    subjects = Subjects(isolation["TURBOSERVE_SUBJECT_PREFIX"])
    for wid in ("pa", "pb"):
        await start_peer(procs, nats_client, isolation, env, wid)
    reports = harness.Reports(nats_client, subjects)
    await reports.start()
    epoch = await harness.place(registry, nats_client, subjects, "s1", "pa", BIG.describe(), seed=3)
    there = await reports.migrate("s1", "pa", "pb", epoch)
    back = await reports.migrate("s1", "pb", "pa", there.epoch)
    await reports.close()
    assert there.ok and back.ok, (there, back)
    assert (there.transport, there.nbytes, back.epoch) == ("gloo", BIG.nbytes, epoch + 4)
    assert there.connect_ms > 0 and back.connect_ms > 0 and there.transfer_ms > 0
    record = await registry.get_session("s1")
    assert (record.state, record.owner, record.epoch) == (SessionState.EXECUTING, "pa", epoch + 4)


async def test_destination_killed_during_the_transfer(
    procs, nats_client, isolation, env, infra, registry
):
    proc = await start_peer(procs, nats_client, isolation, env, "pdst", fault="die_in_recv")
    src = await start_worker(infra, isolation, registry, "wsrc", layout=BIG, timeout_s=8.0)
    try:
        epoch = await place(registry, src, "s1", seed=6, chunks=2)
        report = await src.ep.migrate(migrate(src, "pdst", "s1", epoch))
        await eventually(lambda: proc.poll() is not None, timeout=20, what="the death")
        assert proc.returncode == EXIT_CODE  # it did die in the transfer
        assert not report.ok
        assert report.code in (HandoffCode.TRANSFER_FAILED, HandoffCode.TIMEOUT), report
        record = await registry.get_session("s1")
        assert (record.state, record.owner, record.epoch) == (
            SessionState.EXECUTING,
            "wsrc",
            epoch + 2,
        )
        held = src.host.sessions["s1"]
        assert not held.frozen and held.epoch == epoch + 2
        assert_state(src, "s1", seed=6, chunks=2, layout=BIG)
        assert src.host.advance("s1") == 2
        assert await registry.record_progress("s1", "wsrc", epoch + 2, 2)
        assert src.ep.links.peers() == set()  # the broken link is gone
    finally:
        await src.close()


async def test_source_killed_once_its_offer_was_accepted(
    procs, nats_client, isolation, env, infra, registry
):
    subjects = Subjects(isolation["TURBOSERVE_SUBJECT_PREFIX"])
    proc = await start_peer(procs, nats_client, isolation, env, "psrc", fault="die_in_send")
    dst = await start_worker(infra, isolation, registry, "wdst", layout=BIG, timeout_s=8.0)
    try:
        epoch = await harness.place(
            registry, nats_client, subjects, "s1", "psrc", BIG.describe(), seed=1
        )
        reply = await harness.command(
            nats_client,
            subjects,
            WorkerCommand(
                kind=WorkerCmdKind.MIGRATE,
                worker_id="psrc",
                session_id="s1",
                target="wdst",
                epoch=epoch,
            ),
        )
        assert reply.ok
        await eventually(lambda: proc.poll() is not None, timeout=20, what="the source to die")
        assert proc.returncode == EXIT_CODE
        # The destination accepted, then its transfer broke: it discards and frees the room.
        await eventually(
            lambda: not dst.ep._tasks and not dst.host.reserved,
            timeout=20,
            what="the destination to discard",
        )
        assert "s1" not in dst.host.sessions
        # The registry still names the dead source, mid-migration: the scheduler requeues
        # sessions whose owner stopped heartbeating; nobody else may take it before that.
        record = await registry.get_session("s1")
        assert (record.state, record.owner, record.epoch) == (
            SessionState.MIGRATING,
            "psrc",
            epoch + 1,
        )
    finally:
        await dst.close()
