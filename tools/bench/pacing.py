"""``turboserve bench pacing``: several sessions on one real worker, each at its playback pace.

A gateway, a scheduler and one worker (the ``tiny`` model on the CPU by default) run in this
process on the real NATS and Redis (those at TURBOSERVE_NATS_URL / TURBOSERVE_REDIS_URL when they
answer, else embedded ones). Sessions are created a moment apart, so they sit at different phases
of the worker's passes, and each is read by its own SSE client. Over a measurement window the
bench counts what every client received:

- **chunks/s per session** against the playback rate (one chunk per period);
- **ahead**: how long before its due time a chunk was done (at most the pace lead, one period by
  default), and **late**: how long after it (``latency_ms`` in the stream);
- **first chunk**: a new session created while the others stream, from its ``POST`` to its
  first chunk at the client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from shared.quantiles import quantile
from tools.bench.control import _cleanup, _env, _scheduler, run_on_infra
from tools.sse import read_events

API_KEY = "bench-key-12345"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "pacing",
        help="sessions on one worker at their playback pace",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--sessions", type=int, default=6, help="sessions streaming at once")
    p.add_argument("--preset", default="tiny", help="the worker's model preset")
    p.add_argument(
        "--period",
        type=float,
        default=None,
        help="chunk period in seconds (default: the worker's, 0.75)",
    )
    p.add_argument("--window", type=float, default=20.0, help="seconds measured")
    p.add_argument("--stagger", type=float, default=0.4, help="seconds between creations")
    p.add_argument(
        "--newcomers",
        type=int,
        default=3,
        help="sessions created (and deleted) while the others stream",
    )
    p.add_argument("--json", dest="json_out", default=None, help="write the results here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shared.cli import fail

    if args.sessions < 1 or args.window <= 0 or args.stagger < 0 or args.newcomers < 0:
        return fail(
            "bench pacing", "--sessions >= 1, --window > 0, --stagger >= 0, --newcomers >= 0"
        )
    if args.period is not None and args.period <= 0:
        return fail("bench pacing", "--period must be > 0")
    return run_on_infra(
        "bench pacing",
        lambda nats_url, redis_url: measure(nats_url, redis_url, args),
        format_table,
        args.json_out,
    )


@dataclass
class _Stream:
    """What one SSE client received: (arrival, due_at, done_at) per chunk."""

    posted: float
    chunks: list[tuple[float, float, float]] = field(default_factory=list)
    first: asyncio.Event = field(default_factory=asyncio.Event)


async def _read(http: Any, sid: str, token: str, stream: _Stream) -> None:
    headers = {"Authorization": f"Bearer {token}", "Accept": "text/event-stream"}
    # from=start: every chunk from the first, however late this client attaches.
    async with http.get(
        f"/v1/sessions/{sid}/stream", params={"from": "start", "format": "fmp4"}, headers=headers
    ) as resp:
        if resp.status != 200:
            raise RuntimeError(f"GET /v1/sessions/{sid}/stream: {resp.status}")
        async for sse in read_events(resp.content.iter_any()):
            if sse.event == "chunk":
                timing = orjson.loads(sse.data)["timing"]
                stream.chunks.append((time.time(), timing["due_at"], timing["done_at"]))
                stream.first.set()
            elif sse.event == "end":
                return


async def _create(http: Any) -> tuple[str, str]:
    async with http.post(
        "/v1/sessions",
        json={"prompt": "a lighthouse at dusk"},
        headers={"Authorization": f"Bearer {API_KEY}"},
    ) as resp:
        body = await resp.json()
        if resp.status != 201:
            raise RuntimeError(f"POST /v1/sessions: {resp.status} {body}")
    return body["id"], body["token"]


async def measure(nats_url: str, redis_url: str, args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    from services.gateway.service import GatewayService
    from services.gpu_worker.service import WorkerService
    from shared.runner import running
    from shared.settings import DEFAULT_CHUNK_PERIOD_S, GatewaySettings, WorkerSettings
    from tools.servers import free_port

    env = _env(nats_url, redis_url)
    port = free_port()
    wsettings = WorkerSettings.from_env(
        env,
        worker_id="bench-worker",
        preset=args.preset,
        max_sessions=args.sessions + 1,
        chunk_period_s=args.period,
    )
    period = wsettings.chunk_period_s or DEFAULT_CHUNK_PERIOD_S
    gsettings = GatewaySettings.from_env(
        {**env, "TURBOSERVE_API_KEYS": f"bench:{API_KEY}"}, port=port
    )
    streams: dict[str, _Stream] = {}
    readers: list[asyncio.Task[None]] = []
    try:
        async with (
            _scheduler(env),
            running(WorkerService(wsettings), wsettings),
            running(GatewayService(gsettings), gsettings),
            aiohttp.ClientSession(
                f"http://127.0.0.1:{port}", timeout=aiohttp.ClientTimeout(total=None)
            ) as http,
        ):
            for i in range(args.sessions):
                if i:
                    await asyncio.sleep(args.stagger)
                posted = time.time()
                sid, token = await _create(http)
                streams[sid] = _Stream(posted)
                readers.append(asyncio.create_task(_read(http, sid, token, streams[sid])))
            for s in streams.values():
                await asyncio.wait_for(s.first.wait(), 60)
            await asyncio.sleep(2 * period)  # past the first chunks' buffer fill
            start = time.time()
            firsts: list[float] = []
            for _ in range(args.newcomers):
                await asyncio.sleep(args.window / (args.newcomers + 1))
                posted = time.time()
                sid, token = await _create(http)
                probe = _Stream(posted)
                task = asyncio.create_task(_read(http, sid, token, probe))
                readers.append(task)  # cancelled and awaited with the others, whatever happens
                await asyncio.wait_for(probe.first.wait(), 60)
                firsts.append(probe.chunks[0][0] - posted)
                async with http.delete(
                    f"/v1/sessions/{sid}", headers={"Authorization": f"Bearer {token}"}
                ):
                    pass
            await asyncio.sleep(max(0.0, start + args.window - time.time()))
            end = time.time()
    finally:
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        with contextlib.suppress(Exception):
            await _cleanup(env)
    rates, ahead, late = [], [], []
    for s in streams.values():
        window = [c for c in s.chunks if start <= c[0] < end]
        rates.append(len(window) / (end - start))
        for _, due, done in window:
            ahead.append(max(0.0, due - done) * 1000.0)
            late.append(max(0.0, done - due) * 1000.0)
    return {
        "sessions": args.sessions,
        "preset": args.preset,
        "period_s": period,
        "window_s": round(end - start, 2),
        "playback_chunks_per_s": round(1.0 / period, 3),
        "chunks_per_s_min": round(min(rates), 3),
        "chunks_per_s_mean": round(statistics.fmean(rates), 3),
        "chunks_per_s_max": round(max(rates), 3),
        "ahead_ms_max": round(max(ahead, default=0.0), 1),
        "late_ms_p99": round(quantile(late, 0.99), 1) if late else 0.0,
        "late_ms_max": round(max(late, default=0.0), 1),
        # chunks done by their due time, of those in the window
        "on_time_share": round(sum(1 for ms in late if ms <= 0.0) / len(late), 4) if late else None,
        "first_chunk_s": [round(f, 3) for f in firsts],
        "first_chunk_s_max": round(max(firsts), 3) if firsts else None,
    }


def format_table(r: dict[str, Any]) -> str:
    from tools.report import markdown_table

    firsts = ", ".join(f"{f:.2f}" for f in r["first_chunk_s"]) or "-"
    title = (
        f"{r['sessions']} sessions on one {r['preset']} worker, period {r['period_s']} s, "
        f"{r['window_s']} s measured"
    )
    return (
        title
        + "\n\n"
        + markdown_table(
            ("figure", "value", "playback"),
            [
                (
                    "chunks/s per session (min / mean / max)",
                    f"{r['chunks_per_s_min']} / {r['chunks_per_s_mean']} / {r['chunks_per_s_max']}",
                    r["playback_chunks_per_s"],
                ),
                ("most ahead of due (ms)", r["ahead_ms_max"], f"<= {r['period_s'] * 1000:.0f}"),
                ("late p99 / max (ms)", f"{r['late_ms_p99']} / {r['late_ms_max']}", 0),
                ("new session, POST to first chunk (s)", firsts, "< 2"),
            ],
            align="lrr",
        )
    )
