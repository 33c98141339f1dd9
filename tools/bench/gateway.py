"""``turboserve bench gateway``: SSE delivery latency with many concurrent clients.

A gateway runs as its own process (as in production) on the NATS and Redis of this machine
(or embedded ones). The benchmark creates sessions through the API, opens ``--clients`` SSE
streams spread over them, and injects chunks on NATS at the real rate (one per session every
``--period`` seconds, sessions staggered across the period, each a worker's H.264 fragment of
``--frames`` frames of ``--size``: a moving gradient with texture, encoded at
``TURBOSERVE_VIDEO_BITRATE``). The clients read ``?format=`` ``--format``: ``fmp4`` is relayed
as it came, ``jpeg`` makes the gateway decode each chunk once and JPEG-encode its frames. Each
chunk carries the wall time of its publish (``done_at``); a client's delivery latency is its
receipt time minus that: NATS, JetStream, the gateway's fan-out and the SSE socket together.
The gateway's CPU time over the measured window (its process, every thread, from
``/proc``) is reported per client. The clients and the injector share one process, the
gateway has its own.

    turboserve bench gateway --clients 1000 --size 832x480 --format fmp4 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import numpy as np

from shared.quantiles import quantile
from shared.tls import nats_tls_kwargs, redis_tls_kwargs, tls_from_env
from tools.sse import SseEvent, SseParser

if TYPE_CHECKING:
    import aiohttp
    from nats.aio.client import Client as NatsClient

T = TypeVar("T")

DONE_AT = re.compile(rb'"done_at":([0-9.eE+-]+)')
OPENING_AT_ONCE = 32
API_KEY = "bench-" + uuid.uuid4().hex


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "gateway",
        help="SSE delivery latency (NATS publish to client receipt) with N clients",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--clients", type=int, default=1000, help="concurrent SSE clients (default 1000)"
    )
    p.add_argument(
        "--sessions",
        type=int,
        default=None,
        help="sessions the clients watch (default: one per client)",
    )
    p.add_argument("--seconds", type=float, default=20.0, help="measured time (default 20)")
    p.add_argument("--warmup", type=float, default=3.0, help="unmeasured time first (default 3)")
    p.add_argument(
        "--period",
        type=float,
        default=0.75,
        help="seconds between a session's chunks (default 0.75: 12 frames at 16 fps)",
    )
    p.add_argument("--frames", type=int, default=12, help="frames per chunk (default 12)")
    p.add_argument(
        "--size", default="64x64", help="frame size WxH (default 64x64, the tiny preset)"
    )
    p.add_argument(
        "--format",
        dest="fmt",
        choices=("jpeg", "fmp4"),
        default="jpeg",
        help="what the clients ask for (default jpeg, the API's default)",
    )
    p.add_argument(
        "--json",
        dest="json_out",
        default=None,
        metavar="OUT",
        help="write {clients, delivery_ms_p50, delivery_ms_p99, ...} here",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="on an embedded NATS and Redis that require TLS, as `turboserve up` starts them",
    )
    p.set_defaults(func=run)


@dataclass(frozen=True, slots=True)
class DeliveryPlan:
    """What ``bench gateway`` measures, from its options."""

    clients: int
    sessions: int
    seconds: float
    warmup: float
    period: float
    frames: int
    width: int
    height: int
    fmt: str = "jpeg"
    tls: bool = False


@dataclass
class Tally:
    clients: int
    latencies_ms: list[float] = field(default_factory=list)
    lags: int = 0
    ends: int = 0
    errors: list[str] = field(default_factory=list)
    opened: int = 0
    all_open: asyncio.Event = field(default_factory=asyncio.Event)

    def note_open(self) -> None:
        self.opened += 1
        if self.opened == self.clients:
            self.all_open.set()


class BenchError(Exception):
    """Bad options or an environment that cannot run the benchmark: said in one line."""


def plan_of(args: argparse.Namespace) -> DeliveryPlan:
    sessions = args.clients if args.sessions is None else args.sessions
    m = re.fullmatch(r"(\d+)x(\d+)", args.size)
    faults = []
    if not 1 <= args.clients <= 10_000:
        faults.append("--clients must be 1-10000")
    if not 1 <= sessions <= args.clients:
        faults.append("--sessions must be 1..clients")
    if not 0 < args.seconds <= 3600 or not 0 <= args.warmup <= 600:
        faults.append("--seconds must be in (0, 3600] and --warmup in [0, 600]")
    if not 0.01 <= args.period <= 60:
        faults.append("--period must be 0.01-60 s")
    if not 1 <= args.frames <= 64:
        faults.append("--frames must be 1-64")
    if m is None or not (8 <= int(m[1]) <= 1920 and 8 <= int(m[2]) <= 1080):
        faults.append("--size must be WxH, 8-1920 by 8-1080")
    if faults:
        raise BenchError("; ".join(faults))
    assert m is not None
    return DeliveryPlan(
        args.clients,
        sessions,
        args.seconds,
        args.warmup,
        args.period,
        args.frames,
        int(m[1]),
        int(m[2]),
        args.fmt,
        getattr(args, "tls", False),
    )


def run(args: argparse.Namespace) -> int:
    from shared.cli import fail

    try:
        plan = plan_of(args)
        result = asyncio.run(bench(plan))
    except BenchError as exc:
        return fail("bench gateway", exc)
    print_table(result)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def print_table(r: dict[str, Any]) -> None:
    from tools.report import markdown_table

    print(
        ("NATS and Redis with TLS; " if r.get("tls") else "")
        + f"gateway delivery, {r['clients']} SSE clients ({r['format']}, {r['size']}) on "
        f"{r['sessions']} sessions, a chunk per session every {r['period_s']} s "
        f"({r['chunks_per_s']:.0f} chunks/s in, {r['events_per_s']:.0f} events/s out, "
        f"{r['event_kib']:.1f} KiB each)"
    )
    print()
    print(
        markdown_table(
            (
                "clients",
                "sessions",
                "events",
                "p50 ms",
                "p99 ms",
                "max ms",
                "lags",
                "gateway CPU ms/s per client",
                "bar (p99)",
            ),
            [
                (
                    r["clients"],
                    r["sessions"],
                    r["events"],
                    f"{r['delivery_ms_p50']:.1f}",
                    f"{r['delivery_ms_p99']:.1f}",
                    f"{r['delivery_ms_max']:.1f}",
                    r["lags"],
                    "n/a"
                    if r["gateway_cpu_ms_per_s_per_client"] is None
                    else f"{r['gateway_cpu_ms_per_s_per_client']:.3f}",
                    "< 50 ms",
                )
            ],
            align="rrrrrrrrr",
        )
    )


# Distinct chunks the injector cycles through (each encoded once, as a worker encodes once).
DISTINCT_CHUNKS = 4


def model_like(width: int, height: int, count: int, start: int = 0) -> np.ndarray:
    """``count`` frames of a model-like picture: smooth colour gradients drifting, with a fine
    texture on them (noise compresses like real video content does not; flat colour is too
    easy)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    rng = np.random.default_rng(3)
    texture = rng.random((height // 4 + 1, width // 4 + 1), np.float32)
    texture = np.repeat(np.repeat(texture, 4, 0), 4, 1)[:height, :width] * 24.0
    out = []
    for i in range(start, start + count):
        r = 128 + 100 * np.sin((x + 6 * i) / 97.0) + texture
        g = 128 + 100 * np.sin((y - 4 * i) / 71.0 + x / 181.0)
        b = 128 + 100 * np.cos((x + y + 5 * i) / 131.0) + np.roll(texture, 3 * i, axis=1)
        out.append(np.stack([r, g, b], -1).clip(0, 255).astype(np.uint8))
    return np.stack(out)


def fragments(plan: DeliveryPlan) -> list[Any]:
    """The chunks' fragments, as a worker encodes them (``fmp4.Fragment``)."""
    from services.gpu_worker.fmp4 import chunk_start_s, encode_chunk
    from shared.settings import WorkerSettings

    bitrate = WorkerSettings.from_env().video_bitrate
    fps = plan.frames / plan.period
    return [
        encode_chunk(
            model_like(plan.width, plan.height, plan.frames, c * plan.frames),
            fps,
            chunk_start_s(c, plan.period),
            bitrate=bitrate,
        )
        for c in range(DISTINCT_CHUNKS)
    ]


def process_cpu_s(pid: int) -> float | None:
    """A process's CPU time (user + system, every thread), from ``/proc``; None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def bench(plan: DeliveryPlan) -> dict[str, Any]:
    from tools.launcher import Mesh
    from tools.servers import MeshStartError

    infra = Mesh.from_env(quiet=True, tls=plan.tls, embedded="always" if plan.tls else "auto")
    try:
        infra.start_infra()
        if infra.tls_files is not None:  # the gateway and this process's clients use them
            os.environ.update(infra.tls_files.env())
    except MeshStartError as exc:
        raise BenchError(str(exc)) from None
    try:
        pids: list[int] = []
        async with gateway_process(infra.nats_url, infra.redis_url, "bench", pids) as (
            tag,
            port,
            url,
        ):
            return await _measure(plan, infra.nats_url, infra.redis_url, tag, port, url, pids[0])
    finally:
        infra.stop()


@contextlib.asynccontextmanager
async def gateway_process(
    nats_url: str, redis_url: str, prefix: str, pids: list[int] | None = None
) -> AsyncIterator[tuple[str, int, str]]:
    """A gateway process on its own subject prefix and Redis namespace, ready: yields
    ``(tag, port, url)`` (its pid appended to ``pids``, where given); stopped and its streams
    and keys removed afterwards."""
    import aiohttp

    from tools.servers import free_port

    tag = prefix + uuid.uuid4().hex[:8]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    gateway = _start_gateway(nats_url, redis_url, tag, port)
    if pids is not None:
        pids.append(gateway.pid)
    try:
        async with aiohttp.ClientSession(url) as http:
            await _wait_ready(http, gateway)
        yield tag, port, url
    finally:
        gateway.send_signal(signal.SIGTERM)
        try:
            gateway.wait(timeout=30)
        except subprocess.TimeoutExpired:
            gateway.kill()
            gateway.wait()
        await _clean(nats_url, redis_url, tag)


@dataclass(frozen=True, slots=True)
class Window:
    """The measured span: its wall-clock start and end, and its length in seconds."""

    started_at: float
    ended_at: float
    seconds: float


async def measure_while(
    inject: Coroutine[Any, Any, T],
    warmup: float,
    seconds: float,
    measuring: asyncio.Event,
    stop: asyncio.Event,
) -> tuple[T, Window]:
    """Run ``inject`` for ``warmup`` seconds unmeasured, then ``seconds`` with ``measuring``
    set; then set ``stop`` (``inject`` ends on it) and return what it returned and the window."""
    task = asyncio.create_task(inject)
    try:
        await asyncio.sleep(warmup)
        measuring.set()
        started_at, started = time.time(), time.monotonic()
        await asyncio.sleep(seconds)
        measuring.clear()
        window = Window(started_at, time.time(), time.monotonic() - started)
        stop.set()
        return await task, window
    finally:
        stop.set()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def watch_and_inject(
    viewers: list[Coroutine[Any, Any, None]],
    nats_url: str,
    attached: Awaitable[Any],
    inject: Callable[[NatsClient], Coroutine[Any, Any, T]],
    warmup: float,
    seconds: float,
    measuring: asyncio.Event,
    stop: asyncio.Event,
) -> tuple[T, Window]:
    """The viewers running; once ``attached``, ``inject`` publishing on NATS through the
    measured window (:func:`measure_while`); then the viewers cancelled and NATS closed."""
    import nats

    tasks = [asyncio.create_task(viewer) for viewer in viewers]
    nc = await nats.connect(nats_url, **nats_tls_kwargs(nats_url, tls_from_env()))
    try:
        await attached
        return await measure_while(inject(nc), warmup, seconds, measuring, stop)
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await nc.close()


async def paced(
    period: float,
    sessions: int,
    stop: asyncio.Event,
    publish: Callable[[int, int], Awaitable[None]],
) -> int:
    """Call ``publish(i, seq)`` once per session per ``period`` (session ``i``, its next
    ``seq``), the sessions spread evenly over the period, until ``stop``; returns the calls."""
    seqs = [0] * sessions
    start, step, turn = time.monotonic(), period / sessions, 0
    while not stop.is_set():
        delay = start + turn * step - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        i = turn % sessions
        await publish(i, seqs[i])
        seqs[i] += 1
        turn += 1
    return turn


def _start_gateway(nats_url: str, redis_url: str, tag: str, port: int) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "TURBOSERVE_NATS_URL": nats_url,
        "TURBOSERVE_REDIS_URL": redis_url,
        "TURBOSERVE_SUBJECT_PREFIX": tag,
        "TURBOSERVE_REDIS_NAMESPACE": tag,
        "TURBOSERVE_PORT": str(port),
        "TURBOSERVE_API_KEYS": f"bench:{API_KEY}",
        "TURBOSERVE_LOG_LEVEL": "warning",
        "TURBOSERVE_RATE_PER_KEY_S": "100000",
        "TURBOSERVE_RATE_BURST": "100000",
        "TURBOSERVE_MAX_SESSIONS_PER_KEY": "100000",
        "TURBOSERVE_IDLE_AFTER_S": "3600",
        "TURBOSERVE_READY_WITHOUT_WORKERS": "true",  # no worker: the bench publishes the chunks
    }
    return subprocess.Popen(
        [sys.executable, "-m", "tools.cli", "gateway"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def _wait_ready(http: aiohttp.ClientSession, gateway: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if gateway.poll() is not None:
            raise BenchError(f"the gateway exited with code {gateway.returncode}")
        with contextlib.suppress(OSError):
            async with http.get("/readyz") as resp:
                if resp.status == 200:
                    return
        await asyncio.sleep(0.2)
    raise BenchError("the gateway was not ready within 60 s")


async def _measure(
    plan: DeliveryPlan, nats_url: str, redis_url: str, tag: str, port: int, url: str, pid: int
) -> dict[str, Any]:
    import aiohttp

    async with aiohttp.ClientSession(url) as http:
        sessions = await _create_sessions(http, plan.sessions, redis_url, tag)
    tally = Tally(plan.clients)
    measuring = asyncio.Event()
    stop = asyncio.Event()
    opening = asyncio.Semaphore(OPENING_AT_ONCE)
    clients = [
        _client(port, sessions[i % len(sessions)], tally, measuring, stop, opening, plan.fmt)
        for i in range(plan.clients)
    ]
    encoded = await asyncio.to_thread(fragments, plan)
    cpu = CpuWindow(pid, measuring)
    (chunks, event_bytes), window = await watch_and_inject(
        clients,
        nats_url,
        asyncio.wait_for(tally.all_open.wait(), timeout=120),  # or failed
        lambda nc: _inject(nc, tag, plan, [s for s, _ in sessions], stop, encoded, cpu),
        plan.warmup,
        plan.seconds,
        measuring,
        stop,
    )
    if tally.errors:
        raise BenchError(f"{len(tally.errors)} clients failed, e.g. {tally.errors[0]}")
    if not tally.latencies_ms:
        raise BenchError("no chunk reached a client")
    lat = tally.latencies_ms
    total_time = plan.warmup + plan.seconds
    return {
        "tls": plan.tls,
        "clients": plan.clients,
        "delivery_ms_p50": round(statistics.median(lat), 2),
        "delivery_ms_p99": round(quantile(lat, 0.99), 2),
        "delivery_ms_max": round(max(lat), 2),
        "sessions": plan.sessions,
        "period_s": plan.period,
        "frames": plan.frames,
        "size": f"{plan.width}x{plan.height}",
        "events": len(lat),
        "events_per_s": round(len(lat) / window.seconds, 1),
        "format": plan.fmt,
        "gateway_cpu_ms_per_s_per_client": (
            None
            if cpu.seconds is None
            else round(1000 * cpu.seconds / window.seconds / plan.clients, 4)
        ),
        "gateway_cpu_share": (
            None if cpu.seconds is None else round(cpu.seconds / window.seconds, 3)
        ),
        "chunks_per_s": round(chunks / total_time, 1),
        "event_kib": round(event_bytes / 1024, 1),
        "lags": tally.lags,
        "seconds": plan.seconds,
    }


async def _create_sessions(
    http: aiohttp.ClientSession, n: int, redis_url: str, tag: str
) -> list[tuple[str, str]]:
    """``n`` sessions, each claimed in the registry for the stand-in worker (``bench``, epoch
    1) as a scheduler would: the gateway relays only the chunks of a session's owner."""
    sessions = await _new_sessions(http, n)
    await _claim_for_bench([sid for sid, _ in sessions], redis_url, tag)
    return sessions


async def _claim_for_bench(session_ids: list[str], redis_url: str, tag: str) -> None:
    import redis.asyncio as aioredis

    from shared.registry import Registry

    client = aioredis.from_url(redis_url, **redis_tls_kwargs(redis_url, tls_from_env()))
    try:
        registry = Registry(client, tag)
        for sid in session_ids:
            await registry.claim(sid, "bench", 0)
    finally:
        await client.aclose()


async def _new_sessions(http: aiohttp.ClientSession, n: int) -> list[tuple[str, str]]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    gate = asyncio.Semaphore(16)

    async def one(i: int) -> tuple[str, str]:
        async with (
            gate,
            http.post("/v1/sessions", json={"prompt": f"bench {i}"}, headers=headers) as resp,
        ):
            if resp.status != 201:
                raise BenchError(f"creating a session: HTTP {resp.status} {await resp.text()}")
            body = await resp.json()
            return body["id"], body["token"]

    return list(await asyncio.gather(*(one(i) for i in range(n))))


class _SseClient(asyncio.Protocol):
    """One SSE client as a bare protocol (no stream reader, no HTTP library): the cheapest
    reader, so that the latency measured is the gateway's, not the client's. Each event is
    timed when the bytes that complete it arrive."""

    def __init__(
        self,
        request: bytes,
        tally: Tally,
        measuring: asyncio.Event,
        stop: asyncio.Event,
        opened: asyncio.Future[None],
    ) -> None:
        self.request = request
        self.tally = tally
        self.measuring = measuring
        self.stop = stop
        self.opened = opened
        self.buf = bytearray()
        self.events = SseParser()
        self.head: bytes | None = None
        self.chunked = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        received = time.time()
        self.buf += data
        if self.head is None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            self.head = bytes(self.buf[:end])
            del self.buf[: end + 4]
            if not self.head.startswith(b"HTTP/1.1 200"):
                self._fail(self.head.split(b"\r\n", 1)[0].decode(errors="replace"))
                return
            self.chunked = b"transfer-encoding: chunked" in self.head.lower()
        body = bytearray()
        if self.chunked:  # undo the HTTP/1.1 chunked framing
            while (eol := self.buf.find(b"\r\n")) >= 0:
                size = int(self.buf[:eol], 16)
                if len(self.buf) < eol + size + 4:
                    break
                body += self.buf[eol + 2 : eol + 2 + size]
                del self.buf[: eol + size + 4]
        else:
            body += self.buf
            self.buf.clear()
        for event in self.events.feed(bytes(body)):
            self._on_event(event, received)

    def _on_event(self, event: SseEvent, received: float) -> None:
        if event.retry_ms is not None:  # the first thing sent: the viewer is attached
            if not self.opened.done():
                self.opened.set_result(None)
        elif event.event == "chunk":
            # The publish time found in the bytes, not a JSON parse: the reader stays cheap.
            m = DONE_AT.search(event.data)
            if m and self.measuring.is_set():
                self.tally.latencies_ms.append((received - float(m[1])) * 1000.0)
        elif event.event == "lag":
            self.tally.lags += 1
        elif event.event == "end":
            self.tally.ends += 1

    def _fail(self, why: str) -> None:
        self.tally.errors.append(why)
        if not self.opened.done():
            self.opened.set_result(None)
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.stop.is_set():
            self._fail(f"connection lost: {exc!r}")


async def _client(
    port: int,
    session: tuple[str, str],
    tally: Tally,
    measuring: asyncio.Event,
    stop: asyncio.Event,
    opening: asyncio.Semaphore,
    fmt: str = "jpeg",
) -> None:
    """Connect one client (a few at a time, as users arrive) and hold it until ``stop``."""
    session_id, token = session
    request = (
        f"GET /v1/sessions/{session_id}/stream?format={fmt} HTTP/1.1\r\nHost: bench\r\n"
        f"Authorization: Bearer {token}\r\nAccept: text/event-stream\r\n\r\n"
    ).encode()
    loop = asyncio.get_running_loop()
    opened: asyncio.Future[None] = loop.create_future()
    transport = None
    try:
        async with opening:
            try:
                transport, _ = await loop.create_connection(
                    lambda: _SseClient(request, tally, measuring, stop, opened), "127.0.0.1", port
                )
                await asyncio.wait_for(opened, timeout=60)
            except (OSError, TimeoutError) as exc:
                tally.errors.append(f"open: {exc!r}")
            finally:
                tally.note_open()
        await stop.wait()
    finally:
        if transport is not None:
            transport.close()


class CpuWindow:
    """The gateway process's CPU time over the measured window: read when ``measuring`` turns
    on, and again when the injector sees it off."""

    def __init__(self, pid: int, measuring: asyncio.Event) -> None:
        self.pid = pid
        self.measuring = measuring
        self._start: float | None = None
        self.seconds: float | None = None

    def tick(self) -> None:
        if self.measuring.is_set() and self._start is None:
            self._start = process_cpu_s(self.pid)
        elif not self.measuring.is_set() and self._start is not None and self.seconds is None:
            end = process_cpu_s(self.pid)
            self.seconds = None if end is None else end - self._start


async def _inject(
    nc: NatsClient,
    tag: str,
    plan: DeliveryPlan,
    session_ids: list[str],
    stop: asyncio.Event,
    encoded: list[Any],
    cpu: CpuWindow,
) -> tuple[int, int]:
    """Publish one chunk per session per period, the sessions spread evenly over the period.
    Returns the chunks published and the size of one SSE chunk event."""
    from services.gateway.chunkview import ChunkView
    from services.gateway.jpegs import JpegFrames, fragment_jpegs
    from services.gateway.sse import fragment_event, jpeg_event
    from shared.wire import Subjects, decode, encode

    subjects = Subjects(tag)
    # The fragments' JSON is made once: a worker encodes each chunk once too, and the
    # injector should spend its time publishing, not encoding the same bytes again.
    raw = [msgspec.Raw(msgspec.json.encode(f.data)) for f in encoded]
    event_bytes = 0

    async def publish(i: int, seq: int) -> None:
        nonlocal event_bytes
        cpu.tick()
        now = time.time()
        fragment = encoded[seq % len(encoded)]
        chunk = ChunkView(
            session_id=session_ids[i],
            seq=seq,
            worker_id="bench",
            epoch=1,
            width=plan.width,
            height=plan.height,
            fps=plan.frames / plan.period,
            gen_ms=0.0,
            batch=1,
            due_at=now,
            done_at=now,
            fmp4=raw[seq % len(raw)],
            fmp4_mime=fragment.mime,
            start_s=fragment.start_s,
            duration_s=fragment.duration_s,
        )
        data = encode(chunk)  # the wire's Chunk, byte for byte
        await nc.publish(subjects.chunks(session_ids[i]), data)
        if not event_bytes:
            view = decode("bench", data, ChunkView)
            if plan.fmt == "fmp4":
                event_bytes = len(fragment_event(view))
            else:
                jpegs = JpegFrames(fragment_jpegs(fragment.data, 80))
                event_bytes = len(jpeg_event(view, jpegs))

    published = await paced(plan.period, len(session_ids), stop, publish)
    cpu.tick()
    await nc.flush()
    return published, event_bytes


async def _clean(nats_url: str, redis_url: str, tag: str) -> None:
    import nats
    import redis.asyncio as aioredis

    from shared.wire import Subjects

    with contextlib.suppress(Exception):
        nc = await nats.connect(nats_url, **nats_tls_kwargs(nats_url, tls_from_env()))
        js = nc.jetstream()
        subjects = Subjects(tag)
        for stream in (subjects.sessions_stream, subjects.chunks_stream):
            with contextlib.suppress(Exception):
                await js.delete_stream(stream)
        await nc.close()
    with contextlib.suppress(Exception):
        client = aioredis.from_url(redis_url, **redis_tls_kwargs(redis_url, tls_from_env()))
        keys = [k async for k in client.scan_iter(match=f"{tag}:*", count=1000)]
        for i in range(0, len(keys), 500):
            await client.delete(*keys[i : i + 500])
        await client.aclose()
