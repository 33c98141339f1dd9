"""``turboserve ctl``: operator commands against a running mesh.

- ``ctl status [--json]``: workers and their sessions (state, batch, chunk time);
- ``ctl migrate SESSION --to WORKER``: move a session's state to another worker at its next
  chunk boundary (the viewer's stream does not notice);
- ``ctl drain WORKER``: stop placing sessions on a worker and move every session away (for
  maintenance and rolling upgrades). The worker stays up, empty and out of placement, and the
  scheduler neither counts it nor gives it back, until ``ctl undrain WORKER`` takes it back
  into service; ``ctl drain WORKER --stop`` (or ``ctl stop WORKER``) drains it and has it
  given back (stopped), and is refused before anything moves when that would take the pool
  below its floor (the provisioner's ``min_workers``).

Which mesh: ``--nats-url`` / ``--redis-url``, else ``TURBOSERVE_NATS_URL`` /
``TURBOSERVE_REDIS_URL``, else the NATS and Redis of the ``turboserve up`` running from
``--state-dir`` (its state file); never a default address. When that is not the state file's
mesh, ``ctl`` says which it talks to. A refused or failed command, or a mesh that does not
answer within 2 s, exits non-zero with one line saying why.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from shared.settings import CommonSettings

DEFAULT_TIMEOUT_S = 60.0


class CtlError(Exception):
    """A refused or failed operator command: its message is the one line to print; ``code``
    the worker's or the handoff's stable code when one said no (``busy``, ``draining``, ...)."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


# The provisioner's refusal of a stop that would take the pool below its floor.
FLOOR_REFUSAL = "min_workers"
# How often a drain looks again at a session that a move already under way is taking away.
MOVE_POLL_S = 0.2
# How long `ctl undrain` waits for the scheduler to take the worker back into placement.
UNDRAIN_WAIT_S = 10.0
# With a scheduler leading, a drain leaves the active sessions to it this long before it moves
# one the scheduler left there itself (a policy that never migrates).
SCHEDULER_MOVE_WAIT_S = 5.0


def _mesh_options() -> argparse.ArgumentParser:
    """Which mesh to talk to; taken before or after the action (``ctl --nats-url U status`` or
    ``ctl status --nats-url U``)."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument(
        "--state-dir",
        default=argparse.SUPPRESS,
        help="where `turboserve up` keeps its state file (TURBOSERVE_STATE_DIR, "
        "else ~/.turboserve)",
    )
    options.add_argument(
        "--nats-url",
        default=argparse.SUPPRESS,
        help="the mesh's NATS (else TURBOSERVE_NATS_URL, else the state file's)",
    )
    options.add_argument(
        "--redis-url",
        default=argparse.SUPPRESS,
        help="the mesh's Redis (else TURBOSERVE_REDIS_URL, else the state file's)",
    )
    return options


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    mesh = _mesh_options()
    p = subparsers.add_parser(
        "ctl", parents=[mesh], help="operator commands: status, migrate, drain, undrain, stop"
    )
    sub = p.add_subparsers(dest="ctl_command", required=True, metavar="ACTION")

    def action(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[mesh], **kwargs)

    status = action("status", help="workers and their sessions")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=run)
    migrate = action("migrate", help="move a session to another worker")
    migrate.add_argument("session", help="session id")
    migrate.add_argument("--to", required=True, dest="target", help="destination worker id")
    migrate.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds to wait for the move's outcome (default {DEFAULT_TIMEOUT_S:.0f})",
    )
    migrate.set_defaults(func=run)
    drain = action(
        "drain",
        help="move every session off a worker; it stays up and takes no new ones until undrained",
    )
    drain.add_argument("worker", help="worker id")
    drain.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds for the whole drain"
    )
    drain.add_argument(
        "--stop", action="store_true", help="then give the worker back (the scheduler stops it)"
    )
    drain.set_defaults(func=run)
    undrain = action("undrain", help="let a drained worker take sessions again")
    undrain.add_argument("worker", help="worker id")
    undrain.set_defaults(func=run)
    stop = action("stop", help="drain a worker, then give it back (stop it)")
    stop.add_argument("worker", help="worker id")
    stop.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds for the drain and the stop",
    )
    stop.set_defaults(func=run, stop=True)


# How long ctl waits for NATS and Redis to answer before it says the mesh is not there.
CONNECT_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class CtlTarget:
    """The mesh ``ctl`` talks to: the settings it connects with, where its URLs came from, and
    the line it says when that is not the mesh of the state file (None when it is)."""

    settings: CommonSettings
    source: str
    note: str | None


def resolve_mesh(
    nats_url: str | None = None,
    redis_url: str | None = None,
    state_dir: str | None = None,
    env: Mapping[str, str] | None = None,
) -> CtlTarget:
    """Where NATS and Redis are, for each the first that says: the ``--nats-url`` /
    ``--redis-url`` flags, the ``TURBOSERVE_*`` environment, the state file of a running
    ``turboserve up`` (in ``--state-dir``, ``TURBOSERVE_STATE_DIR`` or ``~/.turboserve``).
    Never a default: with none of them there is no mesh to talk to (CtlError)."""
    from shared.settings import ToolSettings, mask_url
    from tools.launcher import STATE_FILE, read_state

    settings = ToolSettings.from_env(env, connect_timeout_s=CONNECT_TIMEOUT_S)
    in_env = ToolSettings.given(env)
    directory = Path(state_dir).expanduser() if state_dir else settings.state_path
    state = read_state(directory)
    flags = {"nats": nats_url, "redis": redis_url}
    urls: dict[str, str] = {}
    sources: list[str] = []
    for server in ("nats", "redis"):
        var = f"TURBOSERVE_{server.upper()}_URL"
        if flags[server]:
            urls[server], origin = str(flags[server]), f"--{server}-url"
        elif f"{server}_url" in in_env:
            urls[server], origin = getattr(settings, f"{server}_url"), var
        elif state is not None and state.get(f"{server}_url"):
            urls[server], origin = (
                str(state[f"{server}_url"]),
                f"the state file {directory / STATE_FILE}",
            )
        else:
            raise CtlError(
                f"no mesh to talk to: no running `turboserve up` has a state file in {directory} "
                f"(--state-dir), and no --{server}-url or {var} says where {server} is"
            )
        if origin not in sources:
            sources.append(origin)
    changes = {"nats_url": urls["nats"], "redis_url": urls["redis"]}
    if state is not None:
        for key in (
            "subject_prefix",
            "redis_namespace",
            "tls_ca_file",
            "tls_cert_file",
            "tls_key_file",
        ):
            if key not in in_env and state.get(key):
                changes[key] = str(state[key])
    where = f"NATS {mask_url(urls['nats'])}, Redis {mask_url(urls['redis'])}"
    source = f"{where}, from {' and '.join(sources)}"
    if state is None:
        note = f"talking to {source}; no `turboserve up` runs from {directory}"
    elif (urls["nats"], urls["redis"]) != (state.get("nats_url"), state.get("redis_url")):
        note = (
            f"talking to {source}, not the mesh `turboserve up` runs from {directory} "
            f"(NATS {mask_url(str(state.get('nats_url')))})"
        )
    else:
        note = None
    return CtlTarget(settings.replace(**changes), source, note)


def run(args: argparse.Namespace) -> int:
    from shared.cli import fail
    from shared.logging import configure_logging
    from shared.runner import ConnectError

    command = f"ctl {args.ctl_command}"
    try:
        mesh = resolve_mesh(
            getattr(args, "nats_url", None),
            getattr(args, "redis_url", None),
            getattr(args, "state_dir", None),
        )
        # ctl's own lines are its output; the connection's retries and warnings are not
        # (unless TURBOSERVE_LOG_LEVEL asks for them).
        given = "log_level" in CommonSettings.given()
        configure_logging(mesh.settings.log_level if given else "error")
        code = asyncio.run(_run(args, mesh.settings, mesh))
        sys.stdout.flush()  # a closed pipe shows here, inside the handler below
        return code
    except BrokenPipeError:
        # The reader went away (`ctl status --json | head`): no traceback, as CLI tools do.
        # Python's advice: point stdout at devnull so the flush at exit cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except CtlError as exc:
        return fail(command, exc)
    except ConnectError as exc:
        return fail(command, f"{exc}; is the mesh running? ({mesh.source})")


async def _run(args: argparse.Namespace, settings: Any, mesh: CtlTarget) -> int:
    from shared.runner import close_context, open_context
    from tools.report import progress

    ctx = await open_context(settings, "turboserve-ctl")
    if mesh.note is not None:
        print(f"turboserve ctl: {mesh.note}", file=sys.stderr)
    try:
        ctl = Ctl(ctx)
        if args.ctl_command == "status":
            status = await ctl.status()
            if args.json:
                print(status_json(status))
            else:
                print(format_status(status))
        elif args.ctl_command == "migrate":
            report = await ctl.migrate(args.session, args.target, args.timeout)
            print(
                f"migrated {args.session}: {report['src']} -> {report['dst']} "
                f"({report['nbytes'] / 2**20:.2f} MiB, freeze {report['freeze_ms']:.1f} ms, "
                f"transfer {report['transfer_ms']:.1f} ms, commit {report['commit_ms']:.1f} ms)"
            )
        elif args.ctl_command in ("drain", "stop"):
            moved = await ctl.drain(args.worker, args.timeout, stop=args.stop, progress=progress)
            if args.stop:
                print(f"worker {args.worker} drained ({moved} session(s) moved) and stopped")
            else:
                print(
                    f"worker {args.worker} drained: {moved} session(s) moved; it stays up and "
                    "takes no new sessions (turboserve ctl undrain to undo)"
                )
        elif args.ctl_command == "undrain":
            taken = await ctl.undrain(args.worker)
            if taken is None:
                print(
                    f"worker {args.worker} takes sessions again (no scheduler leads to place any)"
                )
            elif taken:
                print(f"worker {args.worker} takes sessions again: the scheduler places on it")
            else:
                raise CtlError(
                    f"worker {args.worker} is undrained, but the scheduler still holds it out of "
                    f"placement after {UNDRAIN_WAIT_S:.0f}s; see `turboserve ctl status`"
                )
        return 0
    finally:
        await close_context(ctx)


def _worker_cmd(kind: str, worker_id: str, **fields: Any) -> Any:
    from shared.wire import WorkerCmdKind, WorkerCommand

    return WorkerCommand(
        kind=WorkerCmdKind(kind),
        worker_id=worker_id,
        command_id=f"ctl-{uuid.uuid4().hex[:12]}",
        **fields,
    )


class Ctl:
    """The operator commands as a library (the CLI above and the tests use it)."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx

    async def status(self) -> dict[str, Any]:
        registry = self.ctx.registry
        workers = await registry.workers()
        placement = await registry.placement()
        drains = await registry.operator_drains()
        by_worker: dict[str, list[str]] = {}
        for sid, owner in placement.items():
            by_worker.setdefault(owner, []).append(sid)
        out_workers = []
        for w in workers:
            sessions = []
            # The registry's placement is the truth; a heartbeat may lag a migration by a beat.
            for sid in sorted(by_worker.get(w.id, [])):
                record = await registry.get_session(sid)
                if record is None:
                    continue
                sessions.append(
                    {
                        "id": sid,
                        "state": str(record.state),
                        "epoch": record.epoch,
                        "last_seq": record.last_seq,
                        "owner": record.owner,
                    }
                )
            status = str(w.status)
            if status == "draining" and w.id not in drains:
                # Not an operator's drain: the scheduler's scale-in, which gives it back.
                status = "releasing"
            elif status == "draining" and not sessions:
                status = "drained"
            out_workers.append(
                {
                    "id": w.id,
                    "status": status,
                    "alive": w.alive,
                    "kind": w.gpu_kind,
                    "emulated": w.emulated or None,
                    "device": w.device,
                    "capacity": w.capacity,
                    "active": w.active,
                    "suspended": len(w.suspended),
                    "waiting": w.waiting,
                    "keeping_pace": w.keeping_pace,
                    "steps": w.steps or None,
                    "full_steps": w.full_steps or None,
                    "chunks_unpublished": w.chunks_unpublished,
                    "chunk_ms": w.chunk_ms,
                    "pass_ms": w.pass_ms,
                    "sessions": sessions,
                }
            )
        pending = await registry.pending_sessions()
        # A pending session its gateway holds idle (no viewer) or paused waits for its viewer,
        # not for a worker: the scheduler does not count it pending either.
        unwatched = await registry.unwatched(pending)
        return {
            "workers": out_workers,
            "pending": [sid for sid in pending if sid not in unwatched],
            "pending_unwatched": [sid for sid in pending if sid in unwatched],
            "scheduler": await registry.scheduler_status(),
            "pool": _pool(await registry.pool_limits()),
        }

    async def command(self, worker_id: str, cmd: Any, wait_s: float = 10.0) -> Any:
        """Send a command as a request; raises CtlError when it is refused or unanswered."""
        from nats.errors import NoRespondersError
        from nats.errors import TimeoutError as NatsTimeout

        from shared.wire import CommandReply, decode, encode

        ctx = self.ctx
        try:
            msg = await ctx.nc.request(
                ctx.subjects.worker_cmd(worker_id), encode(cmd), timeout=wait_s
            )
        except NoRespondersError:
            raise CtlError(f"worker {worker_id} is not running") from None
        except NatsTimeout:
            raise CtlError(f"worker {worker_id} did not answer within {wait_s:.0f}s") from None
        reply = decode(msg.subject, msg.data, CommandReply)
        if not reply.ok:
            raise CtlError(
                f"{cmd.kind} refused by {worker_id}: {reply.code}: {reply.detail}", code=reply.code
            )
        return reply

    async def migrate(self, session_id: str, target: str, wait_s: float) -> dict[str, Any]:
        from shared.runner import subscriptions_live
        from shared.wire import MigrationReport, decode_or_drop

        ctx = self.ctx
        record = await ctx.registry.get_session(session_id)
        if record is None:
            raise CtlError(f"no session {session_id!r}")
        if record.owner is None or str(record.state) not in ("executing", "suspended"):
            raise CtlError(f"session {session_id} is {record.state}, not running on a worker")
        if record.owner == target:
            raise CtlError(f"session {session_id} already runs on {target}")
        workers = {w.id: w for w in await ctx.registry.workers()}
        if target not in workers or not workers[target].alive:
            raise CtlError(f"no live worker {target!r}")
        cmd = _worker_cmd(
            "migrate", record.owner, session_id=session_id, epoch=record.epoch, target=target
        )
        reports: asyncio.Queue[MigrationReport] = asyncio.Queue()

        async def on_report(msg: Any) -> None:
            report = decode_or_drop(msg.subject, msg.data, MigrationReport, _log())
            if report is not None and report.command_id == cmd.command_id:
                reports.put_nowait(report)

        # The owner's report: only it publishes on its subject.
        sub = await ctx.nc.subscribe(ctx.subjects.migrations(record.owner), cb=on_report)
        await subscriptions_live(ctx.nc)
        try:
            await self.command(record.owner, cmd)
            try:
                report = await asyncio.wait_for(reports.get(), wait_s)
            except TimeoutError:
                raise CtlError(
                    f"no outcome within {wait_s:.0f}s; see `turboserve ctl status`"
                ) from None
        finally:
            await sub.unsubscribe()
        if not report.ok:
            raise CtlError(
                f"migration of {session_id} to {target} failed: {report.code}: "
                f"{report.detail} (the session stays on {report.src})",
                code=str(report.code),
            )
        return {f: getattr(report, f) for f in report.__struct_fields__}

    async def drain(
        self, worker_id: str, wait_s: float, *, stop: bool = False, progress: Any = None
    ) -> int:
        """Record the operator's drain (``hold``, or ``stop`` to have the worker given back)
        for the scheduler, DRAIN the worker, then see each of its sessions moved away until it
        holds none; with ``stop``, then wait for it to be stopped. With a scheduler leading,
        the scheduler moves the active sessions (it knows every worker's slots), and this
        moves one itself only once the scheduler has left it there for
        ``SCHEDULER_MOVE_WAIT_S`` (a policy that never migrates); idle ones, and all of them
        with no scheduler, go to the ready worker with the most free slots. A session that a
        move already under way is taking away is waited for, not fought. Returns the number
        of sessions that left the worker for another one, whoever moved them."""
        ctx = self.ctx
        deadline = time.monotonic() + wait_s
        if stop:
            await self._check_floor(worker_id)
        await ctx.registry.set_operator_drain(worker_id, "stop" if stop else "hold")
        try:
            await self.command(worker_id, _worker_cmd("drain", worker_id))
        except CtlError:
            await ctx.registry.clear_operator_drain(worker_id)
            raise
        leave_to_scheduler = time.monotonic() + SCHEDULER_MOVE_WAIT_S
        seen: set[str] = set()
        while True:
            held = [
                sid for sid, owner in (await ctx.registry.placement()).items() if owner == worker_id
            ]
            seen.update(held)
            if not held:
                break
            if time.monotonic() > deadline:
                raise CtlError(f"{len(held)} session(s) still on {worker_id} after {wait_s:.0f}s")
            leading = await ctx.registry.scheduler_status() is not None
            waiting = False
            for sid in held:
                outcome = await self._move_off(
                    worker_id,
                    sid,
                    deadline,
                    active_too=not leading or (time.monotonic() > leave_to_scheduler),
                )
                if outcome is None:
                    waiting = True
                elif outcome and progress is not None:
                    progress(f"moved {sid} -> {outcome}")
            if waiting:
                await asyncio.sleep(MOVE_POLL_S)
        moved = await self._moved_away(worker_id, seen)
        if stop:
            await self._await_stopped(worker_id, deadline, wait_s)
        return moved

    async def _moved_away(self, worker_id: str, seen: set[str]) -> int:
        """How many of ``seen`` (sessions that were on ``worker_id``) run on another worker."""
        from shared.states import SessionState

        moved = 0
        for sid in seen:
            record = await self.ctx.registry.get_session(sid)
            if (
                record is not None
                and record.state is not SessionState.TERMINATED
                and record.owner not in (None, worker_id)
            ):
                moved += 1
        return moved

    async def _move_off(
        self, worker_id: str, sid: str, deadline: float, active_too: bool = True
    ) -> str | None:
        """Move ``sid`` off ``worker_id``: the target's id once moved, "" when it left by
        itself (closed, or moved by someone else), None while a move under way is taking it,
        or while it is active and not ``active_too`` (the scheduler's to move; look again
        later)."""
        from shared.states import SessionState

        record = await self.ctx.registry.get_session(sid)
        if record is None or record.owner != worker_id:
            return ""
        if record.state is SessionState.MIGRATING:
            return None
        if record.state is not SessionState.SUSPENDED and not active_too:
            return None
        target = await self._target(worker_id, active=record.state is not SessionState.SUSPENDED)
        remaining = max(1.0, deadline - time.monotonic())
        try:
            await self.migrate(sid, target, remaining)
        except CtlError as exc:
            record = await self.ctx.registry.get_session(sid)
            if record is None or record.owner != worker_id:
                return ""  # it left meanwhile
            if exc.code == "busy" or record.state is SessionState.MIGRATING:
                return None  # the scheduler's own move of it: wait for its outcome
            raise CtlError(f"drain of {worker_id} stopped: {exc}", code=exc.code) from None
        return target

    async def _check_floor(self, worker_id: str) -> None:
        """Refuse, before anything moves, a stop that the provisioner would refuse: one that
        takes the pool below its floor (``min_workers`` in the provisioner's record). The
        pool is counted as the provisioner counts it, every worker still up (booting, ready
        or draining)."""
        from shared.wire import WorkerStatus

        limits = await self.ctx.registry.pool_limits()
        if limits is None:
            return  # no provisioner has said its limits: it answers the stop itself
        up = [
            w.id
            for w in await self.ctx.registry.workers()
            if w.alive and w.status is not WorkerStatus.LOST
        ]
        if worker_id in up and len(up) - 1 < limits.min_workers:
            raise CtlError(
                f"stopping {worker_id} would take the pool below its floor of "
                f"{limits.min_workers} worker(s) (min_workers; {len(up)} up): lower the floor "
                "(TURBOSERVE_MIN_WORKERS, `turboserve up --workers`) or wait until the pool has "
                f"grown past it; `turboserve ctl drain {worker_id}` empties it and keeps it up",
                code=FLOOR_REFUSAL,
            )

    async def _await_stopped(self, worker_id: str, deadline: float, wait_s: float) -> None:
        """The scheduler gives a drained worker recorded ``stop`` back to the provisioner;
        with no scheduler leading, ask the provisioner here. Done when the worker is gone. A
        scheduler whose stop the provisioner refused for good (its floor) keeps the worker
        drained and records the drain as ``hold``: that refusal is this command's failure."""
        from shared.wire import WorkerStatus

        asked = False
        while True:
            records = {w.id: w for w in await self.ctx.registry.workers()}
            record = records.get(worker_id)
            if record is None or not record.alive or record.status is WorkerStatus.LOST:
                await self.ctx.registry.clear_operator_drain(worker_id)  # nothing left to hold
                return
            if (await self.ctx.registry.operator_drains()).get(worker_id) == "hold":
                limits = await self.ctx.registry.pool_limits()
                floor = f" of {limits.min_workers}" if limits is not None else ""
                raise CtlError(
                    f"the provisioner refused to stop {worker_id}: the pool would fall below "
                    f"its floor{floor} (min_workers); it stays drained (turboserve ctl undrain "
                    f"{worker_id} to use it again)",
                    code=FLOOR_REFUSAL,
                )
            if not asked and await self.ctx.registry.scheduler_status() is None:
                await self._provisioner_stop(worker_id)
                asked = True
            if time.monotonic() > deadline:
                raise CtlError(f"{worker_id} is drained but still running after {wait_s:.0f}s")
            await asyncio.sleep(MOVE_POLL_S)

    async def _provisioner_stop(self, worker_id: str) -> None:
        from nats.errors import NoRespondersError
        from nats.errors import TimeoutError as NatsTimeout

        from shared.wire import (
            ProvisionerCmdKind,
            ProvisionerCommand,
            ProvisionerReply,
            decode,
            encode,
        )

        cmd = ProvisionerCommand(
            kind=ProvisionerCmdKind.STOP,
            worker_ids=[worker_id],
            command_id=f"ctl-{uuid.uuid4().hex[:12]}",
        )
        try:
            msg = await self.ctx.nc.request(
                self.ctx.subjects.provisioner_cmd, encode(cmd), timeout=10.0
            )
        except NoRespondersError:
            raise CtlError(f"no scheduler and no provisioner to stop {worker_id}") from None
        except NatsTimeout:
            raise CtlError(f"the provisioner did not answer the stop of {worker_id}") from None
        reply = decode(msg.subject, msg.data, ProvisionerReply)
        if reply.refused:
            refusal = reply.refused[0]
            raise CtlError(
                f"the provisioner refused to stop {worker_id}: {refusal.code}: {refusal.detail}",
                code=refusal.code,
            )

    async def undrain(self, worker_id: str, wait_s: float = UNDRAIN_WAIT_S) -> bool | None:
        """Take a drained worker back into service: the operator's drain is forgotten and the
        worker takes sessions again. With a scheduler leading, wait (up to ``wait_s``) until
        its view has the worker back in placement: True once it has, False if it has not
        within ``wait_s``; None when no scheduler leads."""
        registry = self.ctx.registry
        await registry.clear_operator_drain(worker_id)
        await self.command(worker_id, _worker_cmd("undrain", worker_id))
        deadline = time.monotonic() + wait_s
        while True:
            status = await registry.scheduler_status()
            if status is None:
                return None
            cordoned = status.get("cordoned")
            if not isinstance(cordoned, list) or worker_id not in cordoned:
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(MOVE_POLL_S)

    async def _target(self, source: str, active: bool = True) -> str:
        """The ready worker with the most free slots, other than ``source``: the slots its
        heartbeat says are taken, or the sessions the registry has executing there when that
        is more (a heartbeat lags the moves onto it). An idle session takes no slot (``active``
        False): any ready worker may park it."""
        from shared.states import SessionState
        from shared.wire import WorkerStatus

        registry = self.ctx.registry
        executing: dict[str, int] = {}
        for sid, owner in (await registry.placement()).items():
            record = await registry.get_session(sid)
            if record is not None and record.state is not SessionState.SUSPENDED:
                executing[owner] = executing.get(owner, 0) + 1
        best: tuple[int, str] | None = None
        for w in await registry.workers():
            if w.id == source or not w.alive or w.status is not WorkerStatus.READY:
                continue
            free = w.capacity - max(w.active, executing.get(w.id, 0))
            if (free > 0 or not active) and (best is None or (free, w.id) > best):
                best = (free, w.id)
        if best is None:
            raise CtlError(f"no other ready worker with a free slot to move {source}'s sessions to")
        return best[1]


def _pool(limits: Any) -> dict[str, Any] | None:
    if limits is None:
        return None
    return {
        "min_workers": limits.min_workers,
        "max_workers": limits.max_workers,
        "backend": limits.backend,
    }


def _log() -> Any:
    from shared.logging import get_logger

    return get_logger("turboserve.ctl")


def status_json(status: dict[str, Any]) -> str:
    """``ctl status --json``: chunk times are keyed by batch size (numbers, written as strings)."""
    return orjson.dumps(status, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode()


def format_status(status: dict[str, Any]) -> str:
    """The status as a table: one line per worker, then its sessions indented."""
    lines = []
    header = (
        f"{'WORKER':<24} {'STATUS':<9} {'KIND':<14} {'SESSIONS':>8} {'WAIT':>4} {'STEPS':>5} "
        f"{'UNPUB':>5} CHUNK MS BY BATCH"
    )
    lines.append(header)
    for w in status["workers"]:
        kind = f"{w['kind']}{' (emu)' if w['emulated'] else ''}"
        chunk = " ".join(f"{b}:{ms:.0f}" for b, ms in sorted(w["chunk_ms"].items())) or "-"
        # A worker the scheduler declared lost says so; one merely late says "silent".
        alive = "" if w["alive"] or w["status"] == "lost" else " (silent)"
        # The quality budget: the steps in force over the full count ("3/4": fewer).
        steps = f"{w['steps']}/{w['full_steps']}" if w.get("steps") and w.get("full_steps") else "-"
        lines.append(
            f"{w['id']:<24} {w['status'] + alive:<9} {kind:<14} "
            f"{len(w['sessions']):>4}/{w['capacity']:<3} {w['waiting']:>4} {steps:>5} "
            f"{w.get('chunks_unpublished', 0):>5} {chunk}"
        )
        for s in w["sessions"]:
            lines.append(
                f"  {s['id']:<34} {s['state']:<10} seq {s['last_seq']:<7} epoch {s['epoch']}"
            )
    if not status["workers"]:
        lines.append("(no workers)")
    if status["pending"]:
        lines.append(f"pending: {len(status['pending'])} session(s) waiting for a worker")
    if status.get("pending_unwatched"):
        lines.append(
            f"unwatched: {len(status['pending_unwatched'])} session(s) on no worker with no "
            "viewer (placed when watched again)"
        )
    scheduler = status.get("scheduler")
    if scheduler:
        lines.append("scheduler: " + ", ".join(_brief(k, v) for k, v in scheduler.items()))
    return "\n".join(lines)


def _brief(key: str, value: Any) -> str:
    """One ``key=value`` of the scheduler's status line; nested documents (the latency profiles
    it measured) are named, not printed (``--json`` has them whole)."""
    if key == "updated_at" and isinstance(value, int | float):
        return f"{key}={time.strftime('%H:%M:%S', time.localtime(value))}"
    if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
        names = ", ".join(f"{k}: {v.get('name', '?')}" for k, v in value.items())
        return f"{key}=({names})"
    if isinstance(value, float):
        return f"{key}={value:.4g}"
    return f"{key}={value}"
