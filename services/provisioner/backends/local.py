"""The local backend: GPU workers as child processes of the provisioner.

Each worker is ``python -m tools.cli worker`` with its id in ``TURBOSERVE_WORKER_ID``, its
GPU in ``CUDA_VISIBLE_DEVICES`` (by UUID, so that the numbering of the devices does not matter)
and the rest of the environment inherited: ``TURBOSERVE_PRESET``, ``TURBOSERVE_DEVICE``,
``TURBOSERVE_EMULATE`` ... mean for the worker what they mean everywhere. The mesh settings
(NATS and Redis URLs, subject prefix, Redis namespace) are the provisioner's own, so a worker
always joins the mesh that started it; only its credentials differ where
``TURBOSERVE_WORKER_NATS_URL`` / ``TURBOSERVE_WORKER_REDIS_URL`` give them.

With GPUs, there is one worker per GPU at most; without, CPU workers up to ``max_workers``. On
Linux a worker also gets SIGTERM if the provisioner dies (``PR_SET_PDEATHSIG``), so even a
killed provisioner leaves no orphan behind. With ``TURBOSERVE_WORKER_LOG_DIR`` each worker
writes its own ``worker-<id>.log`` there (``turboserve up`` sets it to its log folder).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from services.provisioner.backends.base import LaunchError, OnExit, Spawn, mesh_env
from services.provisioner.gpus import GpuDevice, discover
from shared.logging import get_logger
from shared.proc import die_with_parent
from shared.settings import ProvisionerSettings

log = get_logger("turboserve.provisioner")


@dataclass
class LocalWorker:
    worker_id: str
    process: asyncio.subprocess.Process
    gpu: GpuDevice | None


class LocalBackend:
    """Starts and stops worker processes on this machine."""

    name = "local"
    credential_at_launch = True

    def __init__(self, settings: ProvisionerSettings, gpus: list[GpuDevice] | None = None) -> None:
        self.settings = settings
        self.gpus = discover(settings.gpus) if gpus is None else gpus
        self.capacity = len(self.gpus) or None
        self.workers: dict[str, LocalWorker] = {}
        self._spawn: Spawn | None = None
        self._on_exit: OnExit | None = None

    async def open(self, spawn: Spawn, on_exit: OnExit) -> dict[str, float]:
        log.info("local_backend", gpus=[str(g) for g in self.gpus] or "none: CPU workers")
        self._spawn, self._on_exit = spawn, on_exit
        return {}  # children die with their provisioner: there is never anything to take over

    def worker_env(
        self, worker_id: str, gpu: GpuDevice | None, nats_url: str | None = None
    ) -> dict[str, str]:
        s = self.settings
        env = {
            **os.environ,
            **mesh_env(s),
            "TURBOSERVE_NATS_URL": nats_url or s.worker_nats_url or s.nats_url,
            "TURBOSERVE_REDIS_URL": s.worker_redis_url or s.redis_url,
            "TURBOSERVE_WORKER_ID": worker_id,
        }
        # The worker needs its own credentials, never the provisioner's.
        env.pop("TURBOSERVE_WORKER_NATS_URL", None)
        env.pop("TURBOSERVE_WORKER_REDIS_URL", None)
        env.pop("TURBOSERVE_CALLOUT_KEY", None)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu.uuid
        # Workers share this host: one fixed ops port would be taken by the first of them.
        if s.metrics_port > 0:
            env["TURBOSERVE_METRICS_PORT"] = "0"
        return env

    def _free_gpu(self) -> GpuDevice | None:
        used = {w.gpu for w in self.workers.values()}
        return next((g for g in self.gpus if g not in used), None)

    async def launch(self, worker_id: str, nats_url: str | None = None) -> str:
        if worker_id in self.workers:
            return _where(self.workers[worker_id])
        gpu = self._free_gpu()
        if self.gpus and gpu is None:
            raise LaunchError(f"all {len(self.gpus)} GPUs are in use")
        try:
            with self._log_file(worker_id) as out:
                process = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "tools.cli",
                    "worker",
                    env=self.worker_env(worker_id, gpu, nats_url),
                    preexec_fn=die_with_parent,
                    stdout=out,
                    stderr=out,
                )
        except OSError as exc:
            raise LaunchError(f"could not start a worker process: {exc}") from exc
        worker = LocalWorker(worker_id, process, gpu)
        self.workers[worker_id] = worker
        assert self._spawn is not None, "open() first"
        self._spawn(self._watch(worker), f"watch-{worker_id}")
        log.info(
            "worker_process_started",
            worker_id=worker_id,
            pid=process.pid,
            gpu=str(gpu) if gpu else "cpu",
        )
        return _where(worker)

    def _log_file(self, worker_id: str) -> contextlib.AbstractContextManager[IO[bytes] | None]:
        """The worker's own log file (``worker_log_dir``), open for the launch only: the child
        keeps its copy of the descriptor. None: it writes where the provisioner does."""
        if not self.settings.worker_log_dir:
            return contextlib.nullcontext()
        folder = Path(self.settings.worker_log_dir).expanduser()
        folder.mkdir(parents=True, exist_ok=True)
        return open(folder / f"worker-{worker_id}.log", "ab")  # noqa: SIM115 - closed by with

    async def terminate(self, worker_id: str, grace_s: float) -> str:
        worker = self.workers.pop(worker_id, None)
        if worker is None:
            return "not running"
        code = await _terminate(worker.process, grace_s)
        return f"exit code {code}"

    async def close(self, grace_s: float) -> list[str]:
        ids = list(self.workers)
        await asyncio.gather(*(self.terminate(wid, grace_s) for wid in ids))
        return ids

    async def _watch(self, worker: LocalWorker) -> None:
        code = await worker.process.wait()
        if self.workers.get(worker.worker_id) is worker:  # died on its own, not stopped by us
            del self.workers[worker.worker_id]
            assert self._on_exit is not None
            self._on_exit(worker.worker_id, f"exit code {code}")


def _where(worker: LocalWorker) -> str:
    gpu = f"GPU {worker.gpu}" if worker.gpu else "the CPU"
    return f"pid {worker.process.pid} on {gpu}"


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
