"""``turboserve bench control``: the control plane's own overhead, on loopback.

Three figures, each over many samples, with the real services in this process on the real NATS
and Redis (those at TURBOSERVE_NATS_URL / TURBOSERVE_REDIS_URL when they answer, else embedded
ones):

- **event to command**: a session event published on JetStream (created, idle, active) to the
  moment a worker receives the command the scheduler decided from it (ASSIGN, SUSPEND, RESUME);
  the worker here is a probe that answers at once, so nothing but the control plane is timed;
- **placements per second**: bursts of sessions created at once (as many as the probe's GPU
  holds), their CREATED events published together; the probe takes each ASSIGN after the
  checks a worker makes (its term and epoch against the registry, on a Redis client of its
  own); placements over the time from each burst's first event to its last ASSIGN taken. A
  second, shorter run, on a redis-server of its own, counts the Redis commands made during the
  bursts with ``MONITOR`` (those a Lua script makes left out: a script is one round trip), per
  placement;
- **create to first step**: ``POST /v1/sessions`` on the gateway to the start of the session's
  first model pass on a real worker (the tiny model on the CPU), that is the first chunk's
  completion minus its model time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Callable, Container, Coroutine, Iterator
from typing import Any, cast

import orjson

from shared.quantiles import quantile
from shared.tls import nats_tls_kwargs, redis_tls_kwargs, tls_from_env


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "control",
        help="the control plane's overhead (event to command)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--events", type=int, default=300, help="session events to time")
    p.add_argument("--sessions", type=int, default=20, help="sessions to create end to end")
    p.add_argument("--placements", type=int, default=400, help="placements to time in bursts")
    p.add_argument("--json", dest="json_out", default=None, help="write the results here")
    p.add_argument(
        "--tls",
        action="store_true",
        help="on an embedded NATS and Redis that require TLS, as `turboserve up` starts them",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shared.cli import fail

    if args.events < 10 or args.sessions < 1 or args.placements < 10:
        return fail(
            "bench control", "--events must be >= 10, --sessions >= 1 and --placements >= 10"
        )
    return run_on_infra(
        "bench control",
        lambda nats_url, redis_url: measure(
            nats_url, redis_url, args.events, args.sessions, args.placements
        ),
        format_table,
        args.json_out,
        tls=args.tls,
    )


def run_on_infra(
    label: str,
    measure: Callable[[str, str], Coroutine[Any, Any, dict[str, Any]]],
    format_table: Callable[[dict[str, Any]], str],
    json_out: str | None,
    tls: bool = False,
) -> int:
    """Run ``measure(nats_url, redis_url)`` on the NATS and Redis at TURBOSERVE_NATS_URL /
    TURBOSERVE_REDIS_URL (embedded ones where none answers; with ``tls``, embedded ones that
    require TLS, whose client files go into this process's environment for everything it
    starts), print its table, write its JSON."""
    from shared.cli import fail
    from shared.logging import configure_logging
    from tools.launcher import Mesh
    from tools.servers import MeshStartError

    configure_logging("error", "console", service="bench")
    mesh = Mesh.from_env(quiet=True, tls=tls, embedded="always" if tls else "auto")
    try:
        mesh.start_infra()
        if mesh.tls_files is not None:
            os.environ.update(mesh.tls_files.env())
        result = asyncio.run(measure(mesh.nats_url, mesh.redis_url))
        result["tls"] = mesh.tls_files is not None
    except (MeshStartError, RuntimeError, TimeoutError, OSError) as exc:
        return fail(label, str(exc) or "timed out")
    finally:
        mesh.stop()
    print(format_table(result))
    if json_out:
        with open(json_out, "wb") as f:
            f.write(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    return 0


def _env(nats_url: str, redis_url: str) -> dict[str, str]:
    tag = "bench" + uuid.uuid4().hex[:8]
    return {
        "TURBOSERVE_NATS_URL": nats_url,
        "TURBOSERVE_REDIS_URL": redis_url,
        "TURBOSERVE_SUBJECT_PREFIX": tag,
        "TURBOSERVE_REDIS_NAMESPACE": tag,
        "TURBOSERVE_LOG_LEVEL": "error",
        "TURBOSERVE_METRICS_PORT": "-1",
        # Small chunk streams: the runs' streams live side by side until the end, and an
        # embedded NATS's memory store is sized for one deployment's.
        "TURBOSERVE_STREAM_SESSIONS": "4",
        **(files.env() if (files := tls_from_env()) else {}),
    }


async def measure(
    nats_url: str, redis_url: str, events: int, sessions: int, placements: int = 400
) -> dict[str, Any]:
    env = _env(nats_url, redis_url)
    try:
        event_ms = await _event_to_command(env, events)
        placed, placed_s, _ = await _placements(env, placements, count_commands=False)
        with _private_redis() as redis_alone:  # MONITOR then shows this run's commands only
            counted, _, commands = await _placements(
                {**env, "TURBOSERVE_REDIS_URL": redis_alone},
                max(10, placements // 4),
                count_commands=True,
            )
        create_ms = await _create_to_first_step(env, sessions)
    finally:
        await _cleanup(env)
    per_placement = {name: round(n / counted, 2) for name, n in sorted(commands.items())}
    return {
        "placements_per_s": round(placed / placed_s, 1),
        "placement_samples": placed,
        "redis_commands_per_placement": round(sum(commands.values()) / counted, 2),
        "redis_commands_samples": counted,
        "redis_commands_per_placement_by_name": per_placement,
        "event_to_command_ms_p50": round(statistics.median(event_ms), 3),
        "event_to_command_ms_p99": round(quantile(event_ms, 0.99), 3),
        "event_to_command_ms_max": round(max(event_ms), 3),
        "event_samples": len(event_ms),
        "create_to_first_step_ms_p50": round(statistics.median(create_ms), 3),
        "create_to_first_step_ms_p99": round(quantile(create_ms, 0.99), 3),
        "create_samples": len(create_ms),
    }


@contextlib.contextmanager
def _private_redis() -> Iterator[str]:
    """A redis-server of our own on a free port, gone afterwards; its URL."""
    import subprocess

    from tools.servers import free_port, probe_redis, redis_server_binary

    port = free_port()
    argv = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1"]
    argv += ["--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 20
        while not probe_redis(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the bench's own redis-server did not start")
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@contextlib.asynccontextmanager
async def _scheduler(env: dict[str, str]) -> AsyncIterator[Any]:
    async with _scheduler_service(env) as (ctx, _service):
        yield ctx


@contextlib.asynccontextmanager
async def _scheduler_service(env: dict[str, str]) -> AsyncIterator[tuple[Any, Any]]:
    from services.scheduler.service import SchedulerService
    from shared.runner import running
    from shared.settings import SchedulerSettings

    settings = SchedulerSettings.from_env(env, tick_s=0.5, min_workers=1, max_workers=1)
    service = SchedulerService(settings)
    async with running(service, settings) as ctx:
        deadline = time.monotonic() + 30
        while service.live is None or not service.live.ingest.rebuilt:
            if time.monotonic() > deadline:
                raise RuntimeError("the scheduler did not take the lead")
            await asyncio.sleep(0.05)
        yield ctx, service


async def _event_to_command(env: dict[str, str], count: int) -> list[float]:
    """A probe worker answers every command at once; time event publish -> command received."""
    from shared.registry import WorkerRecord
    from shared.runner import subscriptions_live
    from shared.wire import (
        CommandReply,
        Heartbeat,
        WorkerCommand,
        WorkerStatus,
        decode,
        encode,
    )

    received: dict[tuple[str, str], float] = {}
    arrived = asyncio.Event()
    async with _scheduler(env) as ctx:
        record = WorkerRecord(
            id="probe", status=WorkerStatus.READY, capacity=count + 10, gpu_kind="H20"
        )
        await ctx.registry.register_worker(record, ttl_s=120)

        async def on_cmd(msg: Any) -> None:
            cmd = decode(msg.subject, msg.data, WorkerCommand)
            received[(str(cmd.kind), cmd.session_id or "")] = time.perf_counter()
            arrived.set()
            if msg.reply:
                await msg.respond(
                    encode(CommandReply(worker_id="probe", ok=True, command_id=cmd.command_id))
                )

        await ctx.nc.subscribe(ctx.subjects.worker_cmd("probe"), cb=on_cmd)
        beat = Heartbeat(
            worker_id="probe",
            status=WorkerStatus.READY,
            capacity=count + 10,
            active=0,
            gpu_kind="H20",
            chunk_period_s=1.25,
        )
        async with _beating(ctx, beat):
            await subscriptions_live(ctx.nc)
            await asyncio.sleep(1.5)  # the scheduler knows the probe
            return await _time_events(ctx, count, received, arrived)


async def _time_events(
    ctx: Any, count: int, received: dict[tuple[str, str], float], arrived: asyncio.Event
) -> list[float]:
    """Each session created, made idle, active again and closed; the command of each timed."""
    from shared.wire import SessionEvent, SessionEventKind, encode

    samples: list[float] = []
    plan = [
        (SessionEventKind.CREATED, "assign"),
        (SessionEventKind.IDLE, "suspend"),
        (SessionEventKind.ACTIVE, "resume"),
    ]
    i = 0
    while len(samples) < count:
        sid = f"b{i}"
        i += 1
        await ctx.registry.create_session(sid, "p", 0)
        for kind, command in plan:
            arrived.clear()
            started = time.perf_counter()
            await ctx.js.publish(
                ctx.subjects.session_events, encode(SessionEvent(session_id=sid, kind=kind))
            )
            deadline = time.monotonic() + 5
            while (command, sid) not in received:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no {command} for {sid} within 5 s")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(arrived.wait(), 1.0)
                arrived.clear()
            samples.append((received[(command, sid)] - started) * 1000.0)
        await ctx.registry.transition(sid, _terminated())
        await ctx.js.publish(
            ctx.subjects.session_events,
            encode(SessionEvent(session_id=sid, kind=SessionEventKind.CLOSED)),
        )
    return samples[:count]


async def _placements(
    env: dict[str, str], count: int, *, count_commands: bool
) -> tuple[int, float, dict[str, int]]:
    """Bursts of placements to a probe that fences each ASSIGN as a worker does; the placements
    made, the seconds they took and (with ``count_commands``) the Redis commands of the run's
    namespace meanwhile, by name."""
    import redis.asyncio as aioredis

    from services.gpu_worker.fencing import CommandFence
    from shared.registry import Registry, WorkerRecord
    from shared.runner import subscriptions_live
    from shared.states import SessionState
    from shared.wire import (
        CommandReply,
        Heartbeat,
        SessionEvent,
        SessionEventKind,
        WorkerCmdKind,
        WorkerCommand,
        WorkerStatus,
        decode,
        encode,
    )

    env = _env(env["TURBOSERVE_NATS_URL"], env["TURBOSERVE_REDIS_URL"])
    ns = env["TURBOSERVE_REDIS_NAMESPACE"]
    taken: dict[str, float] = {}  # session -> when its ASSIGN passed the probe's checks
    stopped: set[str] = set()
    refused: list[str] = []
    progress = asyncio.Event()
    seen: list[tuple[float, str]] = []  # (server time, command) of the namespace's commands
    windows: list[tuple[float, float]] = []  # the bursts, first event to last ASSIGN taken
    mark, caught_up = f"{ns}:monitor-mark", asyncio.Event()

    async with contextlib.AsyncExitStack() as stack:
        probe_redis = aioredis.from_url(
            env["TURBOSERVE_REDIS_URL"],
            **redis_tls_kwargs(env["TURBOSERVE_REDIS_URL"], tls_from_env()),
        )
        stack.push_async_callback(probe_redis.aclose)
        fence = CommandFence(Registry(probe_redis, ns), "probe")

        async def on_cmd(msg: Any) -> None:
            cmd = decode(msg.subject, msg.data, WorkerCommand)
            sid = cmd.session_id or ""
            ok = True
            if cmd.kind is WorkerCmdKind.ASSIGN:
                faults = await fence.faults(cmd, session=True)
                ok = not (faults.leader or faults.epoch)
                if ok:
                    taken[sid] = time.time()
                else:
                    refused.append(f"{sid}: {faults}")
            elif cmd.kind is WorkerCmdKind.STOP:
                stopped.add(sid)
            progress.set()
            if msg.reply:
                reply = CommandReply(worker_id="probe", ok=ok, command_id=cmd.command_id)
                await msg.respond(encode(reply))

        async def until(book: Container[str], sids: list[str], what: str) -> None:
            deadline = time.monotonic() + 30
            while not all(sid in book for sid in sids):
                if refused:
                    raise RuntimeError(f"the probe refused an ASSIGN: {refused[0]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{what} within 30 s")
                progress.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(progress.wait(), 0.5)

        if count_commands:
            monitor_client = aioredis.from_url(
                env["TURBOSERVE_REDIS_URL"],
                **redis_tls_kwargs(env["TURBOSERVE_REDIS_URL"], tls_from_env()),
            )
            stack.push_async_callback(monitor_client.aclose)
            monitor = await stack.enter_async_context(monitor_client.monitor())

            async def watch() -> None:
                async for line in monitor.listen():
                    # A script's own calls are part of its one round trip.
                    if line["client_type"] != "lua" and f" {ns}:" in line["command"]:
                        if mark in line["command"]:
                            caught_up.set()
                        seen.append((line["time"], line["command"].split(" ", 1)[0].upper()))

            watcher = asyncio.create_task(watch())
            stack.callback(watcher.cancel)

        ctx, service = await stack.enter_async_context(_scheduler_service(env))
        burst = service.profiles[service.default_kind].capacity
        beat = Heartbeat(
            worker_id="probe",
            status=WorkerStatus.READY,
            capacity=burst,
            active=0,
            gpu_kind="H20",
            chunk_period_s=1.25,
        )

        record = WorkerRecord(id="probe", status=WorkerStatus.READY, capacity=burst, gpu_kind="H20")
        await ctx.registry.register_worker(record, ttl_s=120)
        await ctx.nc.subscribe(ctx.subjects.worker_cmd("probe"), cb=on_cmd)
        await stack.enter_async_context(_beating(ctx, beat))
        await subscriptions_live(ctx.nc)
        await asyncio.sleep(1.5)  # the scheduler knows the probe
        placed = 0
        while placed < count:
            sids = [f"p{placed + i}" for i in range(min(burst, count - placed))]
            for sid in sids:
                await ctx.registry.create_session(sid, "p", 0)
            started = time.time()
            for sid in sids:
                await ctx.js.publish(
                    ctx.subjects.session_events,
                    encode(SessionEvent(session_id=sid, kind=SessionEventKind.CREATED)),
                )
            await until(taken, sids, "not every ASSIGN came")
            windows.append((started, max(taken[s] for s in sids)))
            placed += len(sids)
            for sid in sids:  # their slots free again before the next burst
                await ctx.registry.transition(sid, SessionState.TERMINATED)
                await ctx.js.publish(
                    ctx.subjects.session_events,
                    encode(SessionEvent(session_id=sid, kind=SessionEventKind.CLOSED)),
                )
            await until(stopped, sids, "not every STOP came")
        if count_commands:
            # MONITOR's lines reach us after the commands (all of the server's, parsed here):
            # wait for one sent after the last burst.
            await probe_redis.exists(mark)
            await asyncio.wait_for(caught_up.wait(), 60)
    commands: dict[str, int] = {}
    for at, name in seen:
        if any(start <= at <= end for start, end in windows):
            commands[name] = commands.get(name, 0) + 1
    return placed, sum(end - start for start, end in windows), commands


@contextlib.asynccontextmanager
async def _beating(ctx: Any, beat: Any) -> AsyncIterator[None]:
    """The probe's heartbeat every second meanwhile: it stays known (a probe silent beyond the
    worker timeout is a lost worker) however long the run takes."""
    from shared.wire import encode

    async def beat_forever() -> None:
        while True:
            await ctx.nc.publish(ctx.subjects.worker_heartbeat(beat.worker_id), encode(beat))
            await asyncio.sleep(1.0)

    task = asyncio.create_task(beat_forever())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _terminated() -> Any:
    from shared.states import SessionState

    return SessionState.TERMINATED


async def _create_to_first_step(env: dict[str, str], count: int) -> list[float]:
    """POST on a real gateway to the first pass of a real (tiny) worker."""
    import aiohttp

    from services.gateway.service import GatewayService
    from services.gpu_worker.service import WorkerService
    from shared.runner import running, subscriptions_live
    from shared.settings import GatewaySettings, WorkerSettings
    from shared.wire import Chunk, ChunkStreamMsg, decode
    from tools.servers import free_port

    env = _env(env["TURBOSERVE_NATS_URL"], env["TURBOSERVE_REDIS_URL"])
    port = free_port()
    wsettings = WorkerSettings.from_env(
        env, worker_id="bench-worker", max_sessions=count + 1, chunk_period_s=0.5
    )
    gsettings = GatewaySettings.from_env(
        {**env, "TURBOSERVE_API_KEYS": "bench:bench-key-12345"}, port=port
    )
    firsts: dict[str, float] = {}
    async with (
        _scheduler(env) as ctx,
        running(WorkerService(wsettings), wsettings),
        running(GatewayService(gsettings), gsettings),
    ):

        async def on_chunk(msg: Any) -> None:
            item = decode(msg.subject, msg.data, cast("type[ChunkStreamMsg]", ChunkStreamMsg))
            if isinstance(item, Chunk) and item.seq == 0:
                firsts[item.session_id] = item.done_at - item.gen_ms / 1000.0

        await ctx.nc.subscribe(ctx.subjects.chunks_wildcard, cb=on_chunk)
        await subscriptions_live(ctx.nc)
        samples: list[float] = []
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
            for _ in range(count):
                posted = time.time()
                async with http.post(
                    "/v1/sessions",
                    json={"prompt": "bench"},
                    headers={"Authorization": "Bearer bench-key-12345"},
                ) as resp:
                    body = await resp.json()
                    if resp.status != 201:
                        raise RuntimeError(f"POST /v1/sessions: {resp.status} {body}")
                sid = body["id"]
                deadline = time.monotonic() + 30
                while sid not in firsts:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"no first chunk for {sid} within 30 s")
                    await asyncio.sleep(0.005)
                samples.append((firsts[sid] - posted) * 1000.0)
                async with http.delete(
                    f"/v1/sessions/{sid}", headers={"Authorization": f"Bearer {body['token']}"}
                ):
                    pass
    return samples


async def _cleanup(env: dict[str, str]) -> None:
    """Remove what the runs left: their Redis keys and JetStream streams (prefix ``bench``)."""
    import nats
    import redis.asyncio as aioredis

    client = aioredis.from_url(
        env["TURBOSERVE_REDIS_URL"], **redis_tls_kwargs(env["TURBOSERVE_REDIS_URL"], tls_from_env())
    )
    try:
        keys = [k async for k in client.scan_iter(match="bench*", count=1000)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()
    nc = await nats.connect(
        env["TURBOSERVE_NATS_URL"], **nats_tls_kwargs(env["TURBOSERVE_NATS_URL"], tls_from_env())
    )
    try:
        js = nc.jetstream()
        for info in await js.streams_info():
            if info.config.name and info.config.name.startswith("bench"):
                with contextlib.suppress(Exception):
                    await js.delete_stream(info.config.name)
    finally:
        await nc.close()


def format_table(result: dict[str, Any]) -> str:
    from tools.report import markdown_table

    latency = markdown_table(
        ("figure", "p50 ms", "p99 ms", "samples", "bar"),
        [
            (
                "event to command",
                result["event_to_command_ms_p50"],
                result["event_to_command_ms_p99"],
                result["event_samples"],
                "p99 < 10 ms",
            ),
            (
                "create to first step",
                result["create_to_first_step_ms_p50"],
                result["create_to_first_step_ms_p99"],
                result["create_samples"],
                "-",
            ),
        ],
        align="lrrrl",
    )
    throughput = markdown_table(
        ("figure", "value", "placements", "by command"),
        [
            (
                "placements per second",
                result["placements_per_s"],
                result["placement_samples"],
                "-",
            ),
            (
                "Redis commands per placement",
                result["redis_commands_per_placement"],
                result["redis_commands_samples"],
                ", ".join(
                    f"{name} {n}"
                    for name, n in result["redis_commands_per_placement_by_name"].items()
                ),
            ),
        ],
        align="lrrl",
    )
    where = (
        "NATS and Redis with TLS (client certificates; Redis behind the TLS front)"
        if result.get("tls")
        else "NATS and Redis in plain text"
    )
    return f"{where}\n\n{latency}\n\n{throughput}"
