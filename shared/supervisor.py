"""The one task supervisor: no fire-and-forget ``create_task`` anywhere in the services.

A :class:`Supervisor` keeps a reference to every task it starts (a task nobody holds can be
collected mid-flight), logs a task's failure with its name the moment it ends (never lost), tells
its owner through ``on_failure`` (the service runner stops the service), and at shutdown lets
the tasks finish for a while, then cancels the rest.

Where the work is scoped to one block and one failure should end its siblings (a WebSocket's
sender and steering), the code uses ``asyncio.TaskGroup`` instead. A service's own tasks do not
fit one: they are started from callbacks for as long as the service runs, one command failing
must not cancel the others, and shutdown is phased (stop taking work, let what is in flight
finish or hand off, only then cancel), which a TaskGroup's cancel-everything-on-first-failure
does not allow.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from shared.logging import get_logger

T = TypeVar("T")


class Supervisor:
    def __init__(
        self,
        failed_event: str = "task_failed",
        *,
        log: Any = None,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.failed_event = failed_event
        self.log = log if log is not None else get_logger("turboserve.tasks")
        self.on_failure = on_failure
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        """Run ``coro`` in a task this supervisor holds until it ends."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
        self.log.error(self.failed_event, task=task.get_name(), error=repr(exc), exc_info=exc)
        if self.on_failure is not None:
            self.on_failure(exc)

    async def wait(self, timeout_s: float | None = None) -> None:
        """Wait for the tasks running now to end, for at most ``timeout_s`` (None: no limit)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)

    async def cancel(self, wait_s: float = 0.0) -> None:
        """Cancel the tasks still running, and give them ``wait_s`` to unwind."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks and wait_s > 0:
            await asyncio.wait(tasks, timeout=wait_s)
