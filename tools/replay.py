"""``turboserve replay``: play a session trace against a running gateway, as its viewers would.

Each ``arrive`` creates a session (``POST /v1/sessions``) and attaches a real SSE client to its
stream; ``idle`` and ``active`` pause and resume it (the gateway's control routes); ``depart``
closes it (``DELETE``). ``--speed X`` plays the trace X times faster. Every chunk is checked on
the client side: its seq (gaps are lost chunks, repeats are repeats), how late it came against
its due time, and, for every active stretch, how many chunk periods passed with no chunk (what
the viewer sees as a frozen picture). With an operator key it also reads the mesh's own account
from ``GET /v1/cluster``: the GPU-seconds spent, migrations, scale events and the peak pool.

It talks only to the URL it is given, and every loop in it is bounded (the trace's length plus
a drain period).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import math
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from lab.sim.synth import BUILTIN_NAMES
from lab.sim.viewer import ServiceLedger, summary
from tools.sse import read_events

DEFAULT_DEADLINE_MS = 1250.0
# A wait beyond one period longer than this is kept as a stall span (``stall_spans``); the
# longest STALL_SPANS_KEPT of a run are reported.
STALL_SPAN_S = 0.25
STALL_SPANS_KEPT = 500


@dataclass
class SessionLog:
    """What one viewer saw. Service is counted by the simulator's own ``ServiceLedger`` (one
    definition of latency, on time and missed periods for both)."""

    trace_id: str
    ledger: ServiceLedger
    id: str | None = None
    token: str = ""
    refused: str = ""  # error code when the gateway refused to create it
    seqs: list[int] = field(default_factory=list)
    delivery_ms: list[float] = field(default_factory=list)  # done at the worker -> received
    restarts: int = 0
    states: list[str] = field(default_factory=list)
    spell_start: float | None = None  # when the current active spell began (wall clock)
    first_of_spell: bool = True
    next_due: float | None = None  # when the next chunk is due by the worker's clock
    last_epoch: int | None = None  # the owner epoch of the last chunk
    announced: bool = False  # a state event came since the last chunk
    silent_restarts: int = 0  # the owner changed with no state event: never expected
    # Each silent restart, to find it in the logs: the chunk's seq, the epochs, the wall clock.
    silent: list[dict[str, Any]] = field(default_factory=list)
    received: list[float] = field(default_factory=list)  # when each chunk arrived
    stall_s: float = 0.0  # the longest wait for a chunk beyond one period, while active
    # Each wait of more than STALL_SPAN_S beyond a period: (last chunk, next chunk or the
    # spell's end), wall clock; the chaos run finds what each fault cost in them.
    stalls: list[tuple[float, float]] = field(default_factory=list)
    ended: bool = False  # its stream ended with `event: end`
    errors: list[str] = field(default_factory=list)
    # How long after its due time each action was sent (behind this viewer's previous one,
    # e.g. a pause that waits for the worker's confirmation): counted in the startup it leads
    # to, as a viewer would count it.
    action_lag_ms: list[float] = field(default_factory=list)
    moved: bool = False  # a `migrated` notice came since the last chunk
    after_pause: int = 0  # chunks that arrived while the viewer was paused (or gone)
    missed_after_move: int = 0  # periods missed by the first chunk after a migration
    # The quality budget: per chunk, when it was done (wall clock), the denoising steps it ran
    # (0: the worker did not say) and whether it was on time.
    step_log: list[tuple[float, int, bool]] = field(default_factory=list)

    def activate(self, now: float) -> None:
        if self.spell_start is None:
            self.spell_start, self.first_of_spell, self.next_due = now, True, None

    def deactivate(self, now: float) -> None:
        """The spell ends: if its next chunk is overdue, the viewer was left waiting."""
        if self.spell_start is None:
            return
        last = self.received[-1] if self.received and not self.first_of_spell else None
        if last is not None:  # a stream that froze until the spell ended
            self._waited(last, now)
        if self.first_of_spell:
            self.ledger.spell_ended((now - self.spell_start) * 1000.0, first=True)
        elif self.next_due is not None:
            self.ledger.spell_ended((now - self.next_due) * 1000.0, first=False)
        self.spell_start = None

    def _waited(self, since: float, until: float) -> None:
        stall = until - since - self.ledger.period_s
        self.stall_s = max(self.stall_s, stall)
        if stall > STALL_SPAN_S:
            self.stalls.append((since, until))

    def owner(self, epoch: int | None, seq: int | None = None) -> None:
        """A chunk from the owner at ``epoch``: a new owner is always announced first (placed,
        migrated, recovered, restarted); one that is not would be a silent restart."""
        if epoch is None:
            return
        if self.last_epoch is not None and epoch != self.last_epoch and not self.announced:
            self.silent_restarts += 1
            self.silent.append(
                {"seq": seq, "from_epoch": self.last_epoch, "epoch": epoch, "at": time.time()}
            )
        self.last_epoch, self.announced = epoch, False

    def chunk(self, seq: int, due_at: float, done_at: float, now: float, steps: int = 0) -> None:
        if self.received and self.spell_start is not None and not self.first_of_spell:
            self._waited(self.received[-1], now)
        self.received.append(now)
        self.seqs.append(seq)
        self.delivery_ms.append(max(0.0, now - done_at) * 1000.0)
        if self.spell_start is None:
            # Generated before the worker heard of the pause (it suspends at a chunk
            # boundary): nobody watches it. Not a period served, as the simulator voids a
            # chunk in flight when its session goes idle; counted apart.
            self.after_pause += 1
            return
        on_time_before = self.ledger.on_time
        self._deliver(due_at, done_at)
        self.step_log.append((done_at, steps, self.ledger.on_time > on_time_before))

    def _deliver(self, due_at: float, done_at: float) -> None:
        latency_ms = (done_at - due_at) * 1000.0
        if self.spell_start is not None and self.first_of_spell:
            self.ledger.delivered(latency_ms, startup_ms=(done_at - self.spell_start) * 1000.0)
            self.first_of_spell = False
        else:
            missed = self.ledger.delivered(latency_ms)
            if self.moved:
                self.missed_after_move += missed
        self.moved = False
        self.next_due = max(due_at, done_at) + self.ledger.period_s


# How long `replay --compare-sim` waits for the scheduler's account before it plays anything.
COMPARE_ACCOUNT_WAIT_S = 60.0


@dataclass(frozen=True)
class ReplayConfig:
    gateway: str
    api_key: str | None
    operator_key: str | None
    speed: float
    offset_s: float = 0.0
    duration_s: float | None = None
    drain_s: float = 10.0
    deadline_ms: float | None = None
    period_s: float | None = None
    max_sessions: int | None = None
    more_gateways: tuple[str, ...] = ()  # others to fail over to (any gateway serves any session)
    # Wait up to this long for the scheduler's account (its latency profiles) before playing,
    # and stop with an error if none comes (what --compare-sim needs); 0: play without.
    account_wait_s: float = 0.0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "replay",
        help="play a session trace against a running gateway (load generator)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--trace",
        required=True,
        help=f"a trace CSV (t,session_id,event) or a built-in name ({', '.join(BUILTIN_NAMES)})",
    )
    p.add_argument(
        "--gateway",
        default=None,
        help="gateway URL, or several comma-separated (a viewer fails over to the "
        "next; default: the one `turboserve up` runs, else http://127.0.0.1:8080)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="API key to create sessions (default: "
        "TURBOSERVE_API_KEY, or the one `turboserve up` made)",
    )
    p.add_argument(
        "--operator-key",
        default=None,
        help="to read the mesh's account (cost, migrations, scale events) from /v1/cluster",
    )
    p.add_argument("--speed", type=float, default=1.0, help="play the trace X times faster")
    p.add_argument("--offset", type=float, default=0.0, help="start this far into the trace (s)")
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="play this much of the trace (s of trace time; default: all)",
    )
    p.add_argument(
        "--max-sessions", type=int, default=None, help="play only the first N sessions that arrive"
    )
    p.add_argument(
        "--deadline-ms",
        type=float,
        default=None,
        help="a chunk within this of its due time counts as on time (default: the "
        "scheduler's, else 1250)",
    )
    p.add_argument(
        "--period-s",
        type=float,
        default=None,
        help="the sessions' chunk period (default: the deadline, as emulated workers pace)",
    )
    p.add_argument(
        "--drain",
        type=float,
        default=10.0,
        help="seconds to wait for the last chunks after the trace ends",
    )
    p.add_argument(
        "--compare-sim",
        action="store_true",
        help="also run the simulator on the same trace (same compression, boot delay, "
        "pool limits and the latency profile the live workers measured; needs "
        "the operator key) and print both, with the relative error",
    )
    p.add_argument("--json", dest="json_out", default=None, help="write the results here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lab.sim.catalog import load_trace
    from lab.sim.traceio import TraceError
    from shared.cli import fail
    from shared.settings import ToolSettings
    from tools.launcher import read_state
    from tools.report import progress

    if not args.speed > 0 or (args.duration is not None and not args.duration > 0):
        return fail("replay", "--speed and --duration must be > 0")
    try:
        trace = load_trace(args.trace)
    except (TraceError, FileNotFoundError, OSError) as exc:
        return fail("replay", exc)
    settings = ToolSettings.from_env()
    state = read_state(settings.state_path) or {}
    urls = [
        u.strip().rstrip("/")
        for u in (args.gateway or state.get("gateway_url") or "http://127.0.0.1:8080").split(",")
        if u.strip()
    ]
    config = ReplayConfig(
        gateway=urls[0],
        more_gateways=tuple(urls[1:]),
        api_key=args.api_key or settings.api_key or state.get("api_key") or None,
        operator_key=(
            args.operator_key or settings.operator_key or state.get("operator_key") or None
        ),
        speed=args.speed,
        offset_s=args.offset,
        duration_s=args.duration,
        drain_s=args.drain,
        deadline_ms=args.deadline_ms,
        period_s=args.period_s,
        max_sessions=args.max_sessions,
        account_wait_s=COMPARE_ACCOUNT_WAIT_S if args.compare_sim else 0.0,
    )
    if args.compare_sim and not config.operator_key:
        return fail(
            "replay",
            "--compare-sim needs the operator key (--operator-key or "
            "TURBOSERVE_OPERATOR_KEY) to read the scheduler's account",
        )
    events = select_events(trace.events, config)
    if not events:
        return fail("replay", "no event of the trace falls in the window asked for")
    try:
        result = asyncio.run(replay(events, config, progress=progress))
    except ReplayError as exc:
        return fail("replay", exc)
    result["trace"] = trace.name
    compare_error: ReplayError | None = None
    if args.compare_sim:
        try:
            compare_with_sim(result, events, config)
        except ReplayError as exc:
            compare_error = exc  # the live run's figures are still printed and written
    print(format_result(result))
    if "sim" in result:
        print()
        print(format_comparison(result))
    if args.json_out:
        public = {k: v for k, v in result.items() if not k.startswith("_")}
        with open(args.json_out, "wb") as f:
            f.write(orjson.dumps(public, option=orjson.OPT_INDENT_2))
    return 0 if compare_error is None else fail("replay", compare_error)


class ReplayError(RuntimeError):
    """The replay cannot run (gateway unreachable, no key): one line for the user."""


def select_events(events: Any, config: ReplayConfig) -> list[tuple[float, str, str]]:
    """The trace window asked for, re-timed from 0; sessions that arrived before the window
    are left out (their events too); a session still there at its end departs then."""
    start = config.offset_s
    end = math.inf if config.duration_s is None else start + config.duration_s
    chosen: dict[str, bool] = {}
    out: list[tuple[float, str, str]] = []
    last_t = 0.0
    for e in events:
        if e.t < start or e.t > end:
            continue
        if e.event == "arrive":
            if config.max_sessions is not None and len(chosen) >= config.max_sessions:
                continue
            chosen[e.session_id] = True
        elif e.session_id not in chosen:
            continue
        out.append((e.t - start, e.session_id, e.event))
        last_t = e.t - start
        if e.event == "depart":
            chosen[e.session_id] = False
    for sid, open_ in chosen.items():
        if open_:
            out.append((last_t, sid, "depart"))
    return out


class Gateways:
    """The gateway URLs a viewer may use (any gateway serves any session): a request that
    cannot reach one is sent to the next, the way a client behind a load balancer retries."""

    def __init__(self, session: Any, urls: list[str]) -> None:
        self.session = session
        self.urls = urls
        self.current = 0

    def request(self, method: str, path: str, **kw: Any) -> Any:
        return _Failover(self, method, path, kw)


class _Failover:
    """``async with gateways.request(...) as resp``: tries each gateway once, current first."""

    def __init__(self, pool: Gateways, method: str, path: str, kw: dict[str, Any]) -> None:
        self.pool, self.method, self.path, self.kw = pool, method, path, kw
        self._ctx: Any = None

    async def __aenter__(self) -> Any:
        import aiohttp

        error: Exception | None = None
        for _ in range(len(self.pool.urls)):
            url = self.pool.urls[self.pool.current] + self.path
            self._ctx = self.pool.session.request(self.method, url, **self.kw)
            try:
                return await self._ctx.__aenter__()
            except aiohttp.ClientConnectionError as exc:
                error = exc
                self.pool.current = (self.pool.current + 1) % len(self.pool.urls)
        assert error is not None
        raise error

    async def __aexit__(self, *exc: Any) -> Any:
        return await self._ctx.__aexit__(*exc)


async def replay(
    events: list[tuple[float, str, str]], config: ReplayConfig, progress: Any = None
) -> dict[str, Any]:
    import aiohttp

    logs: dict[str, SessionLog] = {}
    timeout = aiohttp.ClientTimeout(total=None, connect=10, sock_read=None)
    # Every viewer holds a connection for its stream and may hold one more for a control that
    # waits for its worker: no pool limit, or a crowd would queue behind it.
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        http = Gateways(session, [config.gateway, *config.more_gateways])
        before = await _cluster(http, config)
        if config.account_wait_s > 0:
            before = await _await_account(http, config, before)
        deadline_ms = config.deadline_ms or _deadline(before) or DEFAULT_DEADLINE_MS
        period_s = config.period_s or deadline_ms / 1000.0
        readers: set[asyncio.Task[None]] = set()
        latest: dict[str, asyncio.Task[None]] = {}  # each viewer's latest action
        actions: set[asyncio.Task[None]] = set()  # every action not yet done
        failed: list[asyncio.Task[None]] = []  # actions that raised (a ReplayError)
        stop = asyncio.Event()  # set when one did: the replay stops at once

        def settled(task: asyncio.Task[None]) -> None:
            actions.discard(task)
            if not task.cancelled() and task.exception() is not None:
                failed.append(task)
                stop.set()

        started = time.monotonic()
        started_wall = time.time()
        peak = [0]

        async def sample_peak() -> None:
            while True:
                view = await _cluster(http, config)
                if view and view.get("scheduler"):
                    peak[0] = max(peak[0], int(view["scheduler"].get("gpus") or 0))
                await asyncio.sleep(1.0)

        sampler = asyncio.create_task(sample_peak()) if config.operator_key else None
        last_report = 0.0
        try:
            for t, trace_id, kind in events:
                wait = started + t / config.speed - time.monotonic()
                if wait > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), wait)
                _raise_failure(failed)
                log = logs.get(trace_id)
                if log is None:
                    log = logs[trace_id] = SessionLog(
                        trace_id, ServiceLedger(period_s, deadline_ms)
                    )
                # Viewers act on their own: a slow request (a pause waits for the worker's
                # confirmation) never holds up the others, and one viewer's actions keep their
                # order.
                task = asyncio.create_task(
                    _act_after(latest.get(trace_id), http, config, log, kind, readers, time.time())
                )
                task.add_done_callback(settled)
                latest[trace_id] = task
                actions.add(task)
                now = time.monotonic()
                if progress is not None and now - last_report >= 2.0:
                    last_report = now
                    progress(_progress_line(logs, t, events[-1][0]))
            while actions and not stop.is_set():
                await asyncio.wait(actions, return_when=asyncio.FIRST_EXCEPTION)
            _raise_failure(failed)
            drain_until = time.monotonic() + config.drain_s
            while readers and time.monotonic() < drain_until:
                await asyncio.wait(readers, timeout=min(1.0, drain_until - time.monotonic()))
        finally:
            pending = list(actions)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            now = time.time()
            for log in logs.values():
                log.deactivate(now)
            for task in readers:
                task.cancel()
            if readers:
                await asyncio.wait(readers, timeout=5.0)
            if sampler is not None:
                sampler.cancel()
                await asyncio.gather(sampler, return_exceptions=True)
        after = await _cluster(http, config)
    wall_s = time.monotonic() - started
    result = summarize(list(logs.values()), deadline_ms, before, after, peak[0], wall_s)
    result["steps"] = step_summary(list(logs.values()), started_wall)
    result["_before"], result["_after"] = before, after  # for --compare-sim; not written out
    return result


def _raise_failure(failed: list[asyncio.Task[None]]) -> None:
    """Raise what stopped a viewer's action, if one did (a ReplayError: it stops the replay)."""
    if failed:
        exc = failed[0].exception()
        assert exc is not None
        raise exc


async def _act_after(
    previous: asyncio.Task[None] | None,
    http: Any,
    config: ReplayConfig,
    log: SessionLog,
    kind: str,
    readers: set[asyncio.Task[None]],
    at: float,
) -> None:
    """``kind`` for this viewer once its previous action is done; ``at``: when it was due."""
    if previous is not None:
        await asyncio.wait([previous])  # its outcome is its own (a failure stops the replay)
    log.action_lag_ms.append(max(0.0, time.time() - at) * 1000.0)
    try:
        await _act(http, config, log, kind, readers, at)
    except (asyncio.CancelledError, ReplayError):
        raise  # a ReplayError (the gateway unreachable, the key refused) stops the replay
    except Exception as exc:  # noqa: BLE001 - counted against the viewer, never fatal
        log.errors.append(f"{kind}: {exc!r}")


async def _act(
    http: Any,
    config: ReplayConfig,
    log: SessionLog,
    kind: str,
    readers: set[asyncio.Task[None]],
    now: float,
) -> None:
    if kind == "arrive":
        await _create(http, config, log)
        if log.id is not None:
            log.activate(now)
            task = asyncio.create_task(_read_stream(http, log))
            task.add_done_callback(functools.partial(_record_failure, log=log))
            readers.add(task)
            task.add_done_callback(readers.discard)
        return
    if log.id is None:
        return  # refused at arrival
    if kind == "idle":
        log.deactivate(now)
        await _control(http, log, "pause")
    elif kind == "active":
        log.activate(now)
        await _control(http, log, "resume")
    elif kind == "depart":
        log.deactivate(now)
        status, _ = await _call(http, "DELETE", f"/v1/sessions/{log.id}", _bearer(log.token))
        if status >= 400:
            log.errors.append(f"DELETE {status}")


def compare_with_sim(
    result: dict[str, Any], events: list[tuple[float, str, str]], config: ReplayConfig
) -> None:
    """Add ``sim`` (the simulator's figures for what was played, under the same keys) and
    ``error_pct`` to ``result``; the pool's facts come from the mesh's own account."""
    from lab.sim.compare import error_pct, simulate_replay
    from lab.sim.traceio import make_trace
    from services.scheduler.shipped import load_rho_table
    from shared.profile import profile_from_dict

    before: dict[str, Any] = result.get("_before") or {}
    status = before.get("scheduler")
    if not status or not _has_account(before):
        raise ReplayError(
            "--compare-sim needs the scheduler's account (give --operator-key to "
            "a mesh whose scheduler runs)"
        )
    kind = status.get("gpu_kind") or next(iter(status["profiles"]))
    after_status = (result.get("_after") or {}).get("scheduler") or status
    profile = profile_from_dict(
        (after_status.get("profiles") or status["profiles"])[kind], source="the live scheduler"
    )
    pool = before.get("pool") or {}
    ready = sum(
        1 for w in before.get("workers", []) if w.get("alive") and w.get("status") == "ready"
    )
    # ``events`` are in trace seconds (the window, re-timed from 0): the simulator compresses
    # them by the same speed and stops where the replay stopped.
    trace = make_trace("replayed", events)
    policy = str(status.get("policy", "turboserve"))
    sim = simulate_replay(
        trace,
        profile,
        speed=config.speed,
        boot_delay_s=float(status.get("boot_delay_s", 5.0)),
        min_gpus=int(pool.get("min_workers", 1)),
        max_gpus=pool.get("max_workers"),
        initial_gpus=max(1, ready),
        policy=policy,
        rho_table=load_rho_table() if policy.startswith("turboserve") else None,
        tick_s=float(status.get("tick_s", 0.5)),
        duration_s=result["wall_s"],
    )
    result["sim"] = sim
    result["error_pct"] = error_pct(result, sim)


def format_comparison(result: dict[str, Any]) -> str:
    from lab.sim.compare import COMPARED

    def get(doc: dict[str, Any], key: str) -> Any:
        value: Any = doc
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        return value

    rows = [("figure", "live", "sim", "error %")]
    for key in COMPARED:
        err = result["error_pct"].get(key)
        rows.append(
            (
                key,
                str(get(result, key)),
                str(get(result["sim"], key)),
                "-" if err is None else f"{err:+.1f}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def _record_failure(task: asyncio.Task[None], log: SessionLog) -> None:
    """A viewer that stopped on an error nobody expected: counted, never silent."""
    if not task.cancelled() and task.exception() is not None:
        log.errors.append(f"viewer stopped: {task.exception()!r}")


RETRY_S = 15.0  # how long a request is retried while the mesh answers 5xx, 429 or nothing


async def _call(
    http: Any, method: str, path: str, headers: dict[str, str], body: Any = None
) -> tuple[int, Any]:
    """A request retried (with a growing pause, for up to ``RETRY_S``) while the gateways
    answer a retryable error or do not answer, as a real client would; (status, JSON body)
    of the last answer, status 0 when none came."""
    import aiohttp

    deadline = time.monotonic() + RETRY_S
    delay = 0.25
    status, data = 0, None
    while True:
        try:
            async with http.request(method, path, headers=headers, json=body) as resp:
                status = resp.status
                data = await resp.json(content_type=None) if resp.content_length != 0 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            status, data = 0, None
        if status and status < 500 and status != 429:
            return status, data
        if time.monotonic() + delay > deadline:
            return status, data
        await asyncio.sleep(delay)
        delay = min(2 * delay, 2.0)


async def _create(http: Any, config: ReplayConfig, log: SessionLog) -> None:
    body = {"prompt": f"replayed session {log.trace_id}"}
    status, data = await _call(http, "POST", "/v1/sessions", _bearer(config.api_key), body)
    if status == 0:
        raise ReplayError(f"cannot reach the gateway at {config.gateway}")
    if status != 201:
        log.refused = (data or {}).get("error", {}).get("code", str(status))
        if status in (401, 403):
            raise ReplayError(f"the gateway refused the API key ({status}): give --api-key")
        return
    log.id, log.token = data["id"], data.get("token", "")


async def _control(http: Any, log: SessionLog, action: str) -> None:
    status, _ = await _call(http, "POST", f"/v1/sessions/{log.id}/{action}", _bearer(log.token))
    if status >= 400 and status != 409 or status == 0:
        log.errors.append(f"{action} {status}")


async def _read_stream(http: Any, log: SessionLog, max_reconnects: int = 60) -> None:
    """Follow the session's SSE stream to its end, reconnecting with Last-Event-ID (as a
    browser's EventSource does): after a dropped connection or a retryable answer (5xx, 429),
    with a growing pause; a refusal that cannot change (401, 403, 404) ends it."""
    import aiohttp

    delay = 0.25
    for _ in range(max_reconnects):
        headers = _bearer(log.token)
        if log.seqs:
            headers["Last-Event-ID"] = str(log.seqs[-1])
        try:
            # from=start: the viewer's account begins at seq 0 even when it attaches after
            # the first chunks (a stream starts at the live edge otherwise).
            async with http.request(
                # fmp4: one line an event, and no JPEG made for a client that reads timings
                "GET",
                f"/v1/sessions/{log.id}/stream?from=start&format=fmp4",
                headers=headers,
            ) as resp:
                if resp.status in (401, 403, 404):
                    log.errors.append(f"stream {resp.status}")
                    return
                if resp.status == 200:
                    delay = 0.25
                    if await _follow(resp, log):
                        return
                else:
                    log.errors.append(f"stream {resp.status}")
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.errors.append(f"stream: {type(exc).__name__}")
        except ValueError as exc:  # a malformed event: say so, and read on from the next
            log.errors.append(f"stream: bad event ({exc})")
        await asyncio.sleep(delay)
        delay = min(2 * delay, 2.0)


async def _follow(resp: Any, log: SessionLog) -> bool:
    """Read SSE events; True when the stream ended for good (``event: end``)."""
    async for sse in read_events(resp.content):
        if sse.event == "chunk" and sse.data:
            body = orjson.loads(sse.data)
            timing = body.get("timing", {})
            now = time.time()
            log.owner(body.get("epoch"), seq=body.get("seq"))
            log.chunk(
                int(body["seq"]),
                float(timing.get("due_at", now)),
                float(timing.get("done_at", now)),
                now,
                steps=int(timing.get("steps") or 0),
            )
        elif sse.event == "state" and sse.data:
            state = orjson.loads(sse.data)
            kind = str(state.get("kind") or state.get("state") or "")
            log.states.append(kind)
            log.restarts += kind == "restarted"
            log.moved = log.moved or kind == "migrated"
            log.announced = True
        elif sse.event == "end":
            log.ended = True
            return True
    return False


def _bearer(secret: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"} if secret else {}


def _has_account(view: Mapping[str, Any] | None) -> bool:
    """The scheduler leads and has published the latency profiles its workers measured."""
    return bool(view and (view.get("scheduler") or {}).get("profiles"))


async def _await_account(
    http: Any, config: ReplayConfig, view: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The mesh's account once its scheduler's is in it (a mesh that has just come up may not
    have a leader, or a worker, yet); a ReplayError after ``account_wait_s`` without."""
    deadline = time.monotonic() + config.account_wait_s
    while not _has_account(view):
        if time.monotonic() >= deadline:
            raise ReplayError(
                f"no scheduler account after {config.account_wait_s:g} s (GET /v1/cluster with "
                "the operator key: is the scheduler running, and has a worker come up?)"
            )
        await asyncio.sleep(0.5)
        view = await _cluster(http, config)
    return view


async def _cluster(http: Any, config: ReplayConfig) -> dict[str, Any] | None:
    if not config.operator_key:
        return None
    try:
        async with http.request("GET", "/v1/cluster", headers=_bearer(config.operator_key)) as resp:
            if resp.status != 200:
                return None
            view: dict[str, Any] = await resp.json()
            return view
    except Exception:  # noqa: BLE001 - the account is optional; the run goes on without it
        return None


def _deadline(view: Mapping[str, Any] | None) -> float | None:
    if not view or not view.get("scheduler"):
        return None
    value = view["scheduler"].get("deadline_ms")
    return float(value) if isinstance(value, int | float) else None


def summarize(
    logs: list[SessionLog],
    deadline_ms: float,
    before: Mapping[str, Any] | None,
    after: Mapping[str, Any] | None,
    peak_gpus: int,
    wall_s: float,
) -> dict[str, Any]:
    """The run's figures, under the same definitions as the simulator's (``ServiceLedger``)."""
    period_s = logs[0].ledger.period_s if logs else deadline_ms / 1000.0
    total = ServiceLedger(period_s, deadline_ms)
    lost = repeats = gaps = 0
    missing: list[dict[str, Any]] = []  # which viewer missed which seqs, to read the logs there
    for log in logs:
        total.latencies_ms += log.ledger.latencies_ms
        total.chunks += log.ledger.chunks
        total.on_time += log.ledger.on_time
        total.missed_periods += log.ledger.missed_periods
        total.missed_at_start += log.ledger.missed_at_start
        total.startups_ms += log.ledger.startups_ms
        seen: set[int] = set()
        for seq in log.seqs:
            repeats += seq in seen
            seen.add(seq)
        if seen:
            lost += (max(seen) - min(seen) + 1) - len(seen) + min(seen)  # gaps, and a late start
            ordered = sorted(seen)
            gaps += sum(1 for a, b in zip(ordered, ordered[1:], strict=False) if b > a + 1)
            gaps += ordered[0] > 0
            absent = sorted(set(range(max(seen) + 1)) - seen)
            if absent:
                missing.append({"trace_id": log.trace_id, "id": log.id, "seqs": absent[:16]})
    service = total.summary()
    result: dict[str, Any] = {
        "sessions": sum(1 for log in logs if log.id is not None),
        "refused": sum(1 for log in logs if log.refused),
        "chunks": total.chunks,
        "chunks_after_pause": sum(log.after_pause for log in logs),
        "chunks_lost": lost,
        "seq_repeats": repeats,
        "seq_gaps": gaps,
        "lost_sessions": missing,
        "sessions_completed": sum(1 for log in logs if log.ended),
        "stall_s": summary([max(0.0, log.stall_s) for log in logs if log.id is not None]),
        "restarts": sum(log.restarts for log in logs),
        "silent_restarts": sum(log.silent_restarts for log in logs),
        # Which sessions restarted silently, and where, to read their logs around it.
        "silent_restart_sessions": [
            {"trace_id": log.trace_id, "id": log.id, "states": log.states[-8:], "at": log.silent}
            for log in logs
            if log.silent
        ],
        "latency_ms": service["latency_ms"],
        "delivery_ms": summary([x for log in logs for x in log.delivery_ms]),
        "deadline_ms": deadline_ms,
        "period_s": period_s,
        "deadline_attainment": service["deadline_attainment"],
        "stall_adjusted_attainment": service["stall_adjusted_attainment"],
        "missed_periods": total.missed_periods,
        "missed_periods_at_start": total.missed_at_start,
        "missed_periods_after_migration": sum(log.missed_after_move for log in logs),
        "startup_ms": service["startup_ms"],
        "action_lag_ms": summary([x for log in logs for x in log.action_lag_ms]),
        "errors": sum(len(log.errors) for log in logs),
        # The sessions that waited longest for a chunk, with what their viewer went through.
        "worst_stalls": [
            {
                "trace_id": log.trace_id,
                "id": log.id,
                "stall_s": round(log.stall_s, 3),
                "chunks": len(log.seqs),
                "states": log.states[-8:],
                "errors": log.errors[-5:],
            }
            for log in sorted(logs, key=lambda x: -x.stall_s)[:3]
        ],
        "wall_s": round(wall_s, 1),
        # The longest waits (wall clock from, to, and the stall beyond one period).
        "stall_spans": sorted(
            (
                [round(a, 3), round(b, 3), round(b - a - period_s, 3)]
                for log in logs
                for a, b in log.stalls
            ),
            key=lambda span: -span[2],
        )[:STALL_SPANS_KEPT],
    }
    result.update(_account(before, after, peak_gpus))
    return result


# The reduced-steps timeline's bucket, in seconds of the run.
STEP_BUCKET_S = 10.0


def step_summary(logs: list[SessionLog], started_wall: float) -> dict[str, Any]:
    """The quality budget as the viewers saw it: chunks by their denoising steps; on time at the
    full count (the most any chunk of the run ran), on time at fewer, and late; and, per
    ``STEP_BUCKET_S`` of the run, how many chunks ran fewer steps and how many were late. Empty when no worker said
    how many steps its chunks ran."""
    entries = [entry for log in logs for entry in log.step_log if entry[1] > 0]
    if not entries:
        return {}
    full = max(steps for _, steps, _ in entries)
    reduced = [done_at for done_at, steps, _ in entries if steps < full]
    timeline: dict[int, list[int]] = {}
    for done_at, steps, ok in entries:
        bucket = int(max(0.0, done_at - started_wall) // STEP_BUCKET_S)
        row = timeline.setdefault(bucket, [0, 0, 0])
        row[0] += 1
        row[1] += steps < full
        row[2] += not ok
    return {
        "full_steps": full,
        "by_steps": {str(k): v for k, v in sorted(Counter(s for _, s, _ in entries).items())},
        "on_time_full": sum(1 for _, steps, ok in entries if ok and steps == full),
        "on_time_reduced": sum(1 for _, steps, ok in entries if ok and steps < full),
        "late": sum(1 for _, _, ok in entries if not ok),
        "reduced_pct": round(100.0 * len(reduced) / len(entries), 3),
        "last_reduced_s": round(max(reduced) - started_wall, 1) if reduced else None,
        "timeline": [
            {"t_s": bucket * STEP_BUCKET_S, "chunks": row[0], "reduced": row[1], "late": row[2]}
            for bucket, row in sorted(timeline.items())
        ],
    }


def _account(
    before: Mapping[str, Any] | None, after: Mapping[str, Any] | None, peak: int
) -> dict[str, Any]:
    """The mesh's own figures over the run (None without an operator key)."""
    keys = ("cost_gpu_seconds", "migrations", "scale_out_events", "scale_in_events", "peak_gpus")
    if not before or not after:
        return dict.fromkeys(keys)
    b, a = before.get("counters") or {}, after.get("counters") or {}
    cost_b = (before.get("cost") or {}).get("gpu_seconds")
    cost_a = (after.get("cost") or {}).get("gpu_seconds")
    return {
        "cost_gpu_seconds": None if cost_a is None or cost_b is None else round(cost_a - cost_b, 1),
        "migrations": int(a.get("migrations", 0)) - int(b.get("migrations", 0)),
        "scale_out_events": int(a.get("scale_out_events", 0)) - int(b.get("scale_out_events", 0)),
        "scale_in_events": int(a.get("scale_in_events", 0)) - int(b.get("scale_in_events", 0)),
        "peak_gpus": peak or None,
    }


def _progress_line(logs: Mapping[str, SessionLog], t: float, end: float) -> str:
    chunks = sum(len(log.seqs) for log in logs.values())
    live = sum(1 for log in logs.values() if log.spell_start is not None)
    return (
        f"replay: trace t={t:7.1f}/{end:.0f}s  sessions={len(logs)}  active={live}  chunks={chunks}"
    )


def format_result(result: Mapping[str, Any]) -> str:
    lat = result["latency_ms"]
    rows = [
        ("sessions (refused)", f"{result['sessions']} ({result['refused']})"),
        (
            "chunks (after a pause, not counted)",
            f"{result['chunks']} ({result.get('chunks_after_pause', 0)})",
        ),
        ("chunks lost / repeated", f"{result['chunks_lost']} / {result['seq_repeats']}"),
        ("restarts (all announced)", result["restarts"]),
        (
            "delivery p50 / p99 ms",
            f"{result['delivery_ms']['p50']} / {result['delivery_ms']['p99']}",
        ),
        ("latency p50 / p99 / max ms", f"{lat['p50']} / {lat['p99']} / {lat['max']}"),
        ("deadline attainment", result["deadline_attainment"]),
        ("stall-adjusted attainment", result["stall_adjusted_attainment"]),
        (
            "missed periods (before a first chunk, after a migration)",
            f"{result['missed_periods']} ({result['missed_periods_at_start']}, "
            f"{result['missed_periods_after_migration']})",
        ),
        ("startup p50 / p99 ms", f"{result['startup_ms']['p50']} / {result['startup_ms']['p99']}"),
        (
            "action lag p50 / p99 ms",
            f"{result['action_lag_ms']['p50']} / {result['action_lag_ms']['p99']}",
        ),
        ("GPU-seconds", result.get("cost_gpu_seconds")),
        ("migrations", result.get("migrations")),
        (
            "scale out / in events",
            f"{result.get('scale_out_events')} / {result.get('scale_in_events')}",
        ),
        ("peak GPUs", result.get("peak_gpus")),
        ("wall time s", result["wall_s"]),
    ]
    steps = result.get("steps") or {}
    if steps:
        last = steps["last_reduced_s"]
        rows.append(
            (
                f"chunks on time at {steps['full_steps']} steps / fewer, late",
                f"{steps['on_time_full']} / {steps['on_time_reduced']}, {steps['late']}"
                f" (last at fewer steps: {'none' if last is None else f'{last} s'})",
            )
        )
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
