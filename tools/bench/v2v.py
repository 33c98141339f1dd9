"""``turboserve bench v2v``: video-to-video sessions on one real worker, each fed by a camera
over its WebSocket: input-to-output delay, sessions per worker at the deadline, encoder time.

A gateway, a scheduler and one worker (the stand-in model on the CPU by default; ``--model``
takes a Wan2.1 folder) run in this process on the real NATS and Redis (those at
TURBOSERVE_NATS_URL / TURBOSERVE_REDIS_URL when they answer, else embedded ones). For each
count in ``--sessions``, that many video sessions are created; each gets a WebSocket client
that sends camera frames (a moving test pattern, JPEG at 640x480, ``--fps`` per second, the
capture time in each frame's header) and reads the output chunks (``format=fmp4``). Over the
``--window`` the bench measures:

- **delay**, per output frame: its chunk's arrival at the client minus the capture time of the
  input frame it was made from (output frame ``i`` of a chunk is input frame
  ``input_seq - T + 1 + i``, ``input_seq`` in the chunk's timing, ``T`` its frames), p50 and
  p99. It holds the input chunk's own length (a chunk waits for its last frame), the relay,
  the encode, the denoising passes, the decode and the H.264 encode;
- **on time**: the share of chunks done by their due time (``latency_ms`` 0; a chunk whose
  input came late is due later: the wait counts against the input, not the worker);
- **sessions per worker at the deadline**: the most sessions with at least 99% of chunks on
  time and the playback rate kept;
- **encoder ms per input chunk**, by the batch the worker encoded together (the engine's
  median), and the chunk time.

    turboserve bench v2v --sessions 1,2,4 --json v2v.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import statistics
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from shared.quantiles import quantile
from tools.bench.control import _cleanup, _env, _scheduler, run_on_infra

API_KEY = "bench-key-12345"
HEADER = struct.Struct(">I")
CAMERA = (480, 640)  # height, width of the frames the clients send
ON_TIME = 0.99


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "v2v",
        help="video-to-video sessions on one worker: input-to-output delay, sessions at the "
        "deadline, encoder ms",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--sessions", default="1,2,4", help="comma-separated session counts")
    p.add_argument("--window", type=float, default=15.0, help="seconds measured per count")
    p.add_argument("--fps", type=float, default=16.0, help="camera frames per second")
    p.add_argument("--strength", type=float, default=0.7, help="the sessions' strength")
    p.add_argument("--preset", default="tiny", help="the worker's model preset (no --model)")
    p.add_argument("--model", default=None, help="a Wan2.1 model folder (TURBOSERVE_MODEL)")
    p.add_argument("--resolution", default=None, help="HEIGHTxWIDTH (TURBOSERVE_RESOLUTION)")
    p.add_argument("--json", dest="json_out", default=None, help="also write the results here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shared.cli import fail

    try:
        counts = sorted({int(c) for c in args.sessions.split(",") if c.strip()})
    except ValueError:
        return fail("bench v2v", f"--sessions: integers, got {args.sessions!r}")
    if not counts or counts[0] < 1 or args.window <= 0 or args.fps <= 0:
        return fail("bench v2v", "--sessions >= 1, --window > 0, --fps > 0")
    if not 0.0 <= args.strength <= 1.0:
        return fail("bench v2v", "--strength must be in [0, 1]")
    return run_on_infra(
        "bench v2v",
        lambda nats_url, redis_url: measure(nats_url, redis_url, args, counts),
        format_table,
        args.json_out,
    )


def camera_frames(count: int = 32) -> list[bytes]:
    """``count`` JPEGs of a moving test pattern, at the camera's size."""
    import numpy as np
    from PIL import Image

    height, width = CAMERA
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    out = []
    for t in range(count):
        r = 128 + 100 * np.sin((xs + 9 * t) / 31.0)
        g = 128 + 100 * np.cos((ys - 5 * t) / 43.0)
        b = 128 + 80 * np.sin((xs + ys + 7 * t) / 57.0)
        image = np.stack([r, g, b], axis=-1).clip(0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, format="JPEG", quality=85)
        out.append(buf.getvalue())
    return out


@dataclass
class _Camera:
    """One session's client: what it sent (capture time by seq) and received."""

    sid: str
    token: str
    captured: dict[int, float] = field(default_factory=dict)
    # (arrival, frames, input_seq, latency_ms) per output chunk
    chunks: list[tuple[float, int, int, float]] = field(default_factory=list)


async def _send(ws: Any, camera: _Camera, jpegs: list[bytes], fps: float) -> None:
    from services.gateway.inputs import frame_message

    period = 1.0 / fps
    start = time.monotonic()
    seq = 0
    while True:
        captured = time.time()
        camera.captured[seq] = captured
        await ws.send_bytes(frame_message(seq, captured, jpegs[seq % len(jpegs)]))
        seq += 1
        await asyncio.sleep(max(0.0, start + seq * period - time.monotonic()))


async def _receive(ws: Any, camera: _Camera) -> None:
    import aiohttp

    async for msg in ws:
        if msg.type is aiohttp.WSMsgType.BINARY:
            (size,) = HEADER.unpack_from(msg.data)
            head = orjson.loads(msg.data[HEADER.size : HEADER.size + size])
            frames = round(head["duration_s"] * head["fps"])
            t = head["timing"]
            camera.chunks.append((time.time(), frames, t["input_seq"], t["latency_ms"]))
        elif msg.type is not aiohttp.WSMsgType.TEXT:
            return


async def _session(http: Any, strength: float) -> _Camera:
    async with http.post(
        "/v1/sessions",
        json={"prompt": "a watercolour painting", "input": "video", "strength": strength},
        headers={"Authorization": f"Bearer {API_KEY}"},
    ) as resp:
        body = await resp.json()
        if resp.status != 201:
            raise RuntimeError(f"POST /v1/sessions: {resp.status} {body}")
    return _Camera(body["id"], body["token"])


async def _run_count(
    http: Any, count: int, args: argparse.Namespace, jpegs: list[bytes], period: float
) -> dict[str, Any]:
    cameras = [await _session(http, args.strength) for _ in range(count)]
    tasks: list[asyncio.Task[None]] = []
    sockets = []
    try:
        for camera in cameras:
            ws = await http.ws_connect(
                f"/v1/sessions/{camera.sid}/ws",
                params={"format": "fmp4", "from": "start"},
                headers={"Authorization": f"Bearer {camera.token}"},
                max_msg_size=0,
            )
            sockets.append(ws)
            tasks.append(asyncio.create_task(_receive(ws, camera)))
            tasks.append(asyncio.create_task(_send(ws, camera, jpegs, args.fps)))
        deadline = time.monotonic() + 120
        while any(len(c.chunks) < 3 for c in cameras):  # past the first chunks
            if time.monotonic() > deadline:
                raise RuntimeError("video sessions gave no chunks in 120 s")
            await asyncio.sleep(0.2)
        start = time.time()
        await asyncio.sleep(args.window)
        end = time.time()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for ws in sockets:
            await ws.close()
        for camera in cameras:
            async with http.delete(
                f"/v1/sessions/{camera.sid}", headers={"Authorization": f"Bearer {camera.token}"}
            ):
                pass
    delays, rates, late = [], [], []
    for camera in cameras:
        window = [c for c in camera.chunks if start <= c[0] < end]
        rates.append(len(window) / (end - start))
        for arrival, frames, input_seq, latency_ms in window:
            late.append(latency_ms)
            for i in range(frames):
                captured = camera.captured.get(input_seq - frames + 1 + i)
                if captured is not None:
                    delays.append((arrival - captured) * 1000.0)
    on_time = sum(1 for ms in late if ms <= 0.0) / len(late) if late else 0.0
    playback = 1.0 / period
    return {
        "sessions": count,
        "chunks": len(late),
        "delay_ms_p50": round(quantile(delays, 0.5), 1) if delays else None,
        "delay_ms_p99": round(quantile(delays, 0.99), 1) if delays else None,
        "on_time_share": round(on_time, 4),
        "chunks_per_s_min": round(min(rates), 3),
        "playback_chunks_per_s": round(playback, 3),
        "at_deadline": on_time >= ON_TIME and min(rates) >= 0.95 * playback,
    }


async def measure(
    nats_url: str, redis_url: str, args: argparse.Namespace, counts: list[int]
) -> dict[str, Any]:
    import aiohttp

    from services.gateway.service import GatewayService
    from services.gpu_worker.service import WorkerService
    from shared.runner import running
    from shared.settings import DEFAULT_CHUNK_PERIOD_S, GatewaySettings, WorkerSettings
    from tools.servers import free_port

    env = _env(nats_url, redis_url)
    if args.model:
        env["TURBOSERVE_MODEL"] = args.model
    if args.resolution:
        env["TURBOSERVE_RESOLUTION"] = args.resolution
    port = free_port()
    wsettings = WorkerSettings.from_env(
        env, worker_id="bench-worker", preset=args.preset, max_sessions=max(counts) + 1
    )
    period = wsettings.chunk_period_s or DEFAULT_CHUNK_PERIOD_S
    gsettings = GatewaySettings.from_env(
        {**env, "TURBOSERVE_API_KEYS": f"bench:{API_KEY}"}, port=port
    )
    jpegs = camera_frames()
    rows = []
    worker = WorkerService(wsettings)
    try:
        async with (
            _scheduler(env),
            running(worker, wsettings),
            running(GatewayService(gsettings), gsettings),
            aiohttp.ClientSession(
                f"http://127.0.0.1:{port}", timeout=aiohttp.ClientTimeout(total=None)
            ) as http,
        ):
            for count in counts:
                rows.append(await _run_count(http, count, args, jpegs, period))
                await asyncio.sleep(2 * period)  # the sessions leave before the next count
            assert worker.generation is not None
            engine = worker.generation.engine
            encode_ms = engine.encode_ms_by_batch()
            chunk_ms = engine.chunk_ms_by_batch()
            model = engine.model_config
    finally:
        with contextlib.suppress(Exception):
            await _cleanup(env)
    fitting = [r["sessions"] for r in rows if r["at_deadline"]]
    return {
        "model": args.model or args.preset,
        "resolution": f"{model.height}x{model.width}",
        "period_s": period,
        "fps": args.fps,
        "strength": args.strength,
        "window_s": args.window,
        "rows": rows,
        "sessions_at_deadline": max(fitting) if fitting else 0,
        "encode_ms_by_batch": {str(b): round(ms, 2) for b, ms in encode_ms.items()},
        "encode_ms_per_chunk": round(statistics.fmean(encode_ms.values()), 2)
        if encode_ms
        else None,
        "chunk_ms_by_batch": {str(b): round(ms, 1) for b, ms in chunk_ms.items()},
    }


def format_table(r: dict[str, Any]) -> str:
    from tools.report import markdown_table

    title = (
        f"video-to-video on one worker ({r['model']}, {r['resolution']}), camera {r['fps']} fps, "
        f"strength {r['strength']}, chunk period {r['period_s']} s, {r['window_s']} s per count"
    )
    table = markdown_table(
        ("sessions", "chunks", "delay p50 (ms)", "delay p99 (ms)", "on time", "chunks/s min"),
        [
            (
                row["sessions"],
                row["chunks"],
                row["delay_ms_p50"],
                row["delay_ms_p99"],
                f"{row['on_time_share']:.2%}",
                f"{row['chunks_per_s_min']} / {row['playback_chunks_per_s']}",
            )
            for row in r["rows"]
        ],
        align="rrrrrr",
    )
    encode = ", ".join(f"batch {b}: {ms} ms" for b, ms in r["encode_ms_by_batch"].items()) or "-"
    return (
        f"{title}\n\n{table}\n\nsessions per worker at the deadline (>= {ON_TIME:.0%} on time, "
        f"playback rate kept): {r['sessions_at_deadline']}\nencoder ms per input chunk: {encode}"
    )
