"""The live scheduler's hands: every decision of the core becomes commands.

``Assign``/``Resume``/``Suspend`` go to workers (ownership first moved in the registry by a
compare-and-set guarded by the lease), ``Migrate`` through the migration protocol,
``RequestGpus``/``Release`` to the provisioner, ``Drain`` and ``SetSteps`` (the quality budget)
to the worker. The executor decides nothing: what an ``Assign`` or ``Resume`` becomes once the
session's record is read is the core's (:meth:`~services.scheduler.core.pool.Pool.place`), and
so is where a released GPU's idle sessions go. Commands are retried until answered; how one
ended comes back to the core as an event or a fact (PLACEMENT_FAILED, MIGRATION_FAILED,
GPU_GONE; :class:`~services.scheduler.core.pool.GpuRefused`,
:class:`~services.scheduler.core.pool.ParkedStateMoved`,
:class:`~services.scheduler.core.pool.MoveEnded`). Migrations run in the background
(:class:`Migrations`); a release that does not go through is tried again (:class:`Releases`)
for as long as the worker runs, unless the provisioner refused it for good (its floor): then
the core has the GPU again (``GPU_KEPT``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

from nats.errors import Error as NatsError
from redis.exceptions import RedisError

from services.scheduler.commands import CommandSender
from services.scheduler.core.pool import (
    RELEASE_STOP_ATTEMPTS,
    CheckHandedBack,
    Claim,
    Command,
    Found,
    GpuRefused,
    Input,
    MoveEnded,
    MoveThenResume,
    ParkedStateMoved,
    Pool,
    ReleaseUnknown,
    ResumeThere,
    SessionSeen,
)
from services.scheduler.core.types import (
    Assign,
    Drain,
    Event,
    EventKind,
    Migrate,
    Release,
    RequestGpus,
    Resume,
    SetSteps,
    Suspend,
)
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.unplaced import Unplaced
from shared.backoff import retried
from shared.leader import Lease
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

log = get_logger("turboserve.scheduler")

# A migration's report is awaited this long beyond the handoff's own time limit.
REPORT_GRACE_S = 10.0
# The provisioner's refusal of a stop that would take the pool below its floor: asking again
# cannot help until the floor changes, which the pool's record then says.
FLOOR_REFUSAL = "min_workers"

# What the registry's session state tells the core when a placement is carried out.
FOUND = {
    SessionState.PENDING: Found.PENDING,
    SessionState.EXECUTING: Found.EXECUTING,
    SessionState.SUSPENDED: Found.SUSPENDED,
    SessionState.MIGRATING: Found.MIGRATING,
    SessionState.TERMINATED: Found.GONE,
}


class Shell(Protocol):
    """What the executor needs of the leadership it serves: tracked tasks, and two ways to
    give the core what happened (``feed``: found while carrying out a decision, stepped right
    after it under the step lock; ``feed_later``: from a background task, a step of its own)."""

    stopping: asyncio.Event

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]: ...

    def feed(self, fact: Input) -> None: ...

    async def feed_later(self, fact: Input) -> None: ...

    async def follow_pool_limits(self) -> None: ...


def seen(sid: str, gpu: str, record: SessionRecord | None) -> SessionSeen:
    """The registry's record of ``sid`` as the core reads it, for a placement onto ``gpu``."""
    if record is None:
        return SessionSeen(sid, gpu, Found.GONE)
    return SessionSeen(sid, gpu, FOUND[record.state], record.owner, record.epoch)


class Executor:
    """Carries out the core's decisions for one leadership."""

    def __init__(
        self,
        shell: Shell,
        pool: Pool,
        registry: Registry,
        sender: CommandSender,
        lease: Lease,
        metrics: SchedulerMetrics,
        handoff_timeout_s: float,
        tick_s: float,
        unplaced: Unplaced | None = None,
    ) -> None:
        self.shell = shell
        self.unplaced = unplaced if unplaced is not None else Unplaced()
        self.pool = pool
        self.registry = registry
        self.sender = sender
        self.lease = lease
        self.metrics = metrics
        self.handoff_timeout_s = handoff_timeout_s
        self.tick_s = tick_s
        self.migrations = Migrations(self)
        self.releases = Releases(self)
        self._session_locks: dict[str, asyncio.Lock] = {}

    async def execute(self, decision: Command) -> None:
        shell = self.shell
        try:
            if isinstance(decision, Assign):
                await self._place(decision.session_id, decision.gpu_id, resume=False)
            elif isinstance(decision, Resume):
                await self._place(decision.session_id, decision.gpu_id, resume=True)
            elif isinstance(decision, Suspend):
                await self._suspend(decision.session_id, decision.gpu_id)
            elif isinstance(decision, Migrate):
                self.migrations.start(decision)
            elif isinstance(decision, RequestGpus):
                shell.spawn(self._request(list(decision.gpu_ids), decision.kind), "request-gpus")
                self.metrics.scale_events.labels("out").inc()
                # Counted as decisions, as the simulator counts them; the provisioner records
                # each worker it starts or stops as a cluster event.
                await self.registry.bump_counters(scale_out_events=1)
            elif isinstance(decision, Drain):
                shell.spawn(self._drain(decision.gpu_id), f"drain-{decision.gpu_id}")
            elif isinstance(decision, Release):
                self.releases.start(decision.gpu_id)
                self.metrics.scale_events.labels("in").inc()
                await self.registry.bump_counters(scale_in_events=1)
            elif isinstance(decision, SetSteps):
                self.send_steps(decision.gpu_id, decision.steps)
            elif isinstance(decision, ReleaseUnknown):
                log.warning("gpu_ready_after_release", gpu_id=decision.gpu_id)
                self.releases.start(decision.gpu_id)
            elif isinstance(decision, CheckHandedBack):
                await self._check_handed_back(decision.session_id, decision.gpu_id)
        except RegistryError as exc:  # GuardFailed included: the lease is gone
            log.warning("decision_not_carried_out", decision=describe(decision), error=str(exc))

    # -- sessions -------------------------------------------------------------------------------
    async def _place(self, sid: str, gpu: str, resume: bool) -> None:
        """An Assign or a Resume, as the core makes of the session's record. The record is read
        by the registry's placing script, which claims a pending session in the same round
        trip: the core's answer for a pending session is always that claim (``Pool.place``;
        ``tests/scheduler/core/test_pool.py`` holds it to that)."""
        try:
            placed = await self.registry.place(sid, gpu, guard=self.lease.guard)
        except RegistryError as exc:
            log.info("claim_lost", session_id=sid, gpu_id=gpu, reason=str(exc))
            return
        if placed.won:
            assert placed.record is not None
            self._send_assign(sid, gpu, placed.record)
            return
        what = self.pool.place(seen(sid, gpu, placed.record), resume, time.time())
        if what is None:
            return  # already there
        if isinstance(what, Event):
            self.shell.feed(what)
        elif isinstance(what, Claim):
            await self.claim_and_assign(what)
        elif isinstance(what, ResumeThere):
            await self._resume_there(what)
        else:
            self.shell.spawn(self.move_then_resume(what), f"resume-{sid}")

    async def claim_and_assign(self, claim: Claim) -> None:
        """Claim the session for its GPU in the registry (back to pending first when its
        worker is gone), then ASSIGN it there."""
        sid, gpu, epoch = claim.session_id, claim.gpu_id, claim.epoch
        if claim.requeue:
            requeued = await self.requeue(sid, epoch)
            if requeued is None:
                return
            epoch = requeued.epoch
        try:
            claimed = await self.registry.claim(sid, gpu, epoch, guard=self.lease.guard)
        except (IllegalTransition, RegistryError) as exc:
            log.info("claim_lost", session_id=sid, gpu_id=gpu, reason=str(exc))
            return
        self._send_assign(sid, gpu, claimed)

    def _send_assign(self, sid: str, gpu: str, record: SessionRecord) -> None:
        """ASSIGN ``sid``, claimed for ``gpu`` as ``record`` says, in a task of its own."""
        self.unplaced.drop(sid)  # it has an owner now, who writes it back if Redis loses it
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
            input=record.input,
            strength=record.strength,
        )
        self.shell.spawn(
            self._deliver(sid, cmd, on_failure=EventKind.PLACEMENT_FAILED), f"assign-{sid}"
        )

    async def _resume_there(self, what: ResumeThere) -> None:
        sid, gpu = what.session_id, what.gpu_id
        record = await self.registry.transition(
            sid,
            SessionState.EXECUTING,
            expected_epoch=what.epoch,
            bump_epoch=False,
            guard=self.lease.guard,
        )
        cmd = WorkerCommand(
            kind=WorkerCmdKind.RESUME, worker_id=gpu, epoch=record.epoch, session_id=sid
        )
        self.shell.spawn(
            self._deliver(sid, cmd, on_failure=EventKind.PLACEMENT_FAILED), f"resume-{sid}"
        )

    async def requeue(self, sid: str, epoch: int) -> SessionRecord | None:
        """Back to pending (its worker is gone): the registry's half of a re-placement."""
        try:
            record = await self.registry.transition(
                sid, SessionState.PENDING, expected_epoch=epoch, owner=None, guard=self.lease.guard
            )
        except (IllegalTransition, RegistryError) as exc:
            log.info("requeue_skipped", session_id=sid, reason=str(exc))
            return None
        self.unplaced.note(record)
        return record

    async def _suspend(self, sid: str, gpu: str) -> None:
        record = await self.registry.get_session(sid)
        if record is None:
            return
        if sid in self.pool.moving or record.state is SessionState.MIGRATING:
            # The core moved it when it decided; the registry names the source until the
            # handoff commits. Dropping the suspend would leave it running where it lands,
            # unwatched and holding a slot the core counts free: the core is told where it
            # is once the move has ended (MoveEnded).
            self.shell.spawn(self._suspend_after_move(sid), f"suspend-{sid}")
            return
        if record.owner != gpu or record.state is not SessionState.EXECUTING:
            return
        self.shell.spawn(self._deliver(sid, await self._suspend_command(record)), f"suspend-{sid}")

    async def _suspend_command(self, record: SessionRecord) -> WorkerCommand:
        """Mark an executing session suspended and the SUSPEND for its owner. Idle/active flips
        keep the epoch: the worker keeps the session (no fencing needed), and the commands to
        it are sent in order."""
        record = await self.registry.transition(
            record.id,
            SessionState.SUSPENDED,
            expected_epoch=record.epoch,
            bump_epoch=False,
            guard=self.lease.guard,
        )
        assert record.owner is not None
        return WorkerCommand(
            kind=WorkerCmdKind.SUSPEND,
            worker_id=record.owner,
            epoch=record.epoch,
            session_id=record.id,
        )

    async def _suspend_after_move(self, sid: str) -> None:
        """Once the migration in flight of a session the core suspended has ended, where the
        registry has it then, to the core (which suspends it there unless it became active
        again meanwhile)."""
        deadline = time.monotonic() + self.handoff_timeout_s + REPORT_GRACE_S
        record = None
        while time.monotonic() < deadline and not self.shell.stopping.is_set():
            if sid not in self.pool.moving:  # then the registry: a parked state's move
                record = await self.registry.get_session(sid)
                if record is None or record.state is not SessionState.MIGRATING:
                    break
            await asyncio.sleep(0.05)
        else:
            record = await self.registry.get_session(sid)
        executing = record is not None and record.state is SessionState.EXECUTING
        owner = record.owner if record is not None else None
        await self.shell.feed_later(MoveEnded(time.time(), sid, owner, executing))

    async def move_then_resume(self, move: MoveThenResume) -> None:
        """Move a suspended session's parked state from its source to its destination; the
        core then resumes it there (unless it went idle again meanwhile)."""
        report = await self.migrations.run(move.session_id, move.src, move.dst)
        ok = report is not None and report.ok
        await self.shell.feed_later(ParkedStateMoved(time.time(), move.session_id, move.dst, ok))

    async def _deliver(
        self, sid: str, cmd: WorkerCommand, on_failure: EventKind | None = None
    ) -> None:
        """Send one session's command, in order with its others; a refusal or silence that
        leaves the session nowhere becomes ``on_failure`` (with the registry put right)."""
        lock = self._session_locks.setdefault(sid, asyncio.Lock())
        async with lock:
            outcome = await self.sender.to_worker(
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
                await self.requeue(sid, record.epoch)
        await self.shell.feed_later(
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
        await self.sender.to_worker(cmd)
        self._session_locks.pop(sid, None)

    async def forward_prompt(
        self, sid: str, prompt: str | None, strength: float | None = None
    ) -> None:
        """A viewer's new prompt (and a video session's strength) to the worker that runs (or
        holds) the session."""
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
            input=record.input,
            strength=record.strength if strength is None else strength,
        )
        await self._deliver(sid, cmd)

    async def _check_handed_back(self, sid: str, gpu: str) -> None:
        """A session the core has on ``gpu`` that the registry has pending again: a worker that
        found no free slot for an assignment handed it back (it holds a slot until a chunk
        boundary that the core already counts free). Placed again, not on that GPU for the
        backoff, instead of waiting for the viewer's next action. Carried out under the step
        lock, so an assignment the core has just decided has claimed the session already."""
        record = await self.registry.get_session(sid)
        if record is not None and record.state is SessionState.PENDING:
            log.warning("session_handed_back", session_id=sid, gpu_id=gpu)
            self.shell.feed(
                Event(time.time(), EventKind.PLACEMENT_FAILED, session_id=sid, gpu_id=gpu)
            )

    # -- the pool -------------------------------------------------------------------------------
    async def _request(self, gpu_ids: list[str], kind: str) -> None:
        reply = await self.sender.to_provisioner(
            ProvisionerCommand(
                kind=ProvisionerCmdKind.START, count=len(gpu_ids), worker_ids=gpu_ids, gpu_kind=kind
            )
        )
        if reply is None:
            log.warning("provisioner_unanswered", requested=gpu_ids)
            return  # booting until they come, or time out
        for refusal in reply.refused:
            if refusal.worker_id and refusal.worker_id in self.pool.booting:
                log.warning(
                    "gpu_refused",
                    gpu_id=refusal.worker_id,
                    code=refusal.code,
                    detail=refusal.detail,
                )
                await self.shell.feed_later(GpuRefused(time.time(), refusal.worker_id))

    async def _drain(self, gpu: str) -> None:
        await self.sender.to_worker(WorkerCommand(kind=WorkerCmdKind.DRAIN, worker_id=gpu))

    # -- the quality budget ---------------------------------------------------------------------
    def send_steps(self, gpu: str, steps: int) -> None:
        """Send ``gpu`` its step budget in the background (the core marked it under way)."""
        self.shell.spawn(self._steps(gpu, steps), f"steps-{gpu}")

    async def _steps(self, gpu: str, steps: int) -> None:
        pool = self.pool

        async def superseded() -> bool:
            return pool.steps_superseded(gpu, steps)

        try:
            outcome = await self.sender.to_worker(
                WorkerCommand(kind=WorkerCmdKind.STEPS, worker_id=gpu, steps=steps), superseded
            )
        finally:
            # A lost or refused command shows in the worker's next heartbeat, which sends the
            # budget again (the core's WorkerHeard).
            pool.steps_sent(gpu, time.time())
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
        self.executor = executor
        self.registry = executor.registry
        self._reports: dict[str, asyncio.Future[MigrationReport]] = {}  # by command id
        self.from_gpu: dict[str, set[asyncio.Task[Any]]] = {}  # the Migrates off each GPU

    def start(self, decision: Migrate) -> None:
        """Carry out a Migrate in the background (the core counted it in flight)."""
        sid, src = decision.session_id, decision.src
        executor = self.executor
        task = executor.shell.spawn(self._migrate(sid, src, decision.dst), f"migrate-{sid}")
        off_src = self.from_gpu.setdefault(src, set())
        off_src.add(task)
        task.add_done_callback(off_src.discard)
        task.add_done_callback(lambda _task: executor.pool.migration_ended(sid))

    async def _migrate(self, sid: str, src: str, dst: str) -> None:
        report = await self.run(sid, src, dst)
        if report is not None and report.ok:
            return
        record = await self.registry.get_session(sid)
        where = record.owner if record is not None and record.owner else src
        if record is not None and record.owner == dst:
            return  # the report was lost, the migration was not
        await self.executor.shell.feed_later(
            Event(time.time(), EventKind.MIGRATION_FAILED, session_id=sid, gpu_id=where)
        )

    async def run(self, sid: str, src: str, dst: str) -> MigrationReport | None:
        """MIGRATE to the source and the report of the handoff; None when the session was not
        there to move, the source refused, or no report came in time."""
        executor = self.executor
        sender, metrics = executor.sender, executor.metrics
        record = await self.registry.get_session(sid)
        if (
            record is None
            or record.owner != src
            or record.state not in (SessionState.EXECUTING, SessionState.SUSPENDED)
        ):
            return None
        cmd = sender.stamp(
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
            outcome = await sender.to_worker(
                cmd, superseded=superseded_check(self.registry, sid, cmd.epoch)
            )
            if not outcome.ok:
                metrics.migrations.labels("refused").inc()
                return None
            try:
                report = await asyncio.wait_for(waiter, executor.handoff_timeout_s + REPORT_GRACE_S)
            except TimeoutError:
                metrics.migrations.labels("unreported").inc()
                return None
        finally:
            self._reports.pop(cmd.command_id, None)
        metrics.migrations.labels("ok" if report.ok else "failed").inc()
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
        self.pool = executor.pool
        self.in_flight: dict[str, asyncio.Task[Any]] = {}  # the release under way per GPU

    def start(self, gpu: str) -> None:
        """Give ``gpu`` back in the background, unless that is already under way."""
        if gpu in self.in_flight:
            return
        task = self.executor.shell.spawn(self._give_back(gpu), f"release-{gpu}")
        self.in_flight[gpu] = task
        task.add_done_callback(lambda _task: self.in_flight.pop(gpu, None))

    def retry_due(self, now: float) -> None:
        """Start the releases whose pause is over."""
        for gpu in self.pool.releases_due(now, self.in_flight):
            self.start(gpu)

    async def _give_back(self, gpu: str) -> None:
        """One attempt at releasing ``gpu``; when it does not go through, the next is due
        after a pause for as long as the worker runs and the core does not take it back. The
        core has already left it out of the pool: a release given up on would leave a worker
        running, paid for and used by nobody."""
        outcome = await self._patiently(self._release, gpu)
        if outcome is True:
            self.pool.released(gpu)
            return
        if outcome == FLOOR_REFUSAL:
            await self._kept(gpu)
            return
        attempts_before = self.pool.unreleased.get(gpu)
        pause = self.pool.release_failed(gpu, time.time())
        if pause is not None and attempts_before is not None:
            log.warning(
                "release_pending",
                gpu_id=gpu,
                attempts=attempts_before.attempts + 1,
                retry_in_s=round(pause, 1),
            )

    async def _kept(self, gpu: str) -> None:
        """The provisioner keeps ``gpu`` (its floor): the release is not tried again, and the
        GPU serves again. The core takes it back; the worker, told to drain, is undrained;
        an operator's ``stop`` becomes a ``hold`` (the worker stays drained, and ``ctl``
        reports the refusal)."""
        registry = self.executor.registry
        operator = (await registry.operator_drains()).get(gpu) is not None
        self.pool.kept(gpu, operator=operator)
        log.error(
            "release_refused",
            gpu_id=gpu,
            refused=[FLOOR_REFUSAL],
            retry=False,
            kept="drained, for the operator" if operator else "in the pool",
        )
        if operator:
            # Held from now on, as `ctl drain` without --stop holds a worker: emptied, kept.
            await registry.set_operator_drain(gpu, "hold")
        # The provisioner wrote its limits again with the refusal: the core follows them
        # before it has the GPU back, so that it does not give it back again at once.
        shell = self.executor.shell
        await shell.follow_pool_limits()
        await shell.feed_later(Event(time.time(), EventKind.GPU_KEPT, gpu_id=gpu))
        if operator:
            await shell.feed_later(Event(time.time(), EventKind.GPU_CORDON, gpu_id=gpu))
        else:
            # Still ours (our_drains) until it beats ready again: not taken for an operator's.
            await self.executor.sender.to_worker(
                WorkerCommand(kind=WorkerCmdKind.UNDRAIN, worker_id=gpu)
            )

    async def _patiently(
        self, action: Callable[[str], Awaitable[bool | str]], arg: str, attempts: int = 10
    ) -> bool | str:
        """Carry out ``action(arg)`` through Redis or NATS being away for a while (a release
        must not be lost: the worker would run on, known to nobody); what it returned, or
        False when it never got through."""
        try:
            return await retried(
                lambda: action(arg),
                "action_retry",
                on=(RedisError, NatsError),
                first_s=0.5,
                cap_s=5.0,
                attempts=attempts,
                say=log.warning,
                action=action.__name__,
                arg=arg,
            )
        except (RedisError, NatsError) as exc:
            log.error("action_abandoned", action=action.__name__, arg=arg, error=str(exc))
            return False

    async def _release(self, gpu: str) -> bool | str:
        """Give a GPU back: after the migrations off it, and after moving the idle sessions
        parked in its host memory to another worker; the provisioner stops it. True once the
        provisioner takes the stop; ``FLOOR_REFUSAL`` when it refuses it for good; False
        while something holds it here (tried again)."""
        executor = self.executor
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
            target = self.pool.parking_for(gpu)
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
            reply = await executor.sender.to_provisioner(
                ProvisionerCommand(kind=ProvisionerCmdKind.STOP, worker_ids=[gpu])
            )
            codes = [] if reply is None else [r.code for r in reply.refused]
            if reply is not None and reply.ok:
                return True
            if FLOOR_REFUSAL in codes:
                return FLOOR_REFUSAL
            log.warning("release_refused", gpu_id=gpu, refused=codes)
            if "not_drained" not in codes:  # its heartbeat may lag the last migration: retry
                return False
            await asyncio.sleep(executor.tick_s * 2)
        return False


def superseded_check(registry: Registry, sid: str, epoch: int) -> Callable[[], Awaitable[bool]]:
    """Asked before each retry of a command at ``epoch``: whether the session moved on."""

    async def check() -> bool:
        record = await registry.get_session(sid)
        return record is None or record.epoch != epoch or record.state is SessionState.TERMINATED

    return check


def describe(decision: Command) -> str:
    """A decision in a few words, for the log."""
    if isinstance(decision, Assign | Resume | Suspend | CheckHandedBack):
        return f"{type(decision).__name__.lower()} {decision.session_id} -> {decision.gpu_id}"
    if isinstance(decision, Migrate):
        return f"migrate {decision.session_id} {decision.src} -> {decision.dst}"
    if isinstance(decision, RequestGpus):
        return f"request {len(decision.gpu_ids)} {decision.kind} ({', '.join(decision.gpu_ids)})"
    return f"{type(decision).__name__.lower()} {decision.gpu_id}"
