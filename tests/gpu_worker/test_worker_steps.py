"""The quality budget at the worker: TURBOSERVE_MIN_STEPS, the STEPS command over the real NATS
(answered with the count applied, a malformed one refused), chunks and heartbeats that say the
step count, with the worker service in-process and the tiny model on the CPU."""

from __future__ import annotations

import time
from typing import Any

import pytest

from shared.settings import SchedulerSettings, SettingsError, WorkerSettings
from shared.wire import CommandReply, Heartbeat, WorkerCmdKind, WorkerCommand, decode, encode
from tests.eventually import eventually
from tests.gpu_worker.worker_harness import start_session, worker_in_process


@pytest.mark.parametrize("settings", [WorkerSettings, SchedulerSettings])
def test_min_steps_is_read_once_and_must_be_at_least_one(settings):
    assert settings.from_env({}).min_steps is None  # unset: the full count, the budget off
    assert settings.from_env({"TURBOSERVE_MIN_STEPS": "2"}).min_steps == 2
    for bad in ("0", "-1"):
        with pytest.raises(SettingsError, match=f"TURBOSERVE_MIN_STEPS={bad}: must be >= 1"):
            settings.from_env({"TURBOSERVE_MIN_STEPS": bad})
    with pytest.raises(SettingsError, match="TURBOSERVE_MIN_STEPS"):
        settings.from_env({"TURBOSERVE_MIN_STEPS": "two"})


async def _request(ctx: Any, cmd: WorkerCommand) -> CommandReply:
    msg = await ctx.nc.request(ctx.subjects.worker_cmd(cmd.worker_id), encode(cmd), timeout=5)
    return decode("reply", msg.data, CommandReply)


def _steps(value: int | None, command_id: str) -> WorkerCommand:
    return WorkerCommand(
        kind=WorkerCmdKind.STEPS, worker_id="wq", steps=value, command_id=command_id
    )


@pytest.mark.integration
@pytest.mark.slow
async def test_a_steps_command_sets_the_steps_of_later_chunks_and_heartbeats(env):
    beats: list[Heartbeat] = []
    async with worker_in_process(
        env, worker_id="wq", chunk_period_s=0.15, heartbeat_s=0.2, min_steps=2
    ) as (service, ctx, rx):

        async def on_beat(msg: Any) -> None:
            beat = decode(msg.subject, msg.data, Heartbeat)
            if beat.worker_id == "wq":
                beats.append(beat)

        await ctx.nc.subscribe(ctx.subjects.worker_heartbeats, cb=on_beat)
        await start_session(ctx, "wq", "s")
        await eventually(lambda: len(rx.chunks["s"]) >= 2, 20, "chunks at full steps")
        await eventually(lambda: beats and beats[-1].active == 1, 5, "a heartbeat with it")
        assert (beats[-1].steps, beats[-1].full_steps, beats[-1].min_steps) == (4, 4, 2)
        assert {c.steps for _, c in rx.chunks["s"]} == {4}

        reply = await _request(ctx, _steps(1, "c1"))  # below the floor: the floor applies
        answered_at = time.time()
        assert (reply.ok, reply.detail, reply.command_id) == (True, "steps=2", "c1")
        # Answered once applied: every heartbeat taken after the answer shows the budget.
        await eventually(lambda: any(b.at > answered_at for b in beats), 5, "a later beat")
        assert {b.steps for b in beats if b.at > answered_at} == {2}
        cut_from = len(rx.chunks["s"])
        await eventually(
            lambda: sum(c.steps == 2 for _, c in rx.chunks["s"][cut_from:]) >= 2,
            10,
            "chunks at two steps",
        )
        await eventually(lambda: beats[-1].steps == 2, 5, "the budget in the heartbeat")
        assert beats[-1].full_steps == 4 and beats[-1].min_steps == 2
        assert service.metrics.registry.get_sample_value("turboserve_worker_steps") == 2

        async def recorded() -> bool:
            records = [w for w in await ctx.registry.workers() if w.id == "wq"]
            return [(w.steps, w.full_steps) for w in records] == [(2, 4)]

        # Operators see it too (ctl status, /v1/cluster read the registry's record).
        await eventually(recorded, 5, "the budget in the registry")

        # Malformed: refused with a stable code; the worker and the stream go on.
        reply = await _request(ctx, _steps(None, "c2"))
        assert (reply.ok, reply.code, reply.command_id) == (False, "invalid", "c2")
        reply = await _request(ctx, _steps(9, "c3"))  # above the full count: the full count
        assert (reply.ok, reply.detail) == (True, "steps=4")
        back_from = len(rx.chunks["s"])
        await eventually(
            lambda: any(c.steps == 4 for _, c in rx.chunks["s"][back_from:]),
            10,
            "chunks at full steps again",
        )
        assert service._thread is not None and service._thread.is_alive()
        assert beats[-1].steps in (2, 4)
    seqs = rx.seqs("s")
    assert seqs == list(range(len(seqs)))  # the step count never touches the seq


@pytest.mark.integration
async def test_a_floor_above_the_full_count_stops_the_worker_at_start(env):
    with pytest.raises(
        SettingsError, match=r"TURBOSERVE_MIN_STEPS=5: .* 'tiny' runs 4 .* must be 1\.\.4"
    ):
        async with worker_in_process(env, worker_id="wf", min_steps=5):
            pass
