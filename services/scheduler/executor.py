"""The live scheduler's hands: every decision of the core becomes commands.

``Assign``/``Resume``/``Suspend`` go to workers (ownership first moved in the registry by a
compare-and-set guarded by the lease), ``Migrate`` through the migration protocol,
``RequestGpus``/``Release`` to the provisioner, ``Drain`` and ``SetSteps`` (the quality budget)
to the worker. Commands are retried
until answered; a refused or failed one becomes the event the core expects (PLACEMENT_FAILED,
MIGRATION_FAILED, GPU_GONE). Migrations run in the background (:class:`Migrations`); a
session a worker handed back is placed again (:meth:`Executor.replace_handed_back`); a release
that does not go through is tried again (:class:`Releases`) for as long as the worker runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from nats.errors import Error as NatsError
from redis.exceptions import RedisError

from services.scheduler.core.types import (
    Assign,
    Decision,
    Drain,
    Event,
    EventKind,
    GpuState,
    Migrate,
    Release,
    RequestGpus,
    Resume,
    SetSteps,
    Suspend,
)
from services.scheduler.ledger import RELEASE_STOP_ATTEMPTS
from shared.logging import get_logger
from shared.registry import Registry, RegistryError, SessionRecord
from shared.states import IllegalTransition, SessionState
from shared.wire import (
    MigrationReport,
    ProvisionerCmdKind,
    ProvisionerCommand,
    WorkerCmdKind,
    WorkerCommand,
)

if TYPE_CHECKING:
    from services.scheduler.live import LiveScheduler

log = get_logger("turboserve.scheduler")

# A migration's report is awaited this long beyond the handoff's own time limit.
REPORT_GRACE_S = 10.0


class Executor:
    """Carries out the core's decisions for one leadership (``live``: the scheduler it serves)."""

    def __init__(self, live: LiveScheduler) -> None:
        self.live = live
        self.registry = live.ctx.registry
        self.ledger = live.ledger
        self.migrations = Migrations(self)
        self.releases = Releases(self)
        self._session_locks: dict[str, asyncio.Lock] = {}

    async def execute(self, decision: Decision) -> None:
        live = self.live
        try:
            if isinstance(decision, Assign):
                await self._assign(decision.session_id, decision.gpu_id)
            elif isinstance(decision, Resume):
                await self._resume(decision.session_id, decision.gpu_id)
            elif isinstance(decision, Suspend):
                await self._suspend(decision.session_id, decision.gpu_id)
            elif isinstance(decision, Migrate):
                self.migrations.start(decision)
            elif isinstance(decision, RequestGpus):
                self.ledger.request(decision.gpu_ids, time.time())
                live.spawn(self._request(list(decision.gpu_ids), decision.kind), "request-gpus")
                live.metrics.scale_events.labels("out").inc()
                # Counted as decisions, as the simulator counts them; the provisioner records
                # each worker it starts or stops as a cluster event.
                await self.registry.bump_counters(scale_out_events=1)
            elif isinstance(decision, Drain):
                self.ledger.our_drains.add(decision.gpu_id)
                live.spawn(self._drain(decision.gpu_id), f"drain-{decision.gpu_id}")
            elif isinstance(decision, Release):
                self.ledger.release(decision.gpu_id)
                self.releases.start(decision.gpu_id)
                live.metrics.scale_events.labels("in").inc()
                await self.registry.bump_counters(scale_in_events=1)
            elif isinstance(decision, SetSteps):
                self.ledger.want_steps(decision.gpu_id, decision.steps)
                self.send_steps(decision.gpu_id, decision.steps)
        except RegistryError as exc:  # GuardFailed included: the lease is gone
            log.warning("decision_not_carried_out", decision=describe(decision), error=str(exc))

    # -- sessions -------------------------------------------------------------------------------
    async def _assign(self, sid: str, gpu: str) -> None:
        live = self.live
        try:
            # One round trip when the session is pending: read and claimed in one script.
            placed = await self.registry.place(sid, gpu, guard=live.guard)
        except RegistryError as exc:
            log.info("claim_lost", session_id=sid, gpu_id=gpu, reason=str(exc))
            return
        record = placed.record
        if record is None or record.state is SessionState.TERMINATED:
            live.feed(Event(time.time(), EventKind.DEPART, session_id=sid))
            return
        if not placed.won:
            if record.state is SessionState.SUSPENDED and self.ledger.knows(record.owner):
                await self._resume(sid, gpu)  # its state is parked on a worker: resume it there
                return
            if record.owner == gpu and record.state is SessionState.EXECUTING:
                return  # already there
            if self.ledger.knows(record.owner):
                # The core's view was behind: the session runs elsewhere. Repair the view.
                live.feed(
                    Event(
                        time.time(), EventKind.MIGRATION_FAILED, session_id=sid, gpu_id=record.owner
                    )
                )
                return
            requeued = await self.requeue(record)
            if requeued is None:
                return
            try:
                record = await self.registry.claim(sid, gpu, requeued.epoch, guard=live.guard)
            except (IllegalTransition, RegistryError) as exc:
                log.info("claim_lost", session_id=sid, gpu_id=gpu, reason=str(exc))
                return
        cmd = WorkerCommand(
            kind=WorkerCmdKind.ASSIGN,
            worker_id=gpu,
            epoch=record.epoch,
            session_id=sid,
            prompt=record.prompt,
            seed=record.seed,
            seq=record.last_seq + 1,
            token_hash=record.token_hash,
            owner_key=record.owner_key,
        )
        live.spawn(self._deliver(sid, cmd, on_failure=EventKind.PLACEMENT_FAILED), f"assign-{sid}")

    async def requeue(self, record: SessionRecord) -> SessionRecord | None:
        """Back to pending (its worker is gone): the registry's half of a re-placement."""
        try:
            return await self.registry.transition(
                record.id,
                SessionState.PENDING,
                expected_epoch=record.epoch,
                owner=None,
                guard=self.live.guard,
            )
        except (IllegalTransition, RegistryError) as exc:
            log.info("requeue_skipped", session_id=record.id, reason=str(exc))
            return None

    async def _suspend(self, sid: str, gpu: str) -> None:
        record = await self.registry.get_session(sid)
        if record is None:
            return
        if sid in self.migrations.moving or record.state is SessionState.MIGRATING:
            # The core moved it when it decided; the registry names the source until the
            # handoff commits. Dropping the suspend would leave it running where it lands,
            # unwatched and holding a slot the core counts free: suspend it there instead.
            self.live.spawn(self._suspend_after_move(sid), f"suspend-{sid}")
            return
        if record.owner != gpu or record.state is not SessionState.EXECUTING:
            return
        self.live.spawn(self._deliver(sid, await self._suspend_command(record)), f"suspend-{sid}")

    async def _suspend_command(self, record: SessionRecord) -> WorkerCommand:
        """Mark an executing session suspended and the SUSPEND for its owner. Idle/active flips
        keep the epoch: the worker keeps the session (no fencing needed), and the commands to
        it are sent in order."""
        record = await self.registry.transition(
            record.id,
            SessionState.SUSPENDED,
            expected_epoch=record.epoch,
            bump_epoch=False,
            guard=self.live.guard,
        )
        assert record.owner is not None
        return WorkerCommand(
            kind=WorkerCmdKind.SUSPEND,
            worker_id=record.owner,
            epoch=record.epoch,
            session_id=record.id,
        )

    async def _suspend_after_move(self, sid: str) -> None:
        """The suspend of a session whose migration was in flight, once that has ended, on
        the worker that holds it then; nothing if it became active again meanwhile."""
        live = self.live
        deadline = time.monotonic() + live.handoff_timeout_s + REPORT_GRACE_S
        while time.monotonic() < deadline and not live.stopping.is_set():
            if sid not in self.migrations.moving:  # then the registry: a parked state's move
                record = await self.registry.get_session(sid)
                if record is None or record.state is not SessionState.MIGRATING:
                    break
            await asyncio.sleep(0.05)
        async with live.lock:  # in order with the decisions that follow
            if not live.core.view.is_idle(sid):
                return
            found = await self.registry.get_session(sid)
            if (
                found is None
                or found.state is not SessionState.EXECUTING
                or not self.ledger.knows(found.owner)
            ):
                return
            cmd = await self._suspend_command(found)
        await self._deliver(sid, cmd)

    async def _resume(self, sid: str, gpu: str) -> None:
        live = self.live
        record = await self.registry.get_session(sid)
        if record is None or record.state is SessionState.TERMINATED:
            live.feed(Event(time.time(), EventKind.DEPART, session_id=sid))
            return
        if record.state is SessionState.EXECUTING and record.owner == gpu:
            return
        holder = record.owner
        if (
            record.state is SessionState.SUSPENDED
            and holder is not None
            and self.ledger.knows(holder)
        ):
            if holder == gpu:
                record = await self.registry.transition(
                    sid,
                    SessionState.EXECUTING,
                    expected_epoch=record.epoch,
                    bump_epoch=False,
                    guard=live.guard,
                )
                cmd = WorkerCommand(
                    kind=WorkerCmdKind.RESUME, worker_id=gpu, epoch=record.epoch, session_id=sid
                )
                live.spawn(
                    self._deliver(sid, cmd, on_failure=EventKind.PLACEMENT_FAILED), f"resume-{sid}"
                )
            else:  # its state is parked on another worker: move it there, then resume
                live.spawn(self.move_then_resume(sid, holder, gpu), f"resume-{sid}")
            return
        if record.state is SessionState.MIGRATING:
            live.feed(Event(time.time(), EventKind.PLACEMENT_FAILED, session_id=sid, gpu_id=gpu))
            return
        await self._assign(sid, gpu)  # its state is gone: placed anew (its worker says so)

    async def move_then_resume(self, sid: str, src: str, dst: str) -> None:
        """Move a suspended session's parked state from ``src`` to ``dst``, then resume it
        there (unless it went idle again meanwhile)."""
        live = self.live
        report = await self.migrations.run(sid, src, dst)
        if report is None or not report.ok:
            await live.feed_later(
                Event(time.time(), EventKind.PLACEMENT_FAILED, session_id=sid, gpu_id=dst)
            )
            return
        async with live.lock:
            if live.core.view.is_idle(sid):
                return  # idle again while its state moved: it stays suspended where it is
            record = await self.registry.get_session(sid)
            if record is None or record.owner != dst or record.state is not SessionState.SUSPENDED:
                return
            record = await self.registry.transition(
                sid,
                SessionState.EXECUTING,
                expected_epoch=record.epoch,
                bump_epoch=False,
                guard=live.guard,
            )
        cmd = WorkerCommand(
            kind=WorkerCmdKind.RESUME, worker_id=dst, epoch=record.epoch, session_id=sid
        )
        await self._deliver(sid, cmd, on_failure=EventKind.PLACEMENT_FAILED)

    async def _deliver(
        self, sid: str, cmd: WorkerCommand, on_failure: EventKind | None = None
    ) -> None:
        """Send one session's command, in order with its others; a refusal or silence that
        leaves the session nowhere becomes ``on_failure`` (with the registry put right)."""
        lock = self._session_locks.setdefault(sid, asyncio.Lock())
        async with lock:
            outcome = await self.live.sender.to_worker(
                cmd, superseded=superseded_check(self.registry, sid, cmd.epoch)
            )
        if outcome.ok or outcome.superseded:
            return
        log.warning(
            "command_failed",
            kind=str(cmd.kind),
            worker_id=cmd.worker_id,
            session_id=sid,
            code=outcome.code,
            why=outcome.why,
        )
        if on_failure is None or outcome.code == "stale_epoch":
            return
        if cmd.kind is WorkerCmdKind.ASSIGN:
            record = await self.registry.get_session(sid)
            if record is not None and record.owner == cmd.worker_id and record.epoch == cmd.epoch:
                await self.requeue(record)
        await self.live.feed_later(
            Event(time.time(), on_failure, session_id=sid, gpu_id=cmd.worker_id)
        )

    async def stop_session(self, sid: str) -> None:
        """STOP to the worker of a session that closed."""
        record = await self.registry.get_session(sid)
        if record is None or record.owner is None:
            return
        cmd = WorkerCommand(
            kind=WorkerCmdKind.STOP, worker_id=record.owner, epoch=record.epoch, session_id=sid
        )
        await self.live.sender.to_worker(cmd)
        self._session_locks.pop(sid, None)

    async def forward_prompt(self, sid: str, prompt: str | None) -> None:
        """A viewer's new prompt to the worker that runs (or holds) the session."""
        record = await self.registry.get_session(sid)
        if (
            record is None
            or record.owner is None
            or record.state not in (SessionState.EXECUTING, SessionState.SUSPENDED)
        ):
            return  # a pending session starts with the registry's (new) prompt
        cmd = WorkerCommand(
            kind=WorkerCmdKind.PROMPT,
            worker_id=record.owner,
            epoch=record.epoch,
            session_id=sid,
            prompt=prompt or record.prompt,
        )
        await self._deliver(sid, cmd)

    async def replace_handed_back(self, pending: list[str]) -> None:
        """Sessions the core has on a GPU that the registry has pending again: a worker that
        found no free slot for an assignment handed it back (it holds a slot until a chunk
        boundary that the core already counts free). Placed again, not on that GPU for the
        backoff, instead of waiting for the viewer's next action. Checked under the step lock,
        so an assignment the core has just decided has claimed the session already."""
        if not pending:
            return
        live = self.live
        async with live.lock:
            for sid in pending:
                gpu = live.core.view.gpu_of(sid)
                if gpu is None or sid in self.migrations.moving:
                    continue
                record = await self.registry.get_session(sid)
                if record is not None and record.state is SessionState.PENDING:
                    log.warning("session_handed_back", session_id=sid, gpu_id=gpu)
                    await live.step_locked(
                        Event(time.time(), EventKind.PLACEMENT_FAILED, session_id=sid, gpu_id=gpu)
                    )

    # -- the pool -------------------------------------------------------------------------------
    async def _request(self, gpu_ids: list[str], kind: str) -> None:
        reply = await self.live.sender.to_provisioner(
            ProvisionerCommand(
                kind=ProvisionerCmdKind.START, count=len(gpu_ids), worker_ids=gpu_ids, gpu_kind=kind
            )
        )
        if reply is None:
            log.warning("provisioner_unanswered", requested=gpu_ids)
            return  # booting until they come, or time out
        for refusal in reply.refused:
            if refusal.worker_id and self.ledger.refused(refusal.worker_id):
                log.warning(
                    "gpu_refused",
                    gpu_id=refusal.worker_id,
                    code=refusal.code,
                    detail=refusal.detail,
                )
                await self.live.feed_later(
                    Event(time.time(), EventKind.GPU_GONE, gpu_id=refusal.worker_id)
                )

    async def _drain(self, gpu: str) -> None:
        await self.live.sender.to_worker(WorkerCommand(kind=WorkerCmdKind.DRAIN, worker_id=gpu))

    # -- the quality budget ---------------------------------------------------------------------
    def send_steps(self, gpu: str, steps: int) -> None:
        """Send ``gpu`` its step budget in the background (the ledger marked it under way)."""
        self.live.spawn(self._steps(gpu, steps), f"steps-{gpu}")

    async def _steps(self, gpu: str, steps: int) -> None:
        ledger = self.ledger

        async def superseded() -> bool:
            # A resend of the full count, with none set by the core, is what it wants.
            return ledger.steps_wanted.get(gpu, steps) != steps or not ledger.knows(gpu)

        try:
            outcome = await self.live.sender.to_worker(
                WorkerCommand(kind=WorkerCmdKind.STEPS, worker_id=gpu, steps=steps), superseded
            )
        finally:
            # A lost or refused command shows in the worker's next heartbeat, which sends the
            # budget again (Ingest.on_beat).
            ledger.steps_sent(gpu, time.time())
        reply = outcome.reply
        if reply is None or not reply.ok:
            log.info(
                "steps_not_applied",
                gpu_id=gpu,
                steps=steps,
                why=outcome.why if reply is None else reply.code,
            )


class Migrations:
    """The migrations one leadership runs: MIGRATE to the source, the handoff's report awaited
    (it comes on the migrations subject); a failed one becomes MIGRATION_FAILED."""

    def __init__(self, executor: Executor) -> None:
        self.live = executor.live
        self.registry = executor.registry
        self._reports: dict[str, asyncio.Future[MigrationReport]] = {}  # by command id
        self.from_gpu: dict[str, set[asyncio.Task[Any]]] = {}  # the Migrates off each GPU
        # Sessions with a Migrate in flight -> how many: the core already has them on the
        # destination while the registry names the source until the commit.
        self.moving: dict[str, int] = {}

    def start(self, decision: Migrate) -> None:
        """Carry out a Migrate in the background."""
        sid, src = decision.session_id, decision.src
        self.moving[sid] = self.moving.get(sid, 0) + 1
        task = self.live.spawn(self._migrate(sid, src, decision.dst), f"migrate-{sid}")
        off_src = self.from_gpu.setdefault(src, set())
        off_src.add(task)
        task.add_done_callback(off_src.discard)
        task.add_done_callback(lambda _task: self.moved(sid))

    def moved(self, sid: str) -> None:
        """A migration of ``sid`` ended (whichever way)."""
        left = self.moving.get(sid, 0) - 1
        if left > 0:
            self.moving[sid] = left
        else:
            self.moving.pop(sid, None)

    async def _migrate(self, sid: str, src: str, dst: str) -> None:
        report = await self.run(sid, src, dst)
        if report is not None and report.ok:
            return
        record = await self.registry.get_session(sid)
        where = record.owner if record is not None and record.owner else src
        if record is not None and record.owner == dst:
            return  # the report was lost, the migration was not
        await self.live.feed_later(
            Event(time.time(), EventKind.MIGRATION_FAILED, session_id=sid, gpu_id=where)
        )

    async def run(self, sid: str, src: str, dst: str) -> MigrationReport | None:
        """MIGRATE to the source and the report of the handoff; None when the session was not
        there to move, the source refused, or no report came in time."""
        live = self.live
        record = await self.registry.get_session(sid)
        if (
            record is None
            or record.owner != src
            or record.state not in (SessionState.EXECUTING, SessionState.SUSPENDED)
        ):
            return None
        cmd = live.sender.stamp(
            WorkerCommand(
                kind=WorkerCmdKind.MIGRATE,
                worker_id=src,
                session_id=sid,
                epoch=record.epoch,
                target=dst,
            )
        )
        waiter: asyncio.Future[MigrationReport] = asyncio.get_running_loop().create_future()
        self._reports[cmd.command_id] = waiter
        try:
            outcome = await live.sender.to_worker(
                cmd, superseded=superseded_check(self.registry, sid, cmd.epoch)
            )
            if not outcome.ok:
                live.metrics.migrations.labels("refused").inc()
                return None
            try:
                report = await asyncio.wait_for(waiter, live.handoff_timeout_s + REPORT_GRACE_S)
            except TimeoutError:
                live.metrics.migrations.labels("unreported").inc()
                return None
        finally:
            self._reports.pop(cmd.command_id, None)
        live.metrics.migrations.labels("ok" if report.ok else "failed").inc()
        return report

    def on_report(self, report: MigrationReport) -> None:
        """A migration report heard: to the migration that waits for it, if any."""
        waiter = self._reports.get(report.command_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(report)


class Releases:
    """GPUs given back: each release waits for the migrations off its GPU, moves the idle
    sessions parked there to another worker, then has the provisioner stop the worker; one
    that does not go through is tried again after a pause (the pool's book keeps when)."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.live = executor.live
        self.ledger = executor.ledger
        self.in_flight: dict[str, asyncio.Task[Any]] = {}  # the release under way per GPU

    def start(self, gpu: str) -> None:
        """Give ``gpu`` back in the background, unless that is already under way."""
        if gpu in self.in_flight:
            return
        task = self.live.spawn(self._give_back(gpu), f"release-{gpu}")
        self.in_flight[gpu] = task
        task.add_done_callback(lambda _task: self.in_flight.pop(gpu, None))

    def retry_due(self, now: float) -> None:
        """Start the releases whose pause is over."""
        view = self.live.core.view
        held = [gpu for gpu in self.ledger.unreleased if view.state_of(gpu) is not None]
        for gpu in self.ledger.releases_due(now, held, self.in_flight):
            self.start(gpu)

    async def _give_back(self, gpu: str) -> None:
        """One attempt at releasing ``gpu``; when it does not go through, the next is due
        after a pause for as long as the worker runs and the core does not take it back. The
        core has already left it out of the pool: a release given up on would leave a worker
        running, paid for and used by nobody."""
        if await self._patiently(self._release, gpu):
            self.ledger.released(gpu)
            return
        attempts_before = self.ledger.unreleased.get(gpu)
        pause = self.ledger.release_failed(gpu, time.time())
        if pause is not None and attempts_before is not None:
            log.warning(
                "release_pending",
                gpu_id=gpu,
                attempts=attempts_before.attempts + 1,
                retry_in_s=round(pause, 1),
            )

    async def _patiently(
        self, action: Callable[[str], Awaitable[bool]], arg: str, attempts: int = 10
    ) -> bool:
        """Carry out ``action(arg)`` through Redis or NATS being away for a while (a release
        must not be lost: the worker would run on, known to nobody); what it returned, or
        False when it never got through."""
        for attempt in range(attempts):
            try:
                return await action(arg)
            except (RedisError, NatsError) as exc:
                log.warning(
                    "action_retry",
                    action=action.__name__,
                    arg=arg,
                    attempt=attempt + 1,
                    error=str(exc),
                )
                await asyncio.sleep(min(5.0, 0.5 * 2**attempt))
        log.error("action_abandoned", action=action.__name__, arg=arg)
        return False

    async def _release(self, gpu: str) -> bool:
        """Give a GPU back: after the migrations off it, and after moving the idle sessions
        parked in its host memory to another worker; the provisioner stops it. True once the
        provisioner takes the stop; False while something holds it here (tried again)."""
        live, executor = self.live, self.executor
        moving = list(executor.migrations.from_gpu.get(gpu, ()))
        if moving:
            await asyncio.wait(moving)
        registry = executor.registry
        for sid, owner in (await registry.placement()).items():
            if owner != gpu:
                continue
            record = await registry.get_session(sid)
            if record is None or record.state is not SessionState.SUSPENDED:
                continue
            view = live.core.view
            ready = [g for g, state in view.gpus.items() if state is GpuState.READY]
            target = self.ledger.parking_for(gpu, ready)
            if target is None:
                log.warning("release_blocked", gpu_id=gpu, reason="nowhere to move idle sessions")
                return False
            report = await executor.migrations.run(sid, gpu, target)
            if report is None or not report.ok:
                log.warning(
                    "release_blocked",
                    gpu_id=gpu,
                    session_id=sid,
                    reason="an idle session could not move",
                )
                return False
        left = [sid for sid, owner in (await registry.placement()).items() if owner == gpu]
        if left:
            log.warning("release_blocked", gpu_id=gpu, sessions=left)
            return False
        for _ in range(RELEASE_STOP_ATTEMPTS):
            reply = await live.sender.to_provisioner(
                ProvisionerCommand(kind=ProvisionerCmdKind.STOP, worker_ids=[gpu])
            )
            codes = [] if reply is None else [r.code for r in reply.refused]
            if reply is not None and reply.ok:
                return True
            log.warning("release_refused", gpu_id=gpu, refused=codes)
            if "not_drained" not in codes:  # its heartbeat may lag the last migration: retry
                return False
            await asyncio.sleep(live.settings.tick_s * 2)
        return False


def superseded_check(registry: Registry, sid: str, epoch: int) -> Callable[[], Awaitable[bool]]:
    """Asked before each retry of a command at ``epoch``: whether the session moved on."""

    async def check() -> bool:
        record = await registry.get_session(sid)
        return record is None or record.epoch != epoch or record.state is SessionState.TERMINATED

    return check


def describe(decision: Decision) -> str:
    """A decision in a few words, for the log."""
    if isinstance(decision, Assign | Resume | Suspend):
        return f"{type(decision).__name__.lower()} {decision.session_id} -> {decision.gpu_id}"
    if isinstance(decision, Migrate):
        return f"migrate {decision.session_id} {decision.src} -> {decision.dst}"
    if isinstance(decision, RequestGpus):
        return f"request {len(decision.gpu_ids)} {decision.kind} ({', '.join(decision.gpu_ids)})"
    return f"{type(decision).__name__.lower()} {decision.gpu_id}"
