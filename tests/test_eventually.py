"""The tests' one polling helper: returns what the check gave, retries "not yet" (falsy or a
failed assert), stops at once on any other error, and on timeout says what it waited for and
the last thing it saw."""

from collections.abc import Callable

import pytest

from tests.eventually import eventually, eventually_sync


def ready_on_try(n: int) -> Callable[[], int]:
    """A check that is falsy (0) until its ``n``-th call, which returns ``n``."""
    tries: list[int] = []

    def check() -> int:
        tries.append(1)
        return len(tries) if len(tries) >= n else 0

    return check


async def test_returns_the_first_truthy_value_of_a_sync_or_async_check() -> None:
    assert await eventually(ready_on_try(3), timeout=5, interval=0) == 3

    async def async_check() -> str:
        return "here"

    assert await eventually(async_check) == "here"
    assert eventually_sync(ready_on_try(2), timeout=5, interval=0) == 2


async def test_a_failed_assert_is_retried_and_its_message_reported() -> None:
    tries: list[int] = []

    def check() -> bool:
        tries.append(1)
        assert len(tries) > 2, f"only {len(tries)} tries"
        return True

    assert await eventually(check, timeout=5, interval=0)

    def never() -> bool:
        raise AssertionError("the queue holds 4")

    with pytest.raises(
        AssertionError,
        match=r"^the queue empty not reached within 0.05 s "
        r"\(assertion: the queue holds 4\)$",
    ):
        await eventually(never, timeout=0.05, what="the queue empty", interval=0.01)


def test_the_timeout_names_what_was_awaited_and_the_last_value() -> None:
    with pytest.raises(
        AssertionError,
        match=r"^3 workers not reached within 0.05 s "
        r"\(last value: \[\]\)$",
    ):
        eventually_sync(list, timeout=0.05, what="3 workers", interval=0.01)


async def test_other_errors_end_the_wait_at_once() -> None:
    tries: list[int] = []

    def check() -> bool:
        tries.append(1)
        raise KeyError("gone")

    with pytest.raises(KeyError):
        await eventually(check, timeout=5, interval=0)
    assert tries == [1]
