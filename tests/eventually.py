"""Waiting in tests: poll a condition until it holds, instead of sleeping a guessed time.

``check`` is called every ``interval`` seconds until it returns something truthy, and that
value is returned. A falsy value, or an ``AssertionError`` raised by ``check``, means "not yet":
the helper tries again. Any other exception ends the wait at once (a bug in the test or the
code under test is not retried). After ``timeout`` seconds the test fails with ``what`` and the
last value (or assertion message) seen, so a failure says what was awaited and how far it got.

``eventually`` is for async tests; ``check`` may be a plain function or return an awaitable.
``eventually_sync`` is the same for blocking code (threads, a browser driver).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar, overload

T = TypeVar("T")


def _timed_out(what: str, timeout: float, last: object) -> AssertionError:
    seen = f"assertion: {last}" if isinstance(last, AssertionError) else f"last value: {last!r}"
    return AssertionError(f"{what} not reached within {timeout:g} s ({seen})")


@overload
async def eventually(
    check: Callable[[], Awaitable[T]], timeout: float = ..., what: str = ..., interval: float = ...
) -> T: ...
@overload
async def eventually(
    check: Callable[[], T], timeout: float = ..., what: str = ..., interval: float = ...
) -> T: ...
async def eventually(
    check: Callable[[], object],
    timeout: float = 10.0,
    what: str = "condition",
    interval: float = 0.05,
) -> object:
    """Wait until ``check()`` is truthy (awaiting it if it is awaitable); return that value."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            result = check()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return result
            last = result
        except AssertionError as error:
            last = error
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout, last)
        await asyncio.sleep(interval)


def eventually_sync(
    check: Callable[[], T], timeout: float = 10.0, what: str = "condition", interval: float = 0.05
) -> T:
    """``eventually`` for blocking code: sleeps the thread between tries."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            result = check()
            if result:
                return result
            last = result
        except AssertionError as error:
            last = error
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout, last)
        time.sleep(interval)
