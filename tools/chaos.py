"""``turboserve chaos``: a replay while components are killed and restarted at random.

It runs its own mesh on loopback (its own NATS and Redis, two gateways, an active and a standby
scheduler, the provisioner with CPU workers emulating the default profile's GPU), plays a
synthetic session trace against the gateways with real SSE clients (a client whose gateway
dies goes to the other with ``Last-Event-ID``), and meanwhile, at seeded random moments,
kills or restarts one component: a worker (SIGKILL; its sessions continue on another from
their recovery logs), the scheduler leader (SIGKILL; the standby takes over, and a new standby
is started), a gateway (SIGKILL, started again), NATS (restarted with its JetStream store) or
Redis (restarted empty). The number of actions and their spacing are bounded, and none comes
in the last quarter of the run, so every session can finish.

It prints and writes as JSON what the viewers saw: sessions started and completed,
``chunks_lost``, ``seq_gaps``, ``seq_repeats``, ``silent_restarts`` (all must be 0) and the
stall p99, with the actions it took.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import orjson

ACTIONS = ("worker", "scheduler", "gateway", "nats", "redis")
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
        default=",".join(ACTIONS),
        help=f"the kinds of action to draw from (default: {','.join(ACTIONS)})",
    )
    p.add_argument("--json", dest="json_out", default=None, help="write the results here")
    p.add_argument(
        "--logs", default=None, help="keep every component's log in this folder (default: removed)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shared.cli import fail
    from tools.launcher import MeshStartError
    from tools.report import progress

    kinds = tuple(k.strip() for k in args.only.split(",") if k.strip())
    unknown = sorted(set(kinds) - set(ACTIONS))
    if unknown or not kinds:
        return fail(
            "chaos",
            f"--only: unknown action(s) {', '.join(unknown) or '(none)'}; "
            f"known: {', '.join(ACTIONS)}",
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
) -> dict[str, Any]:
    from tools.replay import ReplayConfig, replay

    stage = await asyncio.to_thread(_start, seed, logs)
    taken: list[dict[str, Any]] = []
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
            _monkey(stage, duration_s, seed, actions, kinds, taken, progress)
        )
        try:
            result = await replay(events, config, progress=progress)
        finally:
            monkey.cancel()
            await asyncio.gather(monkey, return_exceptions=True)
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
        "restarts": result["restarts"],
        "stall_s": result["stall_s"],
        "stall_p99_s": result["stall_s"]["p99"],
        "latency_ms": result["latency_ms"],
        "stall_adjusted_attainment": result["stall_adjusted_attainment"],
        "actions": taken,
        "worst_stalls": result["worst_stalls"],
        "duration_s": duration_s,
        "seed": seed,
    }


def _start(seed: int, logs: str | None = None) -> Stage:
    from tools.launcher import Mesh, free_port

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
        port=free_port(), workers=2, embedded="always", env=env, quiet=True, log_dir=workdir
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
    order = sorted(stage.components.values(), key=lambda c: c.name in ("nats", "redis"))
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
) -> None:
    """Act ``count`` times at seeded moments in [15%, 75%] of the run, at least 8 s apart."""
    rng = random.Random(seed * 7919)
    window = (0.15 * duration_s, 0.75 * duration_s)
    spacing = max(8.0, (window[1] - window[0]) / max(1, count))
    moments = [window[0] + i * spacing + rng.uniform(0, spacing / 2) for i in range(count)]
    started = time.monotonic()
    for moment in moments:
        if moment > window[1]:
            break
        await asyncio.sleep(max(0.0, started + moment - time.monotonic()))
        kind = rng.choice(kinds)
        detail = await _act(stage, kind, rng)
        entry = {"t": round(time.monotonic() - started, 1), "action": kind, "detail": detail}
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
    if kind == "nats":
        await asyncio.to_thread(comps["nats"].kill, signal.SIGTERM)
        await asyncio.sleep(1.0)
        comps["nats"].start()
        return "NATS restarted (its JetStream store kept)"
    await asyncio.to_thread(comps["redis"].kill)
    await asyncio.sleep(1.0)
    comps["redis"].start()
    return "Redis restarted empty"


def _is(comp: Component, scheduler_id: str) -> bool:
    given = comp.env.get("TURBOSERVE_SCHEDULER_ID")
    if given:
        return given == scheduler_id
    return scheduler_id.endswith(f"-{comp.proc.pid}")  # the default id: host-pid


async def _leader(stage: Stage) -> str | None:
    import redis.asyncio as aioredis

    client = aioredis.from_url(stage.mesh.redis_url)
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
    lines += [f"  t={a['t']:>6}s  {a['action']:<9} {a['detail']}" for a in result["actions"]]
    return "\n".join(lines)
