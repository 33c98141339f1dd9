"""The handoff protocol between two stand-in workers in this process, over the real NATS and
Redis and a real gloo transport: success, suspended sessions, every abort path that can be
staged in one process, fencing, the CAS race, and many handoffs back and forth under load."""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest

from services.gpu_worker.handoff.codes import HandoffCode
from services.gpu_worker.handoff.links import RECV, SEND
from services.gpu_worker.handoff.source import Migration
from services.gpu_worker.handoff.tensors import new_secret
from services.gpu_worker.handoff.transports import GlooTransport, TransferError
from shared.registry import Registry
from shared.states import SessionState
from shared.wire import HandoffAnswer, HandoffOffer, MigrationReport, decode, encode
from tests.eventually import eventually

from .handoff_support import assert_state, migrate, place, start_worker

pytestmark = pytest.mark.integration


@pytest.fixture
def registry(redis_client, isolation):
    return Registry(redis_client, isolation["TURBOSERVE_REDIS_NAMESPACE"])


@pytest.fixture
async def pair(infra, isolation, registry, nats_client):
    workers = [await start_worker(infra, isolation, registry, wid) for wid in ("wa", "wb")]
    yield workers
    for worker in workers:
        await worker.close()


async def assert_back_on_source(registry, src, dst, sid, epoch, seed=0, chunks=3):
    """An aborted handoff: the source holds the session, unfrozen, at e+2; nobody else does."""
    record = await registry.get_session(sid)
    assert (record.state, record.owner, record.epoch) == (SessionState.EXECUTING, src.id, epoch + 2)
    assert (await registry.placement())[sid] == src.id
    held = src.host.sessions[sid]
    assert not held.frozen and held.epoch == epoch + 2
    assert_state(src, sid, seed, chunks)
    assert src.host.advance(sid) == chunks  # it plays on, at its next seq
    assert await registry.record_progress(sid, src.id, epoch + 2, chunks)
    assert sid not in dst.host.sessions and not dst.host.reserved


async def test_handoff_moves_the_state_bit_for_bit_and_ownership_with_it(
    pair, registry, nats_client, isolation
):
    a, b = pair
    reports = await nats_client.subscribe(
        f"{isolation['TURBOSERVE_SUBJECT_PREFIX']}.worker.*.migrations"
    )
    epoch = await place(registry, a, "s1", seed=7, chunks=5)
    report = await a.ep.migrate(migrate(a, b, "s1", epoch))
    assert report.ok, report
    assert (report.epoch, report.transport, report.code) == (epoch + 2, "gloo", "")
    assert report.nbytes == sum(t.numel() * t.element_size() for t in b.host.state("s1"))
    assert report.transfer_ms > 0 and report.connect_ms > 0 and report.total_ms > 0
    record = await registry.get_session("s1")
    assert (record.state, record.owner, record.epoch) == (SessionState.EXECUTING, "wb", epoch + 2)
    assert (await registry.placement())["s1"] == "wb"
    assert_state(b, "s1", seed=7, chunks=5)  # checksummed and compared bit for bit
    held = b.host.sessions["s1"]
    assert held.seq == 5 and held.epoch == epoch + 2 and not b.host.reserved
    assert "s1" not in a.host.sessions and a.host.released == ["s1"]
    # The destination continues at the next seq, under its epoch.
    assert b.host.advance("s1") == 5
    assert await registry.record_progress("s1", "wb", epoch + 2, 5)
    # The requester hears of it, and operators see it.
    published = decode("migrations", (await reports.next_msg(timeout=5)).data, MigrationReport)
    assert published.ok and published.command_id == report.command_id == f"c-s1-{epoch}"
    (event,) = await registry.cluster_events()
    assert event["kind"] == "migration" and event["session_id"] == "s1" and event["ok"]
    assert a.ep.cost().samples == 1 and a.ep.cost().fixed_ms > 0


async def test_after_the_commit_the_source_is_fenced(pair, registry):
    a, b = pair
    epoch = await place(registry, a, "s1")
    assert (await a.ep.migrate(migrate(a, b, "s1", epoch))).ok
    # The source's epochs (before and during the handoff) can no longer write.
    assert not await registry.record_progress("s1", "wa", epoch, 3)
    assert not await registry.record_progress("s1", "wa", epoch + 1, 3)
    assert not await registry.record_progress("s1", "wa", epoch + 2, 3)
    assert await registry.record_progress("s1", "wb", epoch + 2, 3)
    # And the source cannot hand it off again: it no longer holds it.
    again = await a.ep.migrate(migrate(a, b, "s1", epoch + 2))
    assert not again.ok and again.code == HandoffCode.UNKNOWN_SESSION


async def test_a_suspended_session_moves_host_to_host_and_stays_suspended(pair, registry):
    a, b = pair
    epoch = await place(registry, a, "s1", seed=2, chunks=4, suspended=True)
    report = await a.ep.migrate(migrate(a, b, "s1", epoch))
    assert report.ok and report.suspended and report.transport == "gloo"
    record = await registry.get_session("s1")
    assert (record.state, record.owner, record.epoch) == (SessionState.SUSPENDED, "wb", epoch + 2)
    held = b.host.sessions["s1"]
    assert held.suspended and held.misc.device.type == "cpu" and held.seq == 4
    assert_state(b, "s1", seed=2, chunks=4)


@pytest.mark.parametrize("refusal", ["draining", "full"])
async def test_a_refusing_destination_leaves_the_session_on_the_source(pair, registry, refusal):
    a, b = pair
    if refusal == "draining":
        b.host.draining = True
    else:
        b.host.capacity = 1
        await place(registry, b, "other")
    epoch = await place(registry, a, "s1")
    report = await a.ep.migrate(migrate(a, b, "s1", epoch))
    assert not report.ok and report.code == refusal and report.epoch == epoch + 2
    await assert_back_on_source(registry, a, b, "s1", epoch)


async def test_a_stale_epoch_changes_nothing(pair, registry):
    a, b = pair
    epoch = await place(registry, a, "s1")
    report = await a.ep.migrate(migrate(a, b, "s1", epoch - 1))
    assert not report.ok and report.code == HandoffCode.STALE_EPOCH
    record = await registry.get_session("s1")
    assert (record.state, record.owner, record.epoch) == (SessionState.EXECUTING, "wa", epoch)
    assert not a.host.sessions["s1"].frozen and "s1" not in b.host.sessions
    # The registry moved on while the host still had the old epoch: the CAS refuses.
    await registry.transition("s1", SessionState.SUSPENDED, expected_epoch=epoch)
    report = await a.ep.migrate(migrate(a, b, "s1", epoch))
    assert not report.ok and report.code == HandoffCode.STALE_EPOCH
    held = a.host.sessions["s1"]
    assert not held.frozen and held.epoch == epoch
    assert (await registry.get_session("s1")).epoch == epoch + 1


async def test_a_corrupted_transfer_fails_verification_and_aborts(pair, registry, monkeypatch):
    a, b = pair
    epoch = await place(registry, a, "s1", seed=4)
    send = GlooTransport.send

    def corrupting_send(self, handle, tensors, tag, deadline):
        damaged = [t.clone() for t in tensors]
        damaged[1].view(-1)[17] += 1  # after the checksum went out in the offer
        return send(self, handle, damaged, tag, deadline)

    monkeypatch.setattr(GlooTransport, "send", corrupting_send)
    report = await a.ep.migrate(migrate(a, b, "s1", epoch))
    assert not report.ok and report.code == HandoffCode.VERIFICATION_FAILED
    assert "checksum" in report.detail
    await assert_back_on_source(registry, a, b, "s1", epoch, seed=4)
    monkeypatch.undo()
    # Nothing is left half-done: the next handoff succeeds (over a rebuilt link).
    report = await a.ep.migrate(migrate(a, b, "s1", epoch + 2))
    assert report.ok and report.connect_ms > 0
    assert_state(b, "s1", seed=4, chunks=4)  # it played one more chunk on the source


async def test_an_offer_whose_secret_is_not_its_checksums_is_refused_and_aborts(
    pair, registry, monkeypatch
):
    """As if someone rewrote the offer's secret on the way: the bytes arrive intact, but their
    checksum under the offer's secret is not the offer's. Refused; the session plays on from
    its source at its next seq, and the next handoff goes through."""
    a, b = pair
    epoch = await place(registry, a, "s1", seed=6)
    make_offer = Migration._make_offer

    async def forged(self, frozen):
        return msgspec.structs.replace(await make_offer(self, frozen), secret=new_secret())

    monkeypatch.setattr(Migration, "_make_offer", forged)
    report = await a.ep.migrate(migrate(a, b, "s1", epoch))
    assert not report.ok and report.code == HandoffCode.VERIFICATION_FAILED
    assert "secret" in report.detail
    await assert_back_on_source(registry, a, b, "s1", epoch, seed=6)
    monkeypatch.undo()
    report = await a.ep.migrate(migrate(a, b, "s1", epoch + 2))
    assert report.ok
    assert_state(b, "s1", seed=6, chunks=4)


async def test_an_offer_without_its_secret_or_with_a_spent_one_is_refused(
    pair, registry, nats_client, isolation
):
    """An unchecksummed offer is refused before anything moves; so is a genuine offer sent
    again (its secret was spent when it was first offered)."""
    a, b = pair
    subject = f"{isolation['TURBOSERVE_SUBJECT_PREFIX']}.worker.wb.handoff.wa"  # from wa
    seen = await nats_client.subscribe(subject)  # a copy of every offer to wb
    epoch = await place(registry, a, "s1", seed=2)
    assert (await a.ep.migrate(migrate(a, b, "s1", epoch))).ok
    genuine = decode(subject, (await seen.next_msg(timeout=5)).data, HandoffOffer)
    assert len(genuine.secret) == 64 and len(genuine.checksum) == 64
    await seen.unsubscribe()
    for forged, fault in (
        (msgspec.structs.replace(genuine, transfer_id="f1", secret="", checksum=""), "secret"),
        (msgspec.structs.replace(genuine, transfer_id="f2", checksum=""), "checksum"),
        (msgspec.structs.replace(genuine, transfer_id="f3"), "replay"),
    ):
        reply = await nats_client.request(subject, encode(forged), timeout=5)
        answer = decode(subject, reply.data, HandoffAnswer)
        assert not answer.accepted and answer.code == HandoffCode.INVALID_OFFER, answer
        assert fault in answer.detail
    assert_state(b, "s1", seed=2, chunks=3)  # what it holds is the genuine handoff's
    assert not b.host.reserved


async def test_an_absent_destination_or_a_bad_command_is_reported(pair, registry):
    a, b = pair
    epoch = await place(registry, a, "s1")
    report = await a.ep.migrate(migrate(a, "nobody", "s1", epoch))
    assert not report.ok and report.code == HandoffCode.UNREACHABLE
    await assert_back_on_source(registry, a, b, "s1", epoch)
    no_session = msgspec.structs.replace(migrate(a, b, "s1", epoch + 2), session_id=None)
    for bad in (migrate(a, a, "s1", epoch + 2), no_session):
        report = await a.ep.migrate(bad)
        assert not report.ok and report.code == HandoffCode.INVALID_COMMAND
    assert not a.host.sessions["s1"].frozen


async def test_garbage_on_the_handoff_subject_is_refused_and_harmless(
    pair, registry, nats_client, isolation
):
    a, b = pair
    subject = f"{isolation['TURBOSERVE_SUBJECT_PREFIX']}.worker.wb.handoff.wa"  # from wa
    for garbage in (
        b"not json",
        b'{"type": "handoff_offer", "v": 1}',
        b'{"type": "handoff_offer", "v": 99, "transfer_id": "x"}',
    ):
        reply = await nats_client.request(subject, garbage, timeout=5)
        answer = decode(subject, reply.data, HandoffAnswer)
        assert not answer.accepted and answer.code == HandoffCode.INVALID_OFFER
    await nats_client.publish(subject, b"\xff\xfe")  # not a request: dropped
    epoch = await place(registry, a, "s1")
    assert (await a.ep.migrate(migrate(a, b, "s1", epoch))).ok


async def test_source_timing_out_loses_to_a_destination_commit(
    infra, isolation, registry, monkeypatch
):
    """The outcome never reaches the source: its abort CAS loses to the destination's commit
    (both expect e+1), the registry says so, and the source releases. Owned once."""
    a = await start_worker(infra, isolation, registry, "wa", timeout_s=4.0)
    b = await start_worker(infra, isolation, registry, "wb", timeout_s=4.0)
    try:
        epoch = await place(registry, a, "s1", seed=9)

        async def lost(offer, **kwargs):
            return None

        monkeypatch.setattr(b.ep.reception, "_tell", lost)
        report = await a.ep.migrate(migrate(a, b, "s1", epoch))
        assert report.ok and report.epoch == epoch + 2 and "did not reach us" in report.detail
        record = await registry.get_session("s1")
        assert (record.state, record.owner, record.epoch) == (
            SessionState.EXECUTING,
            "wb",
            epoch + 2,
        )
        assert "s1" not in a.host.sessions and "s1" in b.host.sessions
        assert_state(b, "s1", seed=9, chunks=3)
    finally:
        await a.close()
        await b.close()


async def test_source_abort_wins_over_a_late_destination(infra, isolation, registry, monkeypatch):
    """The destination is slower than the source's deadline: the source's abort CAS wins,
    the destination's commit CAS then fails and it discards. Owned once, by the source."""
    a = await start_worker(infra, isolation, registry, "wa", timeout_s=3.0)
    b = await start_worker(infra, isolation, registry, "wb", timeout_s=30.0)
    try:
        epoch = await place(registry, a, "s1")
        fetch = b.ep.reception._fetch
        source_gave_up = asyncio.Event()

        async def slow_fetch(incoming):
            tensors = await fetch(incoming)
            b.ep.reception.incoming.pop(incoming.offer.transfer_id)  # deaf to the abort notice
            await source_gave_up.wait()  # commits only after the source's deadline
            return tensors

        monkeypatch.setattr(b.ep.reception, "_fetch", slow_fetch)
        report = await a.ep.migrate(migrate(a, b, "s1", epoch))
        source_gave_up.set()
        assert not report.ok and report.code == HandoffCode.TIMEOUT
        await eventually(lambda: not b.ep._tasks, timeout=15, what="the destination to give up")
        await assert_back_on_source(registry, a, b, "s1", epoch)
    finally:
        await a.close()
        await b.close()


async def test_links_are_reused_and_torn_down_when_a_peer_is_forgotten(pair, registry):
    a, b = pair
    epoch = await place(registry, a, "s1")
    first = await a.ep.migrate(migrate(a, b, "s1", epoch))
    back = await b.ep.migrate(migrate(b, a, "s1", first.epoch))
    again = await a.ep.migrate(migrate(a, b, "s1", back.epoch))
    assert first.ok and back.ok and again.ok
    assert first.connect_ms > 0 and back.connect_ms > 0  # one link per direction
    assert again.connect_ms == 0  # the a -> b link was reused
    send_link = a.ep.links.get("wb", SEND, "gloo")
    assert send_link is not None and b.ep.links.get("wa", RECV, "gloo").link_id == send_link.link_id
    assert await a.ep.forget_peer("wb") == 2  # a -> b (send) and b -> a (recv)
    assert await b.ep.forget_peer("wa") == 2
    assert a.ep.links.peers() == set() and b.ep.links.peers() == set()
    rebuilt = await b.ep.migrate(migrate(b, a, "s1", again.epoch))
    assert rebuilt.ok and rebuilt.connect_ms > 0
    assert_state(a, "s1", seed=0, chunks=3)
    assert a.ep.cost().first_use_ms is not None


async def test_many_handoffs_back_and_forth_under_load_leave_every_session_intact(pair, registry):
    """Sessions play chunks all along (recording progress under their epochs) while random
    handoffs, several at once, move them between the two workers. At the end each session is
    on exactly one worker, bit for bit the state of its chunks, and its seqs were produced
    once each, in order, across both workers."""
    a, b = pair
    workers = {"wa": a, "wb": b}
    sessions = {f"s{i}": i for i in range(4)}
    epochs = {
        sid: await place(registry, a if i % 2 else b, sid, seed=i, chunks=0)
        for sid, i in sessions.items()
    }
    fenced: list[tuple[str, str, int]] = []
    produced: dict[str, list[int]] = {sid: [] for sid in sessions}
    playing = True

    async def play(worker):
        while playing:
            for sid in list(worker.host.sessions):
                async with worker.host.chunk_boundary:  # as the worker's generation thread
                    held = worker.host.sessions.get(sid)
                    seq = worker.host.advance(sid)
                    if seq is None:
                        continue
                    produced[sid].append(seq)
                    if not await registry.record_progress(sid, worker.id, held.epoch, seq):
                        fenced.append((worker.id, sid, seq))
            await asyncio.sleep(0.003)

    async def shuttle(sid, rounds, rng):
        for _ in range(rounds):
            await asyncio.sleep(rng.uniform(0, 0.02))
            src = next(w for w in workers.values() if sid in w.host.sessions)
            dst = b if src is a else a
            report = await src.ep.migrate(migrate(src, dst, sid, epochs[sid]))
            assert report.ok, report
            epochs[sid] = report.epoch

    players = [asyncio.create_task(play(w)) for w in workers.values()]
    try:
        rng = random.Random(5)
        await asyncio.gather(*(shuttle(sid, 6, rng) for sid in sessions))
    finally:
        playing = False
        await asyncio.gather(*players)
    assert not fenced
    for sid, seed in sessions.items():
        holders = [w for w in workers.values() if sid in w.host.sessions]
        assert len(holders) == 1
        holder = holders[0]
        record = await registry.get_session(sid)
        assert record.owner == holder.id and record.epoch == epochs[sid]
        assert record.state is SessionState.EXECUTING
        seq = holder.host.sessions[sid].seq
        assert_state(holder, sid, seed, seq)
        # Every seq once, in order, wherever it was played; the registry saw the last one.
        assert produced[sid] == list(range(seq)) and seq > 0
        assert record.last_seq == seq - 1
    assert not a.host.reserved and not b.host.reserved


async def test_the_source_giving_up_makes_the_destination_discard_at_once(
    infra, isolation, registry, monkeypatch
):
    """The source cannot build its side of a new link (say its store broke): it aborts and
    tells the destination, which is waiting for the source to join the link, and which frees
    the room it reserved now, not at its own (much later) deadline."""
    a = await start_worker(infra, isolation, registry, "wa")
    b = await start_worker(infra, isolation, registry, "wb", timeout_s=60.0)
    try:
        epoch = await place(registry, a, "s1")

        async def broken_open(*args, **kwargs):
            await asyncio.sleep(0.5)  # the destination is waiting in its link build by now
            raise TransferError("injected: the rendezvous store is broken")

        monkeypatch.setattr(a.ep.links, "open", broken_open)
        report = await a.ep.migrate(migrate(a, b, "s1", epoch))
        assert not report.ok and report.code == HandoffCode.TRANSFER_FAILED
        await eventually(
            lambda: not b.host.reserved and not b.ep.reception.incoming,
            timeout=10,
            what="the destination to discard",
        )
        await assert_back_on_source(registry, a, b, "s1", epoch)
    finally:
        await a.close()
        await b.close()


async def test_a_failing_destination_host_is_a_refusal(pair, registry, monkeypatch):
    a, b = pair

    def broken(incoming):
        raise RuntimeError("engine on fire")

    monkeypatch.setattr(b.host, "admission", broken)
    epoch = await place(registry, a, "s1")
    report = await a.ep.migrate(migrate(a, b, "s1", epoch))
    assert not report.ok and report.code == HandoffCode.HOST_ERROR and "on fire" in report.detail
    await assert_back_on_source(registry, a, b, "s1", epoch)


async def test_closing_lets_a_handoff_in_flight_finish_and_refuses_new_ones(pair, registry):
    a, b = pair
    epoch = await place(registry, a, "s1")
    await place(registry, b, "s2")
    in_flight = asyncio.create_task(a.ep.migrate(migrate(a, b, "s1", epoch)))
    await asyncio.sleep(0.01)  # under way
    await a.ep.close()
    report = await in_flight
    assert report.ok and report.detail == "", report  # its outcome arrived during the close
    record = await registry.get_session("s1")
    assert (record.owner, record.epoch) == ("wb", epoch + 2)
    late = await a.ep.migrate(migrate(a, b, "s1", epoch + 2))
    assert not late.ok and late.code == HandoffCode.DRAINING
    # A closed endpoint takes no offers either.
    s2 = await b.ep.migrate(migrate(b, a, "s2", (await registry.get_session("s2")).epoch))
    assert not s2.ok and s2.code in (HandoffCode.DRAINING, HandoffCode.UNREACHABLE)
    assert "s2" in b.host.sessions and not b.host.sessions["s2"].frozen
