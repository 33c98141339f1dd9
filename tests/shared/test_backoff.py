"""The one retry helper: its pauses, its stops, what it retries and what it logs."""

from __future__ import annotations

import asyncio

import pytest
import structlog

from shared.backoff import retried


class Flaky:
    """Fails ``failures`` times with ``exc``, then returns ``"done"``."""

    def __init__(self, failures: int, exc: BaseException) -> None:
        self.failures, self.exc, self.calls = failures, exc, 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.exc
        return "done"


class Pauses(list[float]):
    async def __call__(self, seconds: float) -> None:
        self.append(seconds)


async def test_the_pause_doubles_up_to_its_cap_and_each_retry_is_logged() -> None:
    pauses = Pauses()
    with structlog.testing.capture_logs() as logs:
        result = await retried(
            Flaky(6, OSError("refused")),
            "thing_retry",
            on=OSError,
            first_s=0.2,
            cap_s=2.0,
            pause=pauses,
            target="nats",
        )
    assert result == "done"
    assert pauses == [0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    assert [entry["attempt"] for entry in logs] == [1, 2, 3, 4, 5, 6]
    assert logs[0] == {
        "event": "thing_retry",
        "log_level": "warning",
        "target": "nats",
        "attempt": 1,
        "error": "refused",
        "retry_in_s": 0.2,
    }


async def test_the_last_failure_is_raised_when_the_attempts_run_out() -> None:
    pauses, flaky = Pauses(), Flaky(10, TimeoutError())
    with structlog.testing.capture_logs() as logs, pytest.raises(TimeoutError):
        await retried(flaky, "x", on=TimeoutError, first_s=0.5, cap_s=5.0, attempts=3, pause=pauses)
    assert flaky.calls == 3
    assert pauses == [0.5, 1.0]  # no pause after the last attempt
    assert logs[0]["error"] == "TimeoutError"  # an empty text says its type


async def test_a_failure_not_retried_is_raised_at_once() -> None:
    flaky = Flaky(1, KeyError("no"))
    with pytest.raises(KeyError):
        await retried(flaky, "x", on=OSError, first_s=0.1, cap_s=1.0, pause=Pauses())
    assert flaky.calls == 1


async def test_a_lambda_that_returns_a_coroutine_is_awaited() -> None:
    flaky = Flaky(1, OSError("once"))
    result = await retried(lambda: flaky(), "x", on=OSError, first_s=0.1, cap_s=1.0, pause=Pauses())
    assert (result, flaky.calls) == ("done", 2)


async def test_a_predicate_picks_what_is_retried() -> None:
    flaky = Flaky(2, ValueError("later"))
    result = await retried(
        flaky,
        "x",
        on=lambda exc: isinstance(exc, ValueError),
        first_s=0.1,
        cap_s=1.0,
        pause=Pauses(),
    )
    assert (result, flaky.calls) == ("done", 3)


async def test_a_deadline_stops_before_a_pause_that_would_end_past_it() -> None:
    pauses = Pauses()

    async def pause(seconds: float) -> None:
        pauses.append(seconds)
        await asyncio.sleep(seconds)

    flaky = Flaky(100, OSError("down"))
    with pytest.raises(OSError):
        await retried(flaky, "x", on=OSError, first_s=0.05, cap_s=0.1, within_s=0.22, pause=pause)
    # 0.05 then 0.1 (ends near 0.15 s); the next pause would end near 0.25 s, past the deadline
    assert pauses == [0.05, 0.1]
    assert flaky.calls == 3


async def test_the_callers_logger_and_error_key() -> None:
    said: list[dict[str, object]] = []

    def say(event: str, **fields: object) -> None:
        said.append({"event": event, **fields})

    await retried(
        Flaky(1, OSError("lost")),
        "command_retry",
        on=OSError,
        first_s=0.1,
        cap_s=1.0,
        pause=Pauses(),
        say=say,
        error_key="why",
    )
    assert said == [{"event": "command_retry", "attempt": 1, "why": "lost", "retry_in_s": 0.1}]
