"""The provisioner: the only service that starts or stops workers.

Commands arrive on ``<prefix>.provisioner.cmd`` (:class:`ProvisionerCommand`: START the workers
the scheduler names, or a count of new ones; STOP named ones); sent as NATS requests they are
answered with a :class:`ProvisionerReply`. What happens to each worker is published on
``<prefix>.provisioner.events``: BOOTING when its request is accepted, READY at its first READY
heartbeat, GONE when it was stopped, died or was refused. The rules (limits, drain before
release, idempotence) are the pool's (``pool.py``); the backend (``backend.py``) only launches and
terminates. Every worker is metered in GPU-seconds from its request to its end (``shared.meter``),
and every scale event is recorded in the registry for operators.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from typing import Any

from redis.exceptions import RedisError

from services.provisioner.backends.base import Backend, BackendError, LaunchError
from services.provisioner.backends.registry import make_backend
from services.provisioner.callout import Callout, Enrolment, WorkerCredentials
from services.provisioner.metrics import ProvisionerMetrics
from services.provisioner.pool import (
    ID_IN_USE,
    MIN_WORKERS,
    SHUTTING_DOWN,
    STATUS_OF,
    ManagedState,
    ManagedWorker,
    Pool,
    PoolRefusal,
    PoolVerdict,
)
from shared.backoff import retried
from shared.callout import IssuerKey
from shared.enrol import ENROL_LAUNCHED, ENROL_UNKNOWN_WORKER, ENROL_WORKER_ALIVE
from shared.logging import get_logger
from shared.meter import Meter
from shared.ops import OpsServer, close_ops, start_ops
from shared.registry import PoolLimits
from shared.runner import ServiceContext, subscriptions_live
from shared.security import with_user
from shared.settings import ProvisionerSettings
from shared.wire import (
    Heartbeat,
    ProvisionerCmdKind,
    ProvisionerCommand,
    ProvisionerEvent,
    ProvisionerRefusal,
    ProvisionerReply,
    WorkerStatus,
    decode_or_drop,
    encode,
    sent_by,
    subject_worker,
)

log = get_logger("turboserve.provisioner")

MAX_RESTART_BACKOFF_S = 60.0
# An enrolled worker that beat within this is alive: its id cannot be enrolled again.
ALIVE_S = 10.0
# An enrolled worker not heard from this long loses its credential (the scheduler has long
# counted it lost); how often that is looked at.
QUIET_S = 60.0
SWEEP_S = 5.0
# How often the provisioner looks for records of its own that Redis lost.
RECORDS_CHECK_S = 2.0


def new_worker_id() -> str:
    return f"w-{uuid.uuid4().hex[:8]}"


class ProvisionerService:
    name = "provisioner"

    def __init__(self, settings: ProvisionerSettings, backend: Backend | None = None) -> None:
        self.settings = settings
        self.backend = backend if backend is not None else make_backend(settings)
        self.pool = Pool(
            settings.min_workers, settings.max_workers, self.backend.capacity, settings.emulate
        )
        self.metrics = ProvisionerMetrics(self.pool, self.backend.name)
        self.ctx: ServiceContext | None = None
        self.meter: Meter | None = None
        self.ops: OpsServer | None = None
        self._stopping = False
        self._stop_requested = asyncio.Event()  # wakes whatever waits to try again
        self._lock = asyncio.Lock()  # one command (or refill) decides at a time
        self._boots: dict[str, asyncio.Task[None]] = {}
        self._restart_backoff_s = 1.0
        # With the NATS auth callout: a credential per worker it starts, and its answers.
        self.credentials: WorkerCredentials | None = None
        self.callout: Callout | None = None
        self.enrolment: Enrolment | None = None
        # Workers it did not start that enrolled (id -> when), and every worker's last beat.
        self._enrolled: dict[str, float] = {}
        self._last_beat: dict[str, float] = {}

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.meter = Meter(
            ctx.redis,
            ctx.settings.redis_namespace,
            ctx.settings.redis_wait_replicas,
            ctx.settings.redis_wait_ms,
        )
        if self.settings.callout_key:  # before any worker it starts tries to connect
            self.credentials = WorkerCredentials(ctx.redis, ctx.settings.redis_namespace)
            self.callout = Callout(
                ctx.nc,
                IssuerKey.from_text(self.settings.callout_key),
                self.credentials,
                ctx.subjects,
                self.metrics.callouts,
            )
            await self.callout.start()
            self.enrolment = Enrolment(
                ctx.nc,
                self.credentials,
                ctx.subjects,
                self._admit,
                self._on_enrolled,
                self.metrics.enrolments,
            )
            # Credentials left from before a restart count as just enrolled: they get one
            # boot timeout to be heard from.
            now = time.time()
            self._enrolled = dict.fromkeys(await self.credentials.ids(), now)
            await self.enrolment.start()
            ctx.spawn(self._sweep_enrolled(), name="sweep-enrolled")
        adopted = await self.backend.open(ctx.spawn, self._on_exit)
        await self._take_over(adopted)
        await self._publish_limits()
        await ctx.nc.subscribe(ctx.subjects.worker_heartbeats, cb=self._on_heartbeat)
        await ctx.nc.subscribe(ctx.subjects.provisioner_cmd, cb=self._on_command)
        # A command published (from another connection) before the server holds our SUB would
        # be dropped: started means listening.
        await subscriptions_live(ctx.nc)
        self.ops = await start_ops(
            ctx, self.metrics.registry, service=self.name, details=self._health_details
        )
        log.info(
            "provisioner_ready",
            backend=self.backend.name,
            min_workers=self.pool.min_workers,
            max_workers=self.pool.max_size,
            emulate=self.settings.emulate or None,
            boot_delay_s=self.settings.boot_delay_s,
        )
        ctx.spawn(self._keep_records(), name="keep-records")
        await self._fill()

    async def _keep_records(self) -> None:
        """Every ``RECORDS_CHECK_S``: write back what Redis lost of this provisioner's own
        records (:meth:`write_back`), until it stops."""
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop_requested.wait(), timeout=RECORDS_CHECK_S)
            if self._stopping:
                return
            try:
                await self.write_back()
            except RedisError as exc:  # Redis away: the next check tries again
                log.warning("records_not_checked", error=str(exc))

    async def write_back(self) -> list[str]:
        """The pool's limits and the open runs of the workers it holds, where Redis lost
        them (restarted empty, or a failover lost the write): each run as it opened, so the
        meter counts the GPU-seconds since then; and a run still open of a worker it no
        longer holds (a failover lost its close) is closed. Returns the workers whose run
        came back."""
        assert self.ctx is not None and self.meter is not None
        if await self.ctx.registry.pool_limits() is None:
            await self._publish_limits()
            log.warning("pool_limits_written_back")
        opened = (await self.meter.read()).open
        for wid in [wid for wid in opened if self.pool.get(wid) is None]:
            # Added to the pool before its run opens, removed before it closes: gone.
            seconds = await self.meter.close(wid)
            if seconds is not None:
                log.warning("stale_meter_closed", worker_id=wid, gpu_seconds=seconds)
        # A worker leaves the pool before its run is closed: one still in it after the read
        # whose run is not open lost it.
        lost = {
            wid: managed.requested_at
            for wid, managed in self.pool.workers.items()
            if wid not in opened
        }
        restored = await self.meter.restore(lost)
        for wid in restored:
            if self.pool.get(wid) is None:  # gone meanwhile: its close found nothing open
                await self.meter.forget(wid)
                continue
            log.warning("meter_run_written_back", worker_id=wid, opened_at=lost[wid])
        return [wid for wid in restored if self.pool.get(wid) is not None]

    async def _publish_limits(self) -> None:
        """The pool's limits in the registry, for the scheduler (it follows them)."""
        assert self.ctx is not None
        await self.ctx.registry.set_pool_limits(
            PoolLimits(self.pool.min_workers, self.pool.max_size, self.backend.name)
        )

    async def stop(self) -> None:
        """Refuse new commands; local workers stop with the provisioner (pods do not)."""
        if self._stopping:
            return
        self._stopping = True
        self._stop_requested.set()
        async with self._lock:
            for managed in list(self.pool.workers.values()):
                async with managed.lock:  # a launch in progress ends first
                    await self._cancel_boot(managed.worker_id)
                    launched = managed.launched
                if not launched:  # still in its boot delay: nothing to stop
                    await self._gone(managed, "provisioner_stopped", "the provisioner stopped")
            stopped = await self.backend.close(self._worker_grace_s)
            for wid in stopped:
                gone = self.pool.get(wid)
                if gone is not None:
                    await self._cancel_boot(wid)
                    await self._gone(gone, "provisioner_stopped", "the provisioner stopped")
        if self.enrolment is not None:
            with contextlib.suppress(Exception):
                await self.enrolment.close()
        if self.callout is not None:  # its workers are gone: nobody left to admit
            with contextlib.suppress(Exception):
                await self.callout.close()
        await close_ops(self.ops)

    @property
    def _worker_grace_s(self) -> float:
        # Inside the runner's own grace period, so leave room for the SIGKILL escalation.
        return 0.8 * self.settings.shutdown_grace_s

    def _health_details(self) -> dict[str, Any]:
        return {
            "backend": self.backend.name,
            "workers": {state.value: n for state, n in self.pool.counts().items()},
            "min_workers": self.pool.min_workers,
            "max_workers": self.pool.max_size,
            "emulated": self.settings.emulate or None,
            "stopping": self._stopping,
        }

    # -- commands -------------------------------------------------------------------------------
    async def _on_command(self, msg: Any) -> None:
        cmd = decode_or_drop(msg.subject, msg.data, ProvisionerCommand, log)
        if cmd is None:
            return
        if cmd.kind is ProvisionerCmdKind.START:
            reply = await self.start_workers(
                cmd.worker_ids, cmd.count, gpu_kind=cmd.gpu_kind, command_id=cmd.command_id
            )
        else:
            reply = await self.stop_workers(cmd.worker_ids, command_id=cmd.command_id)
        log.info(
            "provisioner_command",
            kind=str(cmd.kind),
            command_id=cmd.command_id or None,
            started=reply.started,
            stopping=reply.stopping,
            unchanged=reply.unchanged,
            refused=[f"{r.worker_id or '-'}:{r.code}" for r in reply.refused],
        )
        if msg.reply:
            await msg.respond(encode(reply))

    async def start_workers(
        self,
        worker_ids: list[str],
        count: int,
        *,
        gpu_kind: str | None = None,
        command_id: str = "",
    ) -> ProvisionerReply:
        """START: the named workers (or ``count`` new ones) boot, unless refused."""
        async with self._lock:
            verdict = await self._start_locked(worker_ids, count, gpu_kind, command_id)
        return _reply(ProvisionerCmdKind.START, verdict, command_id, started=True)

    async def _start_locked(
        self, worker_ids: list[str], count: int, gpu_kind: str | None, command_id: str
    ) -> PoolVerdict:
        if self._stopping:
            verdict = _refuse_all(worker_ids, count, SHUTTING_DOWN, "the provisioner is stopping")
        else:
            in_use = await self._live_worker_ids()
            verdict = self.pool.start(
                worker_ids,
                count,
                now=time.time(),
                new_id=new_worker_id,
                in_use=in_use,
                gpu_kind=gpu_kind,
                command_id=command_id,
            )
        for wid in verdict.accepted:
            await self._boot(self.pool.workers[wid])
        for refusal in verdict.refused:
            self.metrics.refusal("start", refusal.code)
            # A refused request is a GPU that will not come: say so for the named ones. Not for
            # an id in use: that worker is alive, and "gone" would be a lie about it.
            if refusal.worker_id and refusal.code != ID_IN_USE:
                await self._event(
                    refusal.worker_id,
                    WorkerStatus.GONE,
                    code=refusal.code,
                    detail=refusal.detail,
                    command_id=command_id,
                )
        return verdict

    async def stop_workers(
        self, worker_ids: list[str], *, command_id: str = ""
    ) -> ProvisionerReply:
        """STOP: the named workers are released, unless one still holds sessions (the scheduler
        drains first) or the pool would fall below ``min_workers``."""
        async with self._lock:
            if self._stopping:
                verdict = _refuse_all(worker_ids, 0, SHUTTING_DOWN, "the provisioner is stopping")
            else:
                holdings = await self._holdings(worker_ids)
                verdict = self.pool.stop(worker_ids, holdings)
            for wid in verdict.accepted:
                managed = self.pool.workers[wid]
                managed.command_id = command_id
                assert self.ctx is not None
                self.ctx.spawn(self._release(managed, "stopped"), name=f"release-{wid}")
            if any(refusal.code == MIN_WORKERS for refusal in verdict.refused):
                # Asked to go below the floor: the record the scheduler follows may say another
                # floor (an earlier run's); ours again, so that it is not asked twice.
                await self._publish_limits()
            for refusal in verdict.refused:
                self.metrics.refusal("stop", refusal.code)
                kept = self.pool.get(refusal.worker_id)
                if kept is not None:
                    await self._event(
                        refusal.worker_id,
                        STATUS_OF[kept.state],
                        code=refusal.code,
                        detail=refusal.detail,
                        command_id=command_id,
                    )
        return _reply(ProvisionerCmdKind.STOP, verdict, command_id, started=False)

    async def _live_worker_ids(self) -> set[str]:
        assert self.ctx is not None
        return {w.id for w in await self.ctx.registry.workers() if w.alive}

    async def _holdings(self, worker_ids: list[str]) -> dict[str, list[str]]:
        """The sessions each worker holds, by its own record and by the placement map."""
        assert self.ctx is not None
        wanted = set(worker_ids)
        held: dict[str, set[str]] = {wid: set() for wid in wanted}
        for record in await self.ctx.registry.workers():
            if record.id in wanted:
                held[record.id].update(record.sessions)
                if record.active and not record.sessions:
                    held[record.id].add(f"<{record.active} active>")
        for session_id, owner in (await self.ctx.registry.placement()).items():
            if owner in wanted:
                held[owner].add(session_id)
        return {wid: sorted(s) for wid, s in held.items() if s}

    # -- one worker's life ------------------------------------------------------------------------
    async def _boot(self, managed: ManagedWorker) -> None:
        """Accepted: meter it, say BOOTING, and launch it after the boot delay."""
        assert self.ctx is not None and self.meter is not None
        managed.requested_at = await self.meter.open(managed.worker_id, at=managed.requested_at)
        self.metrics.booted()
        await self._event(
            managed.worker_id,
            WorkerStatus.BOOTING,
            command_id=managed.command_id,
            detail=f"boot delay {self.settings.boot_delay_s:g}s"
            if self.settings.boot_delay_s
            else "",
        )
        await self.ctx.registry.record_cluster_event(
            "scale_out",
            worker_id=managed.worker_id,
            backend=self.backend.name,
            emulated=self.settings.emulate or None,
            command_id=managed.command_id or None,
        )
        self._boots[managed.worker_id] = self.ctx.spawn(
            self._launch(managed), name=f"boot-{managed.worker_id}"
        )

    async def _launch(self, managed: ManagedWorker) -> None:
        if self.settings.boot_delay_s:
            await asyncio.sleep(self.settings.boot_delay_s)
        failure = None
        async with managed.lock:
            if managed.state is ManagedState.STOPPING or self._stopping:
                return
            try:
                nats_url = await self._credential(managed.worker_id)
                managed.where = await self.backend.launch(managed.worker_id, nats_url)
                managed.launched = True
            except LaunchError as exc:
                failure = str(exc)
        if failure is not None:
            log.warning("worker_launch_failed", worker_id=managed.worker_id, error=failure)
            self._boots.pop(managed.worker_id, None)
            await self._gone(managed, "launch_failed", failure)
            return
        await self._await_ready(managed)

    async def _credential(self, worker_id: str) -> str | None:
        """The NATS URL of a worker about to start, with a password made for it (None without
        the callout, or where the worker enrols for it: the backend's usual URL then)."""
        if self.credentials is None or not self.backend.credential_at_launch:
            return None
        try:
            password = await self.credentials.mint(worker_id)
        except RedisError as exc:
            raise LaunchError(f"its NATS credential could not be stored: {exc}") from None
        base = self.settings.worker_nats_url or self.settings.nats_url
        return with_user(base, worker_id, password)

    async def _await_ready(self, managed: ManagedWorker) -> None:
        """A worker not READY ``boot_timeout_s`` after its request is stopped."""
        remaining = managed.requested_at + self.settings.boot_timeout_s - time.time()
        try:
            await asyncio.wait_for(managed.ready.wait(), timeout=max(0.0, remaining))
        except TimeoutError:
            if (
                managed.state is ManagedState.BOOTING
                and self.pool.get(managed.worker_id) is managed
            ):
                log.warning(
                    "worker_boot_timeout",
                    worker_id=managed.worker_id,
                    boot_timeout_s=self.settings.boot_timeout_s,
                )
                managed.state = ManagedState.STOPPING
                self._boots.pop(managed.worker_id, None)
                await self._release(managed, "boot_timeout")

    async def _release(self, managed: ManagedWorker, code: str) -> None:
        """Terminate a STOPPING worker and report it gone. A launch in progress ends first
        (its lock), then the boot task is cancelled, so no process or pod is left."""
        async with managed.lock:
            await self._cancel_boot(managed.worker_id)
            how = await self._terminate(managed) if managed.launched else "never launched"
        if how is not None:
            await self._gone(managed, code, how)

    async def _terminate(self, managed: ManagedWorker) -> str | None:
        """The backend's terminate, tried again (with a backoff) until it works: a worker we
        let go of must go. None when the provisioner stops first (the worker stays STOPPING;
        a pod is taken over by the next provisioner)."""
        tries = 0

        async def attempt() -> str | None:
            nonlocal tries
            tries += 1
            if tries > 1 and self._stop_requested.is_set():
                return None
            return await self.backend.terminate(managed.worker_id, self._worker_grace_s)

        return await retried(
            attempt,
            "worker_terminate_failed",
            on=BackendError,
            first_s=1.0,
            cap_s=MAX_RESTART_BACKOFF_S,
            pause=self._pause_unless_stopping,
            say=log.warning,
            worker_id=managed.worker_id,
        )

    async def _pause_unless_stopping(self, seconds: float) -> None:
        """A pause between retries that ends early when the provisioner is told to stop."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop_requested.wait(), timeout=seconds)

    async def _cancel_boot(self, worker_id: str) -> None:
        task = self._boots.pop(worker_id, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    def _on_exit(self, worker_id: str, detail: str) -> None:
        """The backend saw a worker die on its own."""
        managed = self.pool.get(worker_id)
        if managed is None or managed.state is ManagedState.STOPPING or self.ctx is None:
            return
        log.warning("worker_exited", worker_id=worker_id, detail=detail)
        self.ctx.spawn(self._exited(managed, detail), name=f"exited-{worker_id}")

    async def _exited(self, managed: ManagedWorker, detail: str) -> None:
        await self._cancel_boot(managed.worker_id)
        await self._gone(managed, "exited", detail)

    async def _gone(self, managed: ManagedWorker, code: str, detail: str) -> None:
        """The worker no longer holds a GPU: close its meter, say GONE (once)."""
        if self.pool.get(managed.worker_id) is not managed:
            return
        self.pool.remove(managed.worker_id)
        assert self.ctx is not None and self.meter is not None
        if self.credentials is not None:  # its credential goes with it
            try:
                await self.credentials.revoke(managed.worker_id)
            except RedisError as exc:
                log.warning("credential_not_revoked", worker_id=managed.worker_id, error=str(exc))
        kind = "scale_in" if code == "stopped" else "worker_lost"
        try:
            seconds = await self.meter.close(managed.worker_id)
        except RedisError as exc:  # Redis away: the GONE event and the replacement go on
            log.warning("meter_not_closed", worker_id=managed.worker_id, error=str(exc))
            seconds = None
        if seconds is None:
            seconds = max(0.0, time.time() - managed.requested_at)
        self.metrics.departed(code, seconds)
        await self._event(
            managed.worker_id,
            WorkerStatus.GONE,
            code=code,
            detail=detail,
            command_id=managed.command_id,
            gpu_seconds=round(seconds, 3),
        )
        with contextlib.suppress(RedisError):
            await self.ctx.registry.record_cluster_event(
                kind,
                worker_id=managed.worker_id,
                code=code,
                detail=detail,
                gpu_seconds=round(seconds, 3),
                backend=self.backend.name,
            )
        if kind == "worker_lost" and code != "provisioner_stopped" and self.pool.deficit:
            self.ctx.spawn(self._replace_lost(), name=f"replace-{managed.worker_id}")

    async def _replace_lost(self) -> None:
        """Back to ``min_workers`` after a loss, backing off while workers keep failing."""
        await asyncio.sleep(self._restart_backoff_s)
        self._restart_backoff_s = min(2 * self._restart_backoff_s, MAX_RESTART_BACKOFF_S)
        await self._fill()

    async def _fill(self) -> None:
        """Start workers until the pool is back at ``min_workers``."""
        async with self._lock:
            if self.pool.deficit and not self._stopping:
                await self._start_locked([], self.pool.deficit, None, "min_workers")

    async def _take_over(self, adopted: dict[str, float]) -> None:
        """Workers the backend already runs (pods after a provisioner restart) join the pool;
        meters left open by workers that died unwatched are closed."""
        assert self.ctx is not None and self.meter is not None
        ready = {
            w.id
            for w in await self.ctx.registry.workers()
            if w.alive and w.status in (WorkerStatus.READY, WorkerStatus.DRAINING)
        }
        for wid, created_at in adopted.items():
            managed = ManagedWorker(
                wid,
                requested_at=await self.meter.open(wid, at=created_at),
                launched=True,
                command_id="adopted",
            )
            self.pool.workers[wid] = managed
            if wid in ready:
                self.pool.mark_ready(wid, time.time())
            else:
                self._boots[wid] = self.ctx.spawn(self._await_ready(managed), name=f"boot-{wid}")
        for wid in set((await self.meter.read()).open) - set(adopted):
            seconds = await self.meter.close(wid)
            log.warning("stale_meter_closed", worker_id=wid, gpu_seconds=seconds)
            await self._event(
                wid,
                WorkerStatus.GONE,
                code="exited",
                detail="not running when the provisioner started",
            )

    # -- enrolment ------------------------------------------------------------------------------
    async def _admit(self, worker_id: str) -> str | None:
        """Whether a worker may have a credential for ``worker_id`` now: not while a worker with
        that id beats (its credential would be taken over). Where its backend gives the
        credential at launch, not for a worker it launched (it has one) and any other id (a
        pool it did not start: compose's); where its workers enrol (pods), only its own."""
        if time.time() - self._last_beat.get(worker_id, -math.inf) < ALIVE_S:
            return ENROL_WORKER_ALIVE
        launched = self.pool.get(worker_id) is not None
        if self.backend.credential_at_launch and launched:
            return ENROL_LAUNCHED
        if not self.backend.credential_at_launch and not launched:
            return ENROL_UNKNOWN_WORKER
        return None

    def _on_enrolled(self, worker_id: str) -> None:
        self._enrolled[worker_id] = time.time()

    async def _sweep_enrolled(self) -> None:
        """Revoke the credential of an enrolled worker gone quiet: QUIET_S after its last beat,
        or a boot timeout after it enrolled when it has not beaten since. Only while this
        provisioner hears the mesh: after it was disconnected itself, every enrolled worker
        gets a boot timeout again. A worker it started is not swept: its credential goes when
        it stops or is lost (:meth:`_gone`)."""
        assert self.credentials is not None and self.ctx is not None
        blind = False
        while not self._stopping:
            await asyncio.sleep(SWEEP_S)
            now = time.time()
            if not self.ctx.nc.is_connected:
                blind = True
                continue
            if blind:
                blind = False
                self._enrolled = dict.fromkeys(self._enrolled, now)
            for wid, enrolled_at in list(self._enrolled.items()):
                if self.pool.get(wid) is not None:
                    self._enrolled.pop(wid, None)  # launched here since: its own credential
                    continue
                beat = self._last_beat.get(wid, -math.inf)
                if beat >= enrolled_at:  # heard from since it enrolled
                    quiet = now - beat > QUIET_S
                else:
                    quiet = now - enrolled_at > self.settings.boot_timeout_s
                if quiet:
                    await self._revoke_enrolled(wid)
            # Beats older than QUIET_S decide nothing any more (an enrolled worker that quiet
            # was revoked above).
            for wid, at in list(self._last_beat.items()):
                if now - at > QUIET_S and wid not in self._enrolled:
                    del self._last_beat[wid]

    async def _revoke_enrolled(self, worker_id: str) -> None:
        assert self.credentials is not None
        try:
            await self.credentials.revoke(worker_id)
        except RedisError as exc:  # the next sweep tries again
            log.warning("credential_not_revoked", worker_id=worker_id, error=str(exc))
            return
        self._enrolled.pop(worker_id, None)
        self.metrics.revoked.inc()
        log.info("enrolled_credential_revoked", worker_id=worker_id, reason="heartbeats stopped")

    # -- heartbeats -------------------------------------------------------------------------------
    async def _on_heartbeat(self, msg: Any) -> None:
        beat = decode_or_drop(msg.subject, msg.data, Heartbeat, log)
        if beat is None or not sent_by(
            msg.subject, beat.worker_id, subject_worker(msg.subject), log
        ):
            return
        now = time.time()
        if self.enrolment is not None:  # who is alive, for the enrolments (pruned by the sweep)
            self._last_beat[beat.worker_id] = now
        if self.pool.get(beat.worker_id) is None:
            return
        if beat.status is WorkerStatus.READY:
            managed = self.pool.mark_ready(beat.worker_id, now)
            if managed is not None:
                boot_s = now - managed.requested_at
                self.metrics.ready(boot_s)
                self._restart_backoff_s = 1.0
                log.info(
                    "worker_ready",
                    worker_id=managed.worker_id,
                    boot_s=round(boot_s, 2),
                    where=managed.where,
                    emulated=beat.emulated or None,
                )
                await self._event(
                    managed.worker_id,
                    WorkerStatus.READY,
                    detail=managed.where,
                    command_id=managed.command_id,
                    boot_s=round(boot_s, 3),
                    gpu_kind=beat.gpu_kind,
                    emulated=beat.emulated or None,
                )
                return
        self.pool.mark_status(beat.worker_id, beat.status)

    async def _event(
        self,
        worker_id: str,
        status: WorkerStatus,
        *,
        code: str = "",
        detail: str = "",
        command_id: str = "",
        boot_s: float | None = None,
        gpu_seconds: float | None = None,
        gpu_kind: str = "",
        emulated: str | None = None,
    ) -> None:
        assert self.ctx is not None
        event = ProvisionerEvent(
            worker_id=worker_id,
            status=status,
            code=code,
            detail=detail,
            command_id=command_id,
            emulated=self.settings.emulate if emulated is None else emulated,
            gpu_kind=gpu_kind,
            boot_s=boot_s,
            gpu_seconds=gpu_seconds,
        )
        await self.ctx.nc.publish(self.ctx.subjects.provisioner_events, encode(event))


def _refuse_all(worker_ids: list[str], count: int, code: str, detail: str) -> PoolVerdict:
    ids = list(dict.fromkeys(worker_ids)) or [""] * count
    return PoolVerdict(refused=[PoolRefusal(code, wid, detail) for wid in ids])


def _reply(
    kind: ProvisionerCmdKind, verdict: PoolVerdict, command_id: str, *, started: bool
) -> ProvisionerReply:
    refused = [
        ProvisionerRefusal(code=r.code, worker_id=r.worker_id, detail=r.detail)
        for r in verdict.refused
    ]
    return ProvisionerReply(
        kind=kind,
        ok=not refused,
        command_id=command_id,
        started=verdict.accepted if started else [],
        stopping=[] if started else verdict.accepted,
        unchanged=verdict.unchanged,
        refused=refused,
    )
