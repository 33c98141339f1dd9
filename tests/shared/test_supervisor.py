"""The one task supervisor: it holds its tasks, says a failure at once, and ends in phases."""

from __future__ import annotations

import asyncio

import structlog

from shared.supervisor import Supervisor


async def test_a_failure_is_logged_and_told_at_once_and_the_others_run_on() -> None:
    told: list[BaseException] = []
    tasks = Supervisor("thing_failed", on_failure=told.append)
    gate = asyncio.Event()

    async def fail() -> None:
        raise ValueError("broken")

    with structlog.testing.capture_logs() as logs:
        other = tasks.spawn(gate.wait(), "waits")
        failing = tasks.spawn(fail(), "fails")
        await asyncio.wait([failing])
        await asyncio.sleep(0)  # the done callback runs
    assert [type(exc) for exc in told] == [ValueError]
    assert logs[0]["event"] == "thing_failed" and logs[0]["task"] == "fails"
    assert not other.done() and len(tasks) == 1
    gate.set()
    await tasks.wait()
    assert other.done() and len(tasks) == 0


async def test_shutdown_lets_tasks_finish_for_a_while_then_cancels_the_rest() -> None:
    tasks = Supervisor()
    quick = tasks.spawn(asyncio.sleep(0.01), "quick")
    slow = tasks.spawn(asyncio.sleep(60), "slow")
    await tasks.wait(timeout_s=0.2)
    assert quick.done() and not slow.done()
    with structlog.testing.capture_logs() as logs:
        await tasks.cancel(wait_s=1.0)
    assert slow.cancelled() and len(tasks) == 0
    assert logs == []  # a cancelled task is not a failure
