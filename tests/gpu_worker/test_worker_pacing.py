"""The worker's pacing and command handling, with the worker service in-process on the real
NATS and Redis and the tiny model on the CPU."""

from __future__ import annotations

import asyncio
import time

import pytest

from shared.wire import NoticeKind, WorkerCmdKind, WorkerCommand, encode
from tests.eventually import eventually
from tests.gpu_worker.worker_harness import send, start_session, worker_in_process

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_sessions_started_at_different_moments_each_play_at_the_playback_rate(env):
    period, lead = 0.4, 0.4
    async with worker_in_process(env, worker_id="w1", chunk_period_s=period) as (_, ctx, rx):
        sids = [f"s{i}" for i in range(6)]
        for sid in sids:
            await start_session(ctx, "w1", sid)
            await asyncio.sleep(0.25)  # each at its own phase
        # enough of each to judge its pace: two buffered, then twelve in steady state
        await eventually(
            lambda: all(len(rx.chunks[s]) >= 14 for s in sids),
            30,
            "fourteen chunks of each session",
        )
    for sid in sids:
        chunks = [c for _, c in rx.chunks[sid]]
        assert [c.seq for c in chunks] == list(range(len(chunks))), sid
        # Steady state, after the viewer's buffer of one chunk filled (chunks 0 and 1 come at
        # once): one chunk per period, within 10%.
        steady = chunks[2:]
        assert len(steady) >= 6, (sid, len(chunks))
        on_time = sum(1 for c in steady if c.done_at <= c.due_at + 0.05)
        assert on_time >= 0.75 * len(steady), (sid, on_time, len(steady))
        span = steady[-1].done_at - steady[0].done_at
        rate = (len(steady) - 1) / span
        assert rate == pytest.approx(1 / period, rel=0.10), (sid, rate)
        # Never more than the lead ahead of playback (allowing for clock granularity).
        ahead = max(c.due_at - c.done_at for c in chunks)
        assert ahead <= lead + 0.02, (sid, ahead)
        # A chunk's due time follows the previous one's by the period, or after a late one.
        for prev, cur in zip(chunks, chunks[1:], strict=False):
            assert cur.due_at == pytest.approx(max(prev.due_at, prev.done_at) + period, abs=1e-6)


async def test_a_new_session_is_heard_while_others_wait_far_ahead(env):
    # A long period: the first session is soon far ahead and the loop waits on its inbox.
    # At 200 kbit/s a 30 s chunk still fits one NATS message (the worker refuses more).
    async with worker_in_process(
        env, worker_id="w2", chunk_period_s=30.0, pace_lead_s=0.0, video_bitrate=200_000
    ) as (
        service,
        ctx,
        rx,
    ):
        await start_session(ctx, "w2", "early")
        await eventually(lambda: len(rx.chunks["early"]) >= 1, 20, "the first chunk")
        assert service.generation is not None
        generation = service.generation
        await eventually(lambda: generation.status().waiting == 1, 10, "the loop waiting ahead")
        sent = time.time()
        await start_session(ctx, "w2", "late")
        await eventually(lambda: rx.chunks["late"], 10, "the new session's first chunk")
        first_at, first = rx.chunks["late"][0]
        assert first.seq == 0
        pass_ms = max(service.generation.status().pass_ms.values())
        # Heard at once: its first chunk (five passes) came within a few pass times, nowhere
        # near the 30 s the waiting session is ahead.
        assert first_at - sent < 1.0 + 10 * pass_ms / 1000, (first_at - sent, pass_ms)
        assert [n.kind for n in rx.notices["late"]] == [NoticeKind.PLACED]

        # STOP takes effect at the next pass: the session leaves the worker.
        record = await ctx.registry.get_session("late")
        await send(
            ctx,
            WorkerCommand(
                kind=WorkerCmdKind.STOP, worker_id="w2", epoch=record.epoch, session_id="late"
            ),
        )
        await eventually(
            lambda: "late" not in service.generation.status().sessions, 2.0, "the STOP to apply"
        )
        assert "early" in service.generation.status().sessions


async def test_a_backlog_of_stale_assigns_ends_in_one_generation_at_the_latest_epoch(env):
    async with worker_in_process(env, worker_id="w3", chunk_period_s=0.2) as (service, ctx, rx):
        record = await ctx.registry.create_session("churn", "p", 3)
        assigns = []
        for _ in range(38):  # requeued and re-placed again and again, as a stuck worker saw it
            record = await ctx.registry.claim("churn", "w3", record.epoch)
            assigns.append(
                WorkerCommand(
                    kind=WorkerCmdKind.ASSIGN,
                    worker_id="w3",
                    epoch=record.epoch,
                    session_id="churn",
                    prompt="p",
                    seed=3,
                    seq=0,
                )
            )
            record = await ctx.registry.transition(
                "churn", record_state("pending"), expected_epoch=record.epoch, owner=None
            )
        record = await ctx.registry.claim("churn", "w3", record.epoch)
        latest = WorkerCommand(
            kind=WorkerCmdKind.ASSIGN,
            worker_id="w3",
            epoch=record.epoch,
            session_id="churn",
            prompt="p",
            seed=3,
            seq=0,
        )
        for cmd in [*assigns, latest]:
            await ctx.nc.publish(ctx.subjects.worker_cmd("w3"), encode(cmd))
        await ctx.nc.flush()
        await eventually(lambda: len(rx.chunks["churn"]) >= 4, 20, "chunks")
        await asyncio.sleep(0.3)
    chunks = [c for _, c in rx.chunks["churn"]]
    assert {c.epoch for c in chunks} == {latest.epoch}
    assert [c.seq for c in chunks] == list(range(len(chunks)))  # one generation, never restarted
    assert [(n.kind, n.epoch) for n in rx.notices["churn"]] == [(NoticeKind.PLACED, latest.epoch)]


async def test_commands_sent_as_requests_are_answered(env):
    from shared.wire import CommandReply, decode

    async with worker_in_process(env, worker_id="w4", chunk_period_s=0.2) as (service, ctx, rx):
        epoch = await start_session(ctx, "w4", "s")
        stale = WorkerCommand(
            kind=WorkerCmdKind.PROMPT,
            worker_id="w4",
            epoch=epoch - 1,
            session_id="s",
            prompt="q",
            command_id="c1",
        )
        reply = decode(
            "r",
            (await ctx.nc.request(ctx.subjects.worker_cmd("w4"), encode(stale), timeout=5)).data,
            CommandReply,
        )
        assert not reply.ok and reply.code == "stale_epoch" and reply.command_id == "c1"
        good = WorkerCommand(
            kind=WorkerCmdKind.PROMPT,
            worker_id="w4",
            epoch=epoch,
            session_id="s",
            prompt="a new prompt",
            command_id="c2",
        )
        reply = decode(
            "r",
            (await ctx.nc.request(ctx.subjects.worker_cmd("w4"), encode(good), timeout=5)).data,
            CommandReply,
        )
        assert reply.ok and reply.command_id == "c2"
        await eventually(
            lambda: any(n.kind is NoticeKind.PROMPT for n in rx.notices["s"]),
            5,
            "the prompt notice",
        )
        notice = next(n for n in rx.notices["s"] if n.kind is NoticeKind.PROMPT)
        await eventually(
            lambda: rx.seqs("s") and rx.seqs("s")[-1] >= notice.next_seq,
            10,
            "the chunk the prompt applies to",
        )
        drain = WorkerCommand(kind=WorkerCmdKind.DRAIN, worker_id="w4")
        reply = decode(
            "r",
            (await ctx.nc.request(ctx.subjects.worker_cmd("w4"), encode(drain), timeout=5)).data,
            CommandReply,
        )
        assert reply.ok and service.status.value == "draining"
        # A draining worker refuses new sessions and hands them back to pending.
        record = await ctx.registry.create_session("refused", "p", 1)
        record = await ctx.registry.claim("refused", "w4", record.epoch)
        assign = WorkerCommand(
            kind=WorkerCmdKind.ASSIGN,
            worker_id="w4",
            epoch=record.epoch,
            session_id="refused",
            prompt="p",
            seed=1,
        )
        reply = decode(
            "r",
            (await ctx.nc.request(ctx.subjects.worker_cmd("w4"), encode(assign), timeout=5)).data,
            CommandReply,
        )
        assert not reply.ok and reply.code == "draining"
        assert (await ctx.registry.get_session("refused")).state.value == "pending"


async def test_suspend_and_resume_are_announced_and_the_stream_continues(env):
    async with worker_in_process(env, worker_id="w5", chunk_period_s=0.2) as (service, ctx, rx):
        await start_session(ctx, "w5", "s")
        await eventually(lambda: len(rx.chunks["s"]) >= 3, 20, "chunks")
        record = await ctx.registry.transition("s", record_state("suspended"))
        await send(
            ctx,
            WorkerCommand(
                kind=WorkerCmdKind.SUSPEND, worker_id="w5", epoch=record.epoch, session_id="s"
            ),
        )
        await eventually(lambda: "s" in service.generation.status().suspended, 5, "suspend")
        count = len(rx.chunks["s"])
        await asyncio.sleep(0.6)
        assert len(rx.chunks["s"]) == count  # no chunk while suspended
        record = await ctx.registry.transition("s", record_state("executing"))
        await send(
            ctx,
            WorkerCommand(
                kind=WorkerCmdKind.RESUME, worker_id="w5", epoch=record.epoch, session_id="s"
            ),
        )
        await eventually(lambda: len(rx.chunks["s"]) >= count + 3, 10, "chunks after resume")
    seqs = rx.seqs("s")
    assert seqs == list(range(len(seqs)))
    kinds = [n.kind for n in rx.notices["s"]]
    assert kinds == [NoticeKind.PLACED, NoticeKind.SUSPENDED, NoticeKind.RESUMED]
    suspended, resumed = rx.notices["s"][1:]
    assert suspended.next_seq == resumed.next_seq == count


def record_state(name: str):
    from shared.states import SessionState

    return SessionState(name)


async def test_an_emulated_gpu_paces_each_pass_to_its_profile(env):
    from shared.profile import load_profile

    h20 = load_profile()
    async with worker_in_process(env, worker_id="emu", emulate="H20") as (service, ctx, rx):
        assert service.pace.slots == h20.capacity == 12
        assert service.pace.period_s == h20.deadline_ms / 1000
        for sid in ("a", "b"):
            await start_session(ctx, "emu", sid)
        await eventually(
            lambda: len(rx.chunks["a"]) >= 3 and len(rx.chunks["b"]) >= 3, 30, "chunks"
        )
        beat = {w.id: w for w in await ctx.registry.workers()}["emu"]
    assert beat.gpu_kind == "H20" and beat.emulated == "H20" and beat.capacity == 12
    chunks = [c for sid in ("a", "b") for _, c in rx.chunks[sid][1:]]
    for c in chunks:
        # Each chunk's passes took (at least) the profile's time for their batch sizes.
        assert h20.chunk_ms(1) * 0.95 <= c.gen_ms <= h20.chunk_ms(2) * 1.5, c.gen_ms
    assert all(beat.pass_ms[b] >= h20.pass_ms(b) * 0.95 for b in beat.pass_ms)
