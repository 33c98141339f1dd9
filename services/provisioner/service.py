"""The provisioner: the only service that starts or stops workers.

Commands arrive on ``ts.provisioner.cmd`` (start N workers, stop these workers); what happens is
reported on ``ts.provisioner.events`` (booting, gone). Workers report ``ready`` themselves through
the registry once their model is loaded. The autoscaler drives it in the closed-loop wave; for
now it keeps ``min_workers`` running from the start.
"""

from __future__ import annotations

import asyncio
import uuid

from services.provisioner.local import LocalBackend
from shared.logging import get_logger
from shared.runner import ServiceContext
from shared.settings import ProvisionerSettings
from shared.wire import (
    ProvisionerCmdKind,
    ProvisionerCommand,
    ProvisionerEvent,
    WorkerStatus,
    decode_or_drop,
    encode,
)

log = get_logger("turboserve.provisioner")


class ProvisionerService:
    name = "provisioner"

    def __init__(self, settings: ProvisionerSettings) -> None:
        self.settings = settings
        self.backend = LocalBackend(extra_env={"TURBOSERVE_PRESET": settings.worker_preset})
        self.ctx: ServiceContext | None = None
        self._stopping = False
        self._restart_backoff_s = 1.0

    async def start(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        await ctx.nc.subscribe(ctx.subjects.provisioner_cmd, cb=self._on_command)
        for _ in range(self.settings.min_workers):
            await self.start_worker(self._new_id())

    async def stop(self) -> None:
        self._stopping = True
        # Inside the runner's own grace period, so leave room for the SIGKILL escalation.
        await self.backend.stop_all(grace_s=self._worker_grace_s)

    @property
    def _worker_grace_s(self) -> float:
        return 0.8 * self.settings.shutdown_grace_s

    def _new_id(self) -> str:
        return f"w-{uuid.uuid4().hex[:8]}"

    async def start_worker(self, worker_id: str) -> None:
        if worker_id in self.backend.workers:
            # Two processes with one id would both pass the epoch check: refuse.
            log.warning("worker_id_in_use", worker_id=worker_id)
            return
        if len(self.backend.workers) >= self.settings.max_workers:
            log.warning("max_workers_reached", max_workers=self.settings.max_workers, refused=worker_id)
            await self._event(worker_id, WorkerStatus.GONE, "refused: max_workers reached")
            return
        worker = await self.backend.start(worker_id)
        await self._event(worker_id, WorkerStatus.BOOTING, f"pid {worker.process.pid}")
        assert self.ctx is not None
        self.ctx.spawn(self.backend.watch(worker, self._on_exit), name=f"watch-{worker_id}")

    def _on_exit(self, worker_id: str, code: int) -> None:
        log.warning("worker_process_exited", worker_id=worker_id, code=code)
        if self.ctx is not None and not self._stopping:
            self.ctx.spawn(self._replace(worker_id, code), name=f"replace-{worker_id}")

    async def _replace(self, worker_id: str, code: int) -> None:
        """Report the loss; keep ``min_workers`` running, backing off if workers keep dying."""
        await self._event(worker_id, WorkerStatus.GONE, f"exit code {code}")
        if len(self.backend.workers) >= self.settings.min_workers:
            return
        await asyncio.sleep(self._restart_backoff_s)
        self._restart_backoff_s = min(2 * self._restart_backoff_s, 60.0)
        if not self._stopping and len(self.backend.workers) < self.settings.min_workers:
            await self.start_worker(self._new_id())

    async def _on_command(self, msg) -> None:
        cmd = decode_or_drop(msg.subject, msg.data, ProvisionerCommand, log)
        if cmd is None:
            return
        if self._stopping:
            return
        if cmd.kind is ProvisionerCmdKind.START:
            room = max(0, self.settings.max_workers - len(self.backend.workers))
            ids = cmd.worker_ids or [self._new_id() for _ in range(min(cmd.count, room))]
            for wid in ids:
                await self.start_worker(wid)
        elif cmd.kind is ProvisionerCmdKind.STOP:
            await asyncio.gather(*(self._stop_one(wid) for wid in cmd.worker_ids))

    async def _stop_one(self, worker_id: str) -> None:
        code = await self.backend.stop(worker_id, grace_s=self._worker_grace_s)
        if code is not None:
            await self._event(worker_id, WorkerStatus.GONE, f"stopped, exit code {code}")

    async def _event(self, worker_id: str, status: WorkerStatus, detail: str) -> None:
        assert self.ctx is not None
        event = ProvisionerEvent(worker_id=worker_id, status=status, detail=detail)
        await self.ctx.nc.publish(self.ctx.subjects.provisioner_events, encode(event))
