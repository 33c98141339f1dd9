"""``turboserve chaos``: a replay while components are killed and restarted at random.

It runs its own mesh on loopback (its own NATS and Redis, two gateways, an active and a standby
scheduler, the provisioner with CPU workers emulating the default profile's GPU), plays a
synthetic session trace against the gateways with real SSE clients (a client whose gateway
dies goes to the other with ``Last-Event-ID``), and meanwhile, at seeded random moments,
kills or restarts one component: a worker (SIGKILL; its sessions continue on another from
their recovery logs), the scheduler leader (SIGKILL; the standby takes over, and a new standby
is started), a gateway (SIGKILL, started again), NATS (restarted with its JetStream store) or
Redis (restarted empty). NATS and Redis run with TLS and client certificates, as
``turboserve up`` runs them (``--insecure``: in plain text). The number of actions and their spacing are bounded, and none comes
in the last quarter of the run, so every session can finish.

With ``--ha`` the mesh runs on clustered brokers, as ``turboserve up --ha`` runs them (three NATS
nodes, a Redis primary with two replicas and three sentinels), and the faults are theirs, one at a
time: the NATS node that leads the chunk stream, another node, the Redis primary, a sentinel,
each killed and its node started again; the next fault waits until it has caught up.

It prints and writes as JSON what the viewers saw: sessions started and completed,
``chunks_lost``, ``seq_gaps``, ``seq_repeats``, ``silent_restarts`` (all must be 0) and the
stall p99, with the actions it took and, per action (``faults``), the longest stall a viewer
saw, the wait for the next chunk and how long the scheduler made no decision.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, cast

import orjson

from shared.wire import Subjects

ACTIONS = ("worker", "scheduler", "gateway", "nats", "redis")
# With --ha (clustered brokers, tools/brokers.py): the broker faults, each node started again
# a few seconds after its kill; the single-server restarts above do not apply there.
HA_FAULTS = ("nats-leader", "nats-node", "redis-primary", "sentinel")
HA_ACTIONS = ("worker", "scheduler", "gateway", *HA_FAULTS)
NODE_DOWN_S = 15.0  # how long a killed NATS node or sentinel stays down
# Each fault's figures are taken from its moment to the next fault's, at most this long.
FAULT_WINDOW_S = 30.0
API_KEY = "chaos-api-key-0123456789"
OPERATOR_KEY = "chaos-operator-key-0123456789"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "chaos",
        help="a replay while components are killed at random",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load (default 120)")
    p.add_argument("--seed", type=int, default=1, help="seeds the trace and the actions")
    p.add_argument("--sessions", type=int, default=12, help="sessions in the trace")
    p.add_argument("--actions", type=int, default=5, help="kills and restarts (at most)")
    p.add_argument(
        "--only",
        default=None,
        help=f"the kinds of action to draw from (default: {','.join(ACTIONS)}; with --ha, "
        f"{','.join(HA_FAULTS)}, each in turn; also {','.join(HA_ACTIONS[:3])})",
    )
    p.add_argument(
        "--ha",
        action="store_true",
        help="on clustered brokers (three NATS nodes, a Redis primary with two replicas and "
        "three sentinels, as turboserve up --ha runs them) and their faults",
    )
    p.add_argument("--json", dest="json_out", default=None, help="write the results here")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="NATS and Redis in plain text (default: TLS, as turboserve up runs them)",
    )
    p.add_argument(
        "--logs", default=None, help="keep every component's log in this folder (default: removed)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shared.cli import fail
    from tools.report import progress
    from tools.servers import MeshStartError

    known = HA_ACTIONS if args.ha else ACTIONS
    only = args.only if args.only is not None else ",".join(HA_FAULTS if args.ha else ACTIONS)
    kinds = tuple(k.strip() for k in only.split(",") if k.strip())
    unknown = sorted(set(kinds) - set(known))
    if unknown or not kinds:
        return fail(
            "chaos",
            f"--only: unknown action(s) {', '.join(unknown) or '(none)'}"
            f"{' with --ha' if args.ha else ''}; known: {', '.join(known)}",
        )
    if args.duration < 30 or args.sessions < 1 or args.actions < 0:
        return fail("chaos", "--duration must be >= 30, --sessions >= 1, --actions >= 0")
    try:
        result = asyncio.run(
            chaos(
                args.duration,
                args.seed,
                args.sessions,
                args.actions,
                kinds,
                progress=progress,
                logs=args.logs,
                tls=not args.insecure,
                ha=args.ha,
            )
        )
    except MeshStartError as exc:
        return fail("chaos", exc)
    print(format_result(result))
    if args.json_out:
        with open(args.json_out, "wb") as f:
            f.write(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    bad = [k for k in ("chunks_lost", "seq_gaps", "seq_repeats", "silent_restarts") if result[k]]
    return 1 if bad else 0


def trace(sessions: int, duration_s: float, seed: int) -> list[tuple[float, str, str]]:
    """Sessions arriving over the first half of the run, each active for 30-60% of the run with
    an idle spell in the middle of some, all gone by 85% of it."""
    rng = random.Random(seed)
    events: list[tuple[float, str, str]] = []
    for i in range(sessions):
        sid = f"c{i}"
        arrive = rng.uniform(0.02, 0.5) * duration_s
        depart = min(arrive + rng.uniform(0.3, 0.6) * duration_s, 0.85 * duration_s)
        events.append((arrive, sid, "arrive"))
        if rng.random() < 0.4 and depart - arrive > 20:
            idle = arrive + (depart - arrive) * rng.uniform(0.3, 0.5)
            events += [(idle, sid, "idle"), (idle + rng.uniform(4, 8), sid, "active")]
        events.append((depart, sid, "depart"))
    return sorted(events)


@dataclass
class Component:
    """A process chaos may kill and start again (same command, environment and port)."""

    name: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes]
    log: Path

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                env=self.env,
                stdout=out,
                stderr=out,
                stdin=subprocess.DEVNULL,
                process_group=0,
            )

    def kill(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=20)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Stage:
    """The mesh chaos runs, and the components it may act on."""

    mesh: Any
    workdir: Path
    components: dict[str, Component] = field(default_factory=dict)
    gateways: list[str] = field(default_factory=list)
    schedulers: int = 0
    keep: bool = False  # leave the logs in workdir


async def chaos(
    duration_s: float,
    seed: int,
    sessions: int,
    actions: int,
    kinds: tuple[str, ...] = ACTIONS,
    progress: Any = None,
    logs: str | None = None,
    tls: bool = True,
    ha: bool = False,
) -> dict[str, Any]:
    from tools.replay import ReplayConfig, replay

    stage = await asyncio.to_thread(_start, seed, logs, tls, ha)
    taken: list[dict[str, Any]] = []
    ticks: list[float] = []  # the scheduler's published ticks (its status's updated_at)
    try:
        config = ReplayConfig(
            gateway=stage.gateways[0],
            more_gateways=tuple(stage.gateways[1:]),
            api_key=API_KEY,
            operator_key=OPERATOR_KEY,
            speed=1.0,
            drain_s=15.0,
        )
        events = trace(sessions, duration_s, seed)
        monkey = asyncio.create_task(
            _monkey(stage, duration_s, seed, actions, kinds, taken, progress, in_turn=ha)
        )
        watch = asyncio.create_task(_watch_ticks(stage, ticks))
        try:
            result = await replay(events, config, progress=progress)
        finally:
            monkey.cancel()
            watch.cancel()
            await asyncio.gather(monkey, watch, return_exceptions=True)
    finally:
        await asyncio.to_thread(_stop, stage)
    return {
        "sessions_started": result["sessions"],
        "sessions_completed": result["sessions_completed"],
        "refused": result["refused"],
        "chunks": result["chunks"],
        "chunks_lost": result["chunks_lost"],
        "seq_gaps": result["seq_gaps"],
        "seq_repeats": result["seq_repeats"],
        "silent_restarts": result["silent_restarts"],
        "silent_restart_sessions": result["silent_restart_sessions"],
        "lost_sessions": result["lost_sessions"],
        "restarts": result["restarts"],
        "stall_s": result["stall_s"],
        "stall_p99_s": result["stall_s"]["p99"],
        "latency_ms": result["latency_ms"],
        "stall_adjusted_attainment": result["stall_adjusted_attainment"],
        "actions": taken,
        "faults": fault_figures(taken, result["stall_spans"], ticks, result["period_s"]),
        "worst_stalls": result["worst_stalls"],
        "duration_s": duration_s,
        "seed": seed,
        "tls": tls,
        "ha": ha,
    }


def _start(seed: int, logs: str | None = None, tls: bool = True, ha: bool = False) -> Stage:
    from tools.launcher import Mesh
    from tools.servers import free_port

    workdir = Path(logs) if logs else Path(tempfile.mkdtemp(prefix="turboserve-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    env = {
        "TURBOSERVE_LOG_LEVEL": "info",
        "TURBOSERVE_LOG_FORMAT": "json",
        "TURBOSERVE_EMULATE": "H20",
        "TURBOSERVE_MAX_WORKERS": "4",
        "TURBOSERVE_API_KEYS": f"chaos:{API_KEY}",
        "TURBOSERVE_OPERATOR_KEY": OPERATOR_KEY,
        "TURBOSERVE_TICK_S": "0.25",
        "TURBOSERVE_WORKER_TIMEOUT_S": "4",
        "TURBOSERVE_LEADER_TTL_S": "2",
        "TURBOSERVE_METRICS_PORT": "-1",
        "TURBOSERVE_SUBJECT_PREFIX": f"chaos{seed}",
        "TURBOSERVE_REDIS_NAMESPACE": f"chaos{seed}",
        "TURBOSERVE_STATE_DIR": str(workdir / "state"),
    }
    mesh = Mesh(
        port=free_port(),
        workers=2,
        embedded="always",
        env=env,
        quiet=True,
        log_dir=workdir,
        tls=tls,
        ha=ha,
    )
    mesh.start(ready_timeout=120)
    stage = Stage(mesh=mesh, workdir=workdir, gateways=[mesh.gateway_url], keep=bool(logs))
    for name, proc in mesh.procs:
        argv = [str(a) for a in cast("list[str]", proc.args)]  # Mesh starts each with a list
        stage.components[name] = Component(
            name, argv, dict(os.environ), proc, workdir / f"{name}.log"
        )
    child = {
        **os.environ,
        **env,
        "TURBOSERVE_NATS_URL": mesh.nats_url,
        "TURBOSERVE_REDIS_URL": mesh.redis_url,
        **(mesh.tls_files.env() if mesh.tls_files else {}),
        **mesh.broker_env(),
    }
    for name in ("gateway", "scheduler"):
        stage.components[name].env = {**child, "TURBOSERVE_PORT": str(mesh.port)}
    # A second gateway and a standby scheduler.
    port = free_port()
    second = Component(
        "gateway2",
        [sys.executable, "-m", "tools.cli", "gateway"],
        {**child, "TURBOSERVE_PORT": str(port)},
        None,  # type: ignore[arg-type]
        workdir / "gateway2.log",
    )
    second.start()
    stage.components["gateway2"] = second
    stage.gateways.append(f"http://127.0.0.1:{port}")
    _add_scheduler(stage, child)
    _wait_healthy(stage.gateways[1])
    return stage


def _add_scheduler(stage: Stage, env: dict[str, str]) -> None:
    import sys as _sys

    stage.schedulers += 1
    name = f"scheduler{stage.schedulers + 1}"
    comp = Component(
        name,
        [_sys.executable, "-m", "tools.cli", "scheduler"],
        {**env, "TURBOSERVE_SCHEDULER_ID": name},
        None,  # type: ignore[arg-type]
        stage.workdir / f"{name}.log",
    )
    comp.start()
    stage.components[name] = comp


def _wait_healthy(url: str, timeout: float = 60.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)


def _stop(stage: Stage) -> None:
    """Every process chaos started or restarted itself first (the mesh knows only the ones it
    started), services before NATS and Redis; then the mesh's own."""
    import shutil

    ours = {id(p) for _, p in stage.mesh.procs}
    order = sorted(
        stage.components.values(), key=lambda c: c.name.startswith(("nats", "redis", "sentinel"))
    )
    for comp in order:
        if id(comp.proc) not in ours and comp.proc.poll() is None:
            with contextlib.suppress(Exception):
                comp.kill(signal.SIGTERM)
    stage.mesh.stop()
    if not stage.keep:
        shutil.rmtree(stage.workdir, ignore_errors=True)


async def _monkey(
    stage: Stage,
    duration_s: float,
    seed: int,
    count: int,
    kinds: tuple[str, ...],
    taken: list[dict[str, Any]],
    progress: Any,
    in_turn: bool = False,
) -> None:
    """Act ``count`` times at seeded moments in [15%, 75%] of the run, at least 8 s apart;
    each kind drawn at random, or (``in_turn``) every kind once in a seeded order, then again."""
    rng = random.Random(seed * 7919)
    window = (0.15 * duration_s, 0.75 * duration_s)
    spacing = max(8.0, (window[1] - window[0]) / max(1, count))
    moments = [window[0] + i * spacing + rng.uniform(0, spacing / 2) for i in range(count)]
    order = rng.sample(kinds, len(kinds))
    started = time.monotonic()
    for i, moment in enumerate(moments):
        if moment > window[1]:
            break
        await asyncio.sleep(max(0.0, started + moment - time.monotonic()))
        kind = order[i % len(order)] if in_turn else rng.choice(kinds)
        t, at = time.monotonic() - started, time.time()  # the fault's moment, run and wall clock
        detail = await _act(stage, kind, rng)
        entry = {
            "t": round(t, 1),
            "at": round(at, 3),
            "action": kind,
            "detail": detail,
        }
        taken.append(entry)
        if progress is not None:
            progress(f"chaos: t={entry['t']}s {kind}: {detail}")


async def _act(stage: Stage, kind: str, rng: random.Random) -> str:
    comps = stage.components
    if kind == "worker":
        pids = _children(comps["provisioner"].proc.pid)
        if not pids:
            return "no worker to kill"
        pid = rng.choice(pids)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return f"SIGKILL worker pid {pid}"
    if kind == "scheduler":
        leader = await _leader(stage)
        victim = next(
            (
                c
                for c in comps.values()
                if c.name.startswith("scheduler")
                and c.proc.poll() is None
                and leader
                and _is(c, leader)
            ),
            None,
        )
        if victim is None:
            return "no leader found"
        await asyncio.to_thread(victim.kill)
        _add_scheduler(stage, comps["gateway2"].env)  # a new standby
        return f"SIGKILL scheduler leader {leader}; a new standby started"
    if kind == "gateway":
        victim = comps[rng.choice(["gateway", "gateway2"])]
        await asyncio.to_thread(victim.kill)
        await asyncio.sleep(3.0)
        victim.start()
        return f"SIGKILL {victim.name}, started again 3 s later"
    if kind in HA_FAULTS:
        return await _broker_fault(stage, kind, rng)
    if kind == "nats":
        await asyncio.to_thread(comps["nats"].kill, signal.SIGTERM)
        await asyncio.sleep(1.0)
        comps["nats"].start()
        return "NATS restarted (its JetStream store kept)"
    await asyncio.to_thread(comps["redis"].kill)
    await asyncio.sleep(1.0)
    comps["redis"].start()
    return "Redis restarted empty"


async def _broker_fault(stage: Stage, kind: str, rng: random.Random) -> str:
    """One fault of the clustered brokers; the node comes back (the Redis primary once the
    sentinels have promoted another, so that it rejoins as a replica), and the fault is over
    once it has caught up."""
    from tools.brokers import primary_port, watched

    comps = stage.components
    if kind in ("nats-leader", "nats-node"):
        leader = await _chunk_stream_leader(stage)  # a server name: n1, n2, n3
        nodes = sorted(name for name in comps if name.startswith("nats"))
        lead = f"nats{leader[1:]}" if leader else None
        if kind == "nats-leader":
            if lead not in comps:
                return f"no leader of the chunk stream found ({leader})"
            victim, what = comps[lead], "the chunk stream's leader"
        else:
            victim, what = comps[rng.choice([n for n in nodes if n != lead])], "not its leader"
        await asyncio.to_thread(victim.kill)
        await asyncio.sleep(NODE_DOWN_S)
        victim.start()
        caught_up = await _settled(partial(_streams_current, stage))
        return (
            f"SIGKILL NATS node {victim.name} ({what}); started again {NODE_DOWN_S:.0f} s later, "
            f"{_caught_up(caught_up)}"
        )
    group = stage.mesh.redis_group
    if kind == "redis-primary":
        port = await asyncio.to_thread(primary_port, group)
        if port not in group.nodes:
            return "no Redis primary found"
        victim = comps[f"redis{group.nodes.index(port) + 1}"]
        await asyncio.to_thread(victim.kill)
        t0 = time.monotonic()
        promoted = port
        while promoted in (port, None) and time.monotonic() - t0 < 60:
            await asyncio.sleep(0.1)
            promoted = await asyncio.to_thread(primary_port, group)
        if promoted in (port, None):
            victim.start()
            return f"SIGKILL Redis primary {victim.name}; no replica promoted within 60 s"
        took = time.monotonic() - t0
        victim.start()
        new = f"redis{group.nodes.index(promoted) + 1}"
        caught_up = await _settled(partial(asyncio.to_thread, watched, group))
        return (
            f"SIGKILL Redis primary {victim.name}; the sentinels promoted {new} in {took:.1f} s; "
            f"{victim.name} started again, as a replica, {_caught_up(caught_up)}"
        )
    victim = comps[f"sentinel{rng.randint(1, len(group.sentinels))}"]
    await asyncio.to_thread(victim.kill)
    await asyncio.sleep(NODE_DOWN_S)
    victim.start()
    caught_up = await _settled(partial(asyncio.to_thread, watched, group))
    return (
        f"SIGKILL {victim.name}; started again {NODE_DOWN_S:.0f} s later, {_caught_up(caught_up)}"
    )


# A fault is over once its node has caught up: the next comes only then (one fault at a time).
SETTLE_S = 90.0


async def _settled(healthy: Callable[[], Awaitable[bool]]) -> float | None:
    """Seconds until ``healthy()`` holds (None: not within SETTLE_S)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < SETTLE_S:
        if await healthy():
            return time.monotonic() - t0
        await asyncio.sleep(0.25)
    return None


def _caught_up(took: float | None) -> str:
    if took is None:
        return f"not caught up within {SETTLE_S:.0f} s"
    return f"caught up {took:.1f} s later"


async def _streams_current(stage: Stage) -> bool:
    """Both streams have a leader and every replica current."""
    nc = await _operator_nats(stage)
    if nc is None:
        return False
    try:
        prefix = stage.components["gateway2"].env["TURBOSERVE_SUBJECT_PREFIX"]
        subjects = Subjects(prefix)
        for name in (subjects.sessions_stream, subjects.chunks_stream):
            cluster = (await nc.jetstream().stream_info(name)).cluster
            if cluster is None or not cluster.leader:
                return False
            replicas = cluster.replicas or []
            if len(replicas) < 2 or not all(r.current and not r.offline for r in replicas):
                return False
        return True
    except Exception:  # noqa: BLE001 - between leaders
        return False
    finally:
        await nc.close()


async def _operator_nats(stage: Stage) -> Any:
    """A connection to any node that answers (None: none does)."""
    import nats

    from shared.settings import nats_servers
    from shared.tls import nats_tls_kwargs

    url = stage.mesh.nats_url
    try:
        return await nats.connect(
            servers=nats_servers(url),
            connect_timeout=2,
            max_reconnect_attempts=1,
            error_cb=_quiet,
            **nats_tls_kwargs(url, stage.mesh.tls_files),
        )
    except Exception:  # noqa: BLE001 - no node answers
        return None


async def _quiet(exc: Exception) -> None:
    """A node that is down, as the run meant: nothing to print."""


async def _chunk_stream_leader(stage: Stage) -> str | None:
    nc = await _operator_nats(stage)
    if nc is None:
        return None
    try:
        prefix = stage.components["gateway2"].env["TURBOSERVE_SUBJECT_PREFIX"]
        info = await nc.jetstream().stream_info(Subjects(prefix).chunks_stream)
        return info.cluster.leader if info.cluster else None
    except Exception:  # noqa: BLE001 - between leaders
        return None
    finally:
        await nc.close()


async def _watch_ticks(stage: Stage, ticks: list[float]) -> None:
    """Every quarter second, the scheduler's last published tick, as a gateway shows it
    (either gateway: one may be down)."""
    import aiohttp

    headers = {"Authorization": f"Bearer {OPERATOR_KEY}"}
    timeout = aiohttp.ClientTimeout(total=1)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        while True:
            for gateway in stage.gateways:
                try:
                    async with http.get(f"{gateway}/v1/cluster", headers=headers) as resp:
                        view = await resp.json() if resp.status == 200 else {}
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    continue
                tick = (view.get("scheduler") or {}).get("updated_at")
                if isinstance(tick, int | float) and (not ticks or tick != ticks[-1]):
                    ticks.append(float(tick))
                break
            await asyncio.sleep(0.25)


def fault_figures(
    taken: list[dict[str, Any]],
    stall_spans: list[list[float]],
    ticks: list[float],
    period_s: float,
) -> list[dict[str, Any]]:
    """Per action, from its moment to the next one's (at most FAULT_WINDOW_S): the longest
    stall beyond one period that a viewer saw end in that window; the longest any viewer
    waiting at the fault then waited for its next chunk (None: none waited beyond a period);
    the longest time the scheduler published no tick (its decisions delayed)."""
    out = []
    for i, action in enumerate(taken):
        start = action["at"]
        end = start + FAULT_WINDOW_S
        if i + 1 < len(taken):
            end = min(end, taken[i + 1]["at"])
        spans = [s for s in stall_spans if start <= s[1] <= end]  # ended in the window
        waiting = [s[1] - start for s in spans if s[0] <= start]
        seen = sorted(t for t in ticks if start - 5.0 <= t <= end)
        pauses = [b - a for a, b in zip(seen, seen[1:], strict=False)]
        out.append(
            {
                "fault": action["action"],
                "t": action["t"],
                "at": action["at"],
                "detail": action["detail"],
                "longest_stall_s": round(max((s[2] for s in spans), default=0.0), 3),
                "next_chunk_s": round(max(waiting), 3) if waiting else None,
                "scheduler_pause_s": round(max(pauses), 3) if pauses else None,
                "window_s": round(end - start, 1),
            }
        )
    return out


def _is(comp: Component, scheduler_id: str) -> bool:
    given = comp.env.get("TURBOSERVE_SCHEDULER_ID")
    if given:
        return given == scheduler_id
    return scheduler_id.endswith(f"-{comp.proc.pid}")  # the default id: host-pid


async def _leader(stage: Stage) -> str | None:
    from shared.runner import redis_client

    client = redis_client(stage.mesh.redis_url, stage.mesh.tls_files)
    try:
        raw = await client.get(
            f"{stage.components['gateway2'].env['TURBOSERVE_REDIS_NAMESPACE']}:scheduler:leader"
        )
    except Exception:  # noqa: BLE001 - Redis may be restarting: no leader to name now
        return None
    finally:
        await client.aclose()
    if raw is None:
        return None
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return text.split(":", 1)[1]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def format_result(result: dict[str, Any]) -> str:
    rows = [
        (
            "sessions started / completed",
            f"{result['sessions_started']} / {result['sessions_completed']}",
        ),
        ("chunks", result["chunks"]),
        ("chunks lost", result["chunks_lost"]),
        ("seq gaps / repeats", f"{result['seq_gaps']} / {result['seq_repeats']}"),
        ("silent restarts (announced)", f"{result['silent_restarts']} ({result['restarts']})"),
        ("stall p99 / max s", f"{result['stall_s']['p99']} / {result['stall_s']['max']}"),
        ("stall-adjusted attainment", result["stall_adjusted_attainment"]),
        ("actions", len(result["actions"])),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines += [f"  t={a['t']:>6}s  {a['action']:<13} {a['detail']}" for a in result["actions"]]
    lines += ["", "fault           longest stall s  next chunk s  scheduler pause s"]
    for f in result["faults"]:
        lines.append(
            f"{f['fault']:<15} {f['longest_stall_s']:>15}  {_or_dash(f['next_chunk_s']):>12}"
            f"  {_or_dash(f['scheduler_pause_s']):>17}"
        )
    return "\n".join(lines)


def _or_dash(value: float | None) -> str:
    return "-" if value is None else str(value)
