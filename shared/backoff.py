"""Retrying with a doubling pause: the one retry helper of the tree, on ``tenacity``.

:func:`retried` calls an attempt until it returns, the failure is not one to retry, the
attempts run out, or the next pause would end past a deadline; the pause starts at
``first_s`` and doubles up to ``cap_s``. Each failure that is retried is logged once, as
``event`` with the caller's fields, the attempt's number, the error and the pause before the
next attempt; the failure that ends it is raised to the caller, who knows what giving up means
(a connect error, a command unanswered, a release put off).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import tenacity

from shared.logging import get_logger

T = TypeVar("T")
Retryable = type[BaseException] | tuple[type[BaseException], ...] | Callable[[BaseException], bool]

log = get_logger("turboserve.retry")


async def retried(
    attempt: Callable[[], Awaitable[T]],
    event: str,
    *,
    on: Retryable,
    first_s: float,
    cap_s: float,
    attempts: int | None = None,
    within_s: float | None = None,
    pause: Callable[[float], Awaitable[None]] = asyncio.sleep,
    say: Callable[..., Any] | None = None,
    error_key: str = "error",
    **fields: Any,
) -> T:
    """``attempt()``'s result, retried on ``on`` (exception types, or a predicate on the
    exception); without ``attempts`` or ``within_s`` it retries for ever. ``pause`` waits
    between attempts (one that returns early, on a stop, lets the next attempt see it).
    ``say`` logs a retry (the caller's logger and level; a warning here by default), with the
    error under ``error_key``."""
    stops: list[tenacity.stop.stop_base] = []
    if attempts is not None:
        stops.append(tenacity.stop_after_attempt(attempts))
    if within_s is not None:
        stops.append(tenacity.stop_before_delay(within_s))
    retrying = tenacity.AsyncRetrying(
        retry=(
            tenacity.retry_if_exception_type(on)
            if isinstance(on, type | tuple)
            else tenacity.retry_if_exception(on)
        ),
        wait=tenacity.wait_exponential(multiplier=first_s, max=cap_s),
        stop=tenacity.stop_any(*stops) if stops else tenacity.stop_never,
        sleep=pause,
        before_sleep=_logger(say or log.warning, event, error_key, fields),
        reraise=True,
    )

    async def once() -> T:
        # tenacity awaits only what it sees is a coroutine function; a lambda that returns a
        # coroutine would come back unawaited.
        return await attempt()

    return await retrying(once)


def _logger(
    say: Callable[..., Any], event: str, error_key: str, fields: dict[str, Any]
) -> Callable[[tenacity.RetryCallState], None]:
    def before_sleep(state: tenacity.RetryCallState) -> None:
        assert state.outcome is not None
        exc = state.outcome.exception()
        # A timeout's text is empty: its type says what it was.
        error = (str(exc) or type(exc).__name__) if exc is not None else ""
        say(
            event,
            **fields,
            attempt=state.attempt_number,
            **{error_key: error},
            retry_in_s=round(state.upcoming_sleep, 2),
        )

    return before_sleep
