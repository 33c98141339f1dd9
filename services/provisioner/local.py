"""The local backend: GPU workers as child processes of the provisioner.

Each worker is ``python -m services.cli worker`` with its id in ``TURBOSERVE_WORKER_ID`` and the
rest of the environment inherited. On Linux a worker also gets SIGTERM if the provisioner dies
(``PR_SET_PDEATHSIG``), so even a killed provisioner leaves no orphan behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from services.proc import die_with_parent
from shared.logging import get_logger

log = get_logger("turboserve.provisioner")


@dataclass
class LocalWorker:
    worker_id: str
    process: asyncio.subprocess.Process


class LocalBackend:
    """Starts and stops worker processes on this machine."""

    def __init__(self, extra_env: dict[str, str] | None = None) -> None:
        self.extra_env = extra_env or {}
        self.workers: dict[str, LocalWorker] = {}

    async def start(self, worker_id: str) -> LocalWorker:
        env = {**os.environ, **self.extra_env, "TURBOSERVE_WORKER_ID": worker_id}
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.cli", "worker",
            env=env, preexec_fn=die_with_parent,
        )
        worker = LocalWorker(worker_id, process)
        self.workers[worker_id] = worker
        log.info("worker_process_started", worker_id=worker_id, pid=process.pid)
        return worker

    async def stop(self, worker_id: str, grace_s: float) -> int | None:
        worker = self.workers.pop(worker_id, None)
        if worker is None:
            return None
        return await _terminate(worker.process, grace_s)

    async def stop_all(self, grace_s: float) -> None:
        ids = list(self.workers)
        await asyncio.gather(*(self.stop(wid, grace_s) for wid in ids))

    async def watch(self, worker: LocalWorker, on_exit: Callable[[str, int], object]) -> None:
        code = await worker.process.wait()
        if self.workers.get(worker.worker_id) is worker:  # died on its own, not stopped by us
            del self.workers[worker.worker_id]
            on_exit(worker.worker_id, code)


async def _terminate(process: asyncio.subprocess.Process, grace_s: float) -> int:
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        try:
            await asyncio.wait_for(process.wait(), timeout=grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
    return process.returncode if process.returncode is not None else -1
