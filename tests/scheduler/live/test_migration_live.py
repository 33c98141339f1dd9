"""Live migration between real worker processes (tiny model, CPU, gloo), driven the way an
operator does it (``tools.ctl.Ctl``, the library behind ``turboserve ctl``), on the real NATS
and Redis. The test plays the scheduler (it places sessions) and the viewers (it reads every
chunk and notice published)."""

from __future__ import annotations

import asyncio
import os
import random
import signal

import orjson
import pytest

from shared.states import SessionState
from shared.wire import NoticeKind, WorkerCmdKind, WorkerCommand
from tests.eventually import eventually
from tests.gpu_worker.worker_harness import (
    Received,
    mesh_context,
    send,
    start_session,
    worker_processes,
)
from tools.ctl import Ctl, CtlError, format_status, status_json

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PERIOD = 0.2


def assert_consecutive(rx: Received, sid: str) -> list[int]:
    seqs = rx.seqs(sid)
    assert seqs == list(range(len(seqs))), f"{sid}: {seqs}"
    return seqs


async def stop(ctx, sid: str) -> None:
    record = await ctx.registry.transition(sid, SessionState.TERMINATED)
    if record.owner:
        await send(
            ctx,
            WorkerCommand(
                kind=WorkerCmdKind.STOP, worker_id=record.owner, epoch=record.epoch, session_id=sid
            ),
        )


async def test_a_migrated_session_continues_seamlessly_with_the_frames_it_would_have_made(env):
    async with (
        mesh_context(env) as (ctx, rx),
        worker_processes(ctx, env, ["wa", "wb"], chunk_period_s=PERIOD),
    ):
        ctl = Ctl(ctx)
        await start_session(ctx, "wa", "moved", prompt="a paper boat on a river", seed=7)
        await eventually(lambda: len(rx.chunks["moved"]) >= 4, 30, "chunks on wa")
        report = await ctl.migrate("moved", "wb", 30)
        assert report["ok"] and report["src"] == "wa" and report["dst"] == "wb"
        await eventually(lambda: len(rx.chunks["moved"]) >= 12, 30, "chunks on wb")
        await stop(ctx, "moved")
        # The same session (prompt, seed) without a move, alone on wa as "moved" was.
        await start_session(ctx, "wa", "still", prompt="a paper boat on a river", seed=7)
        await eventually(lambda: len(rx.chunks["still"]) >= 12, 30, "reference chunks")
        await stop(ctx, "still")
        record = await ctx.registry.get_session("moved")
    moved = [c for _, c in rx.chunks["moved"]][:12]
    still = [c for _, c in rx.chunks["still"]][:12]
    assert_consecutive(rx, "moved")
    workers = [c.worker_id for c in moved]
    switch = workers.index("wb")
    assert set(workers[:switch]) == {"wa"} and set(workers[switch:]) == {"wb"}
    for got, want in zip(moved, still, strict=True):
        assert got.seq == want.seq
        assert got.fmp4 == want.fmp4, f"chunk {got.seq} differs after the move"
    kinds = [(n.kind, n.worker_id, n.next_seq) for n in rx.notices["moved"]]
    assert kinds == [(NoticeKind.PLACED, "wa", 0), (NoticeKind.MIGRATED, "wb", switch)]
    assert record.state is SessionState.TERMINATED and record.epoch == report["epoch"] + 1


async def test_refused_migrations_leave_the_session_streaming_on_its_worker(env):
    async with (
        mesh_context(env) as (ctx, rx),
        worker_processes(
            ctx,
            env,
            ["wa", "wb"],
            chunk_period_s=PERIOD,
            per_worker={"wb": {"TURBOSERVE_MAX_SESSIONS": "1"}},
        ),
    ):
        ctl = Ctl(ctx)
        epoch = await start_session(ctx, "wa", "s")
        await start_session(ctx, "wb", "filler")
        await eventually(lambda: len(rx.chunks["s"]) >= 3 and rx.chunks["filler"], 30, "chunks")
        # 1. The target is full.
        with pytest.raises(CtlError, match="full"):
            await ctl.migrate("s", "wb", 30)
        # 2. A command from the past (another epoch) is refused by the source.
        stale = WorkerCommand(
            kind=WorkerCmdKind.MIGRATE,
            worker_id="wa",
            session_id="s",
            epoch=epoch - 1,
            target="wb",
            command_id="stale",
        )
        with pytest.raises(CtlError, match="stale_epoch"):
            await ctl.command("wa", stale)
        # 3. The target is draining.
        await stop(ctx, "filler")
        await ctl.command("wb", WorkerCommand(kind=WorkerCmdKind.DRAIN, worker_id="wb"))
        with pytest.raises(CtlError, match="draining"):
            await ctl.migrate("s", "wb", 30)
        await ctl.command("wb", WorkerCommand(kind=WorkerCmdKind.UNDRAIN, worker_id="wb"))
        count = len(rx.chunks["s"])
        await eventually(lambda: len(rx.chunks["s"]) >= count + 2, 30, "chunks after refusals")
        record = await ctx.registry.get_session("s")
        assert record.owner == "wa" and record.state is SessionState.EXECUTING
    assert_consecutive(rx, "s")
    assert {c.worker_id for _, c in rx.chunks["s"]} == {"wa"}


async def test_a_dead_destination_aborts_and_the_session_stays(env):
    async with (
        mesh_context(env) as (ctx, rx),
        worker_processes(ctx, env, ["wa", "wb"], chunk_period_s=PERIOD) as procs,
    ):
        ctl = Ctl(ctx)
        await start_session(ctx, "wa", "s")
        await eventually(lambda: len(rx.chunks["s"]) >= 3, 30, "chunks")
        procs["wb"].send_signal(signal.SIGKILL)
        await asyncio.to_thread(procs["wb"].wait)
        with pytest.raises(CtlError, match="failed"):
            await ctl.migrate("s", "wb", 60)
        count = len(rx.chunks["s"])
        await eventually(lambda: len(rx.chunks["s"]) >= count + 3, 30, "chunks after the abort")
        record = await ctx.registry.get_session("s")
        assert record.owner == "wa" and record.state is SessionState.EXECUTING
    assert_consecutive(rx, "s")
    # It stays on wa under a new epoch, and the viewers were told before its next chunk.
    epochs = [c.epoch for _, c in rx.chunks["s"]]
    assert epochs[-1] == record.epoch > epochs[0]
    told = [n for n in rx.notices["s"] if n.epoch == record.epoch]
    assert [n.kind for n in told] == [NoticeKind.PLACED] and told[0].worker_id == "wa"
    assert told[0].next_seq == next(c.seq for _, c in rx.chunks["s"] if c.epoch == record.epoch)


async def test_many_migrations_back_and_forth_under_load_keep_every_session_intact(env):
    rng = random.Random(7)
    sids = [f"s{i}" for i in range(4)]
    async with (
        mesh_context(env) as (ctx, rx),
        worker_processes(ctx, env, ["wa", "wb"], chunk_period_s=PERIOD),
    ):
        ctl = Ctl(ctx)
        for i, sid in enumerate(sids):
            await start_session(ctx, "wa" if i % 2 else "wb", sid, seed=i)
        await eventually(lambda: all(len(rx.chunks[s]) >= 2 for s in sids), 30, "chunks")
        moves = 0
        for _ in range(8):  # two migrations at a time, in opposite directions when they can
            pair = rng.sample(sids, 2)
            placement = await ctx.registry.placement()
            targets = {sid: "wb" if placement[sid] == "wa" else "wa" for sid in pair}
            reports = await asyncio.gather(
                *(ctl.migrate(sid, dst, 60) for sid, dst in targets.items())
            )
            moves += sum(1 for r in reports if r["ok"])
        assert moves == 16
        counts = {s: len(rx.chunks[s]) for s in sids}
        await eventually(
            lambda: all(len(rx.chunks[s]) >= counts[s] + 2 for s in sids),
            30,
            "every session still streaming",
        )
        placement = await ctx.registry.placement()
        status = await ctl.status()
    held = {w["id"]: {s["id"] for s in w["sessions"]} for w in status["workers"]}
    # what `ctl status --json` prints, and the table, from the same status
    printed = orjson.loads(status_json(status))
    assert {w["id"] for w in printed["workers"]} == set(held)
    assert all(w in format_status(status) for w in held)
    for sid in sids:
        assert_consecutive(rx, sid)
        owners = [wid for wid, ss in held.items() if sid in ss]
        assert owners == [placement[sid]], (sid, owners)  # never owned twice


async def test_ctl_drain_empties_a_worker_with_active_and_suspended_sessions(env):
    async with (
        mesh_context(env) as (ctx, rx),
        worker_processes(ctx, env, ["wa", "wb"], chunk_period_s=PERIOD),
    ):
        ctl = Ctl(ctx)
        for sid in ("a1", "a2", "idle"):
            await start_session(ctx, "wa", sid)
        await eventually(
            lambda: all(len(rx.chunks[s]) >= 2 for s in ("a1", "a2", "idle")), 30, "chunks"
        )
        record = await ctx.registry.transition("idle", SessionState.SUSPENDED)
        await send(
            ctx,
            WorkerCommand(
                kind=WorkerCmdKind.SUSPEND, worker_id="wa", epoch=record.epoch, session_id="idle"
            ),
        )
        await eventually(
            lambda: any(n.kind is NoticeKind.SUSPENDED for n in rx.notices["idle"]),
            10,
            "the suspend",
        )
        idle_seq = len(rx.chunks["idle"])
        moved = await ctl.drain("wa", 60)
        assert moved == 3
        status = {w["id"]: w for w in (await ctl.status())["workers"]}
        assert status["wa"]["status"] == "drained" and status["wa"]["sessions"] == []
        assert {s["id"] for s in status["wb"]["sessions"]} == {"a1", "a2", "idle"}
        idle = await ctx.registry.get_session("idle")
        assert idle.owner == "wb" and idle.state is SessionState.SUSPENDED
        # The suspended session resumes on its new worker at its next seq.
        record = await ctx.registry.transition("idle", SessionState.EXECUTING)
        await send(
            ctx,
            WorkerCommand(
                kind=WorkerCmdKind.RESUME, worker_id="wb", epoch=record.epoch, session_id="idle"
            ),
        )
        counts = {s: len(rx.chunks[s]) for s in ("a1", "a2")}
        await eventually(
            lambda: (
                len(rx.chunks["idle"]) >= idle_seq + 2
                and all(len(rx.chunks[s]) >= counts[s] + 2 for s in counts)
            ),
            30,
            "streams on wb",
        )
    for sid in ("a1", "a2", "idle"):
        assert_consecutive(rx, sid)
        assert rx.chunks[sid][-1][1].worker_id == "wb"


async def test_the_source_killed_mid_handoff_never_leaves_a_session_owned_twice(env):
    async with (
        mesh_context(env) as (ctx, rx),
        worker_processes(ctx, env, ["wa", "wb"], chunk_period_s=PERIOD) as procs,
    ):
        await start_session(ctx, "wa", "s")
        await eventually(lambda: len(rx.chunks["s"]) >= 3, 30, "chunks")
        record = await ctx.registry.get_session("s")
        await send(
            ctx,
            WorkerCommand(
                kind=WorkerCmdKind.MIGRATE,
                worker_id="wa",
                session_id="s",
                epoch=record.epoch,
                target="wb",
            ),
        )
        os.kill(procs["wa"].pid, signal.SIGKILL)
        await asyncio.to_thread(procs["wa"].wait)
        # The wait is the test: the handoff settles one way or the other meanwhile, and the way
        # where the destination gives up changes nothing there is to wait for.
        await asyncio.sleep(3.0)
        record = await ctx.registry.get_session("s")
        beat_b = {w.id: w for w in await ctx.registry.workers()}["wb"]
    assert_consecutive(rx, "s")  # nothing repeated, nothing skipped
    if record.owner == "wb":  # the commit won the race: wb generates it, and only wb
        assert "s" in beat_b.sessions and record.state is SessionState.EXECUTING
    else:  # the source died first: the session waits, owned by the dead worker, for a requeue
        assert record.owner == "wa" and "s" not in beat_b.sessions
