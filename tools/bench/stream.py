"""``turboserve bench stream``: the same chunks as JPEG in SSE, fMP4 in SSE and fMP4 in a
WebSocket: bytes per second per viewer, encode time per chunk, delivery p99, and what a
session puts on NATS.

Three kinds of frames, at ``--size`` WIDTHxHEIGHT (832x480, Wan2.1's, by default):

- ``standin``: the stand-in model's own frames (the ``tiny`` preset at that resolution, on the
  CPU): smooth, the easy case for a video codec;
- ``gradient``: model-like content: smooth colour gradients drifting, with a fine texture on
  them (``tools.bench.gateway.model_like``, the gateway bench's chunks);
- ``textured``: a synthetic sequence the bench makes: a multi-scale texture (2, 8 and 32 pixel
  cells) panning 7 pixels right and 5 down per frame, across chunk boundaries; the hard case.

Per kind, the bench:

1. makes ``--chunks`` chunks of ``--frames`` frames (cycled after that);
2. times each encoding, per chunk, ``--encode-runs`` chunks each, and reports p50 and p99: the
   worker's H.264 (``fmp4.encode_chunk`` at ``TURBOSERVE_VIDEO_BITRATE``; every format's), and
   for JPEG the gateway's decode of the fragment and JPEG encode of its frames
   (``jpegs.fragment_jpegs``, once per chunk for all of a session's JPEG viewers);
3. for each format, starts a gateway process on the real NATS and Redis, creates
   ``--sessions`` sessions, attaches ``--viewers`` clients spread over them (bare SSE readers;
   aiohttp WebSockets), publishes one chunk per session per period, as a worker does (the
   fragment alone), and measures, per client, the bytes received per second and the delay
   from each chunk's publish (its ``done_at``) to its receipt.

``nats_bytes_per_s``: what one session puts on NATS (its chunk messages per second), the same
for every format.

WebRTC (``webrtc``): ``--webrtc-viewers`` loopback aiortc peers (default 4: each decodes the
video, on the same CPUs as the gateway) offering H.264, so the worker's H.264 passes through;
:mod:`tools.bench.stream_webrtc` says what its figures are.

    turboserve bench stream --json stream.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from shared.quantiles import quantile
from tools.bench.gateway import BenchError
from tools.bench.stream_plan import Encoded, StreamPlan, chunk_message, inject

if TYPE_CHECKING:
    pass

KINDS = ("standin", "gradient", "textured")
FORMATS = ("jpeg_sse", "fmp4_sse", "fmp4_ws")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "stream",
        help="JPEG in SSE vs fMP4 in SSE and WebSocket vs WebRTC: bytes/s, encode ms, delivery",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--viewers", type=int, default=100, help="clients per format (default 100)")
    p.add_argument("--sessions", type=int, default=4, help="sessions they watch (default 4)")
    p.add_argument(
        "--webrtc-viewers",
        type=int,
        default=4,
        help="aiortc WebRTC viewers (default 4: each decodes, on this machine's CPUs)",
    )
    p.add_argument("--seconds", type=float, default=10.0, help="measured time per format (10)")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured time first (2)")
    p.add_argument("--period", type=float, default=0.75, help="chunk period, s (0.75)")
    p.add_argument("--frames", type=int, default=12, help="frames per chunk (12)")
    p.add_argument("--size", default="832x480", help="WIDTHxHEIGHT (832x480)")
    p.add_argument(
        "--chunks",
        type=int,
        default=4,
        help="distinct chunks per kind (default 4: the stand-in takes seconds each)",
    )
    p.add_argument("--encode-runs", type=int, default=40, help="chunks timed per format (40)")
    p.add_argument("--kinds", default=",".join(KINDS), help="standin,textured (both)")
    p.add_argument(
        "--json",
        dest="json_out",
        default=None,
        metavar="OUT",
        help='write {"frames": {"standin": {...}, "textured": {...}}, ...} here',
    )
    p.set_defaults(func=run)


def plan_of(args: argparse.Namespace) -> StreamPlan:
    m = re.fullmatch(r"(\d+)x(\d+)", args.size)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    faults = []
    if not 1 <= args.viewers <= 2000:
        faults.append("--viewers must be 1-2000")
    if not 1 <= args.webrtc_viewers <= 64:
        faults.append("--webrtc-viewers must be 1-64")
    if not 1 <= args.sessions <= args.viewers:
        faults.append("--sessions must be 1..viewers")
    if not 0 < args.seconds <= 600 or not 0 <= args.warmup <= 60:
        faults.append("--seconds must be in (0, 600] and --warmup in [0, 60]")
    if not 0.05 <= args.period <= 10:
        faults.append("--period must be 0.05-10 s")
    if (
        not 1 <= args.frames <= 64
        or not 1 <= args.chunks <= 64
        or not 1 <= args.encode_runs <= 1000
    ):
        faults.append("--frames must be 1-64, --chunks 1-64, --encode-runs 1-1000")
    if m is None or not (16 <= int(m[1]) <= 3840 and 16 <= int(m[2]) <= 2160):
        faults.append("--size must be WIDTHxHEIGHT, 16-3840 by 16-2160")
    if not kinds or set(kinds) - set(KINDS):
        faults.append(f"--kinds must name some of {', '.join(KINDS)}")
    if faults:
        raise BenchError("; ".join(faults))
    assert m is not None
    return StreamPlan(
        args.viewers,
        args.sessions,
        args.seconds,
        args.warmup,
        args.period,
        args.frames,
        int(m[2]),
        int(m[1]),
        args.chunks,
        args.encode_runs,
        kinds,
        args.webrtc_viewers,
    )


def run(args: argparse.Namespace) -> int:
    from shared.cli import fail

    try:
        plan = plan_of(args)
        result = asyncio.run(bench(plan))
    except BenchError as exc:
        return fail("bench stream", exc)
    print_table(result)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


# -- frames ------------------------------------------------------------------------------------


def textured(plan: StreamPlan) -> list[np.ndarray]:
    """A texture at three scales panning across the picture (continuing across chunks)."""
    rng = np.random.default_rng(0)
    h, w = plan.height, plan.width
    acc = np.zeros((h, w, 3), np.float32)
    for cell, amp in ((2, 0.25), (8, 0.35), (32, 0.4)):
        grid = rng.random((h // cell + 1, w // cell + 1, 3), np.float32)
        acc += amp * np.repeat(np.repeat(grid, cell, 0), cell, 1)[:h, :w]
    texture = (acc * 255).clip(0, 255).astype(np.uint8)
    chunks = []
    for c in range(plan.chunks):
        idx = range(c * plan.frames, (c + 1) * plan.frames)
        chunks.append(np.stack([np.roll(texture, (5 * i, 7 * i), axis=(0, 1)) for i in idx]))
    return chunks


def gradient(plan: StreamPlan) -> list[np.ndarray]:
    """Smooth gradients drifting with a fine texture (continuing across chunks)."""
    from tools.bench.gateway import model_like

    return [
        model_like(plan.width, plan.height, plan.frames, c * plan.frames)
        for c in range(plan.chunks)
    ]


def standin(plan: StreamPlan) -> list[np.ndarray]:
    """The stand-in model's frames at the plan's resolution (one session, on the CPU)."""
    from services.gpu_worker.engine import Engine, EngineConfig, next_chunks

    engine = Engine(
        EngineConfig(
            preset="tiny", device="cpu", max_sessions=1, resolution=(plan.height, plan.width)
        )
    )
    engine.add_session("bench", "a red fox running through snow", 1)
    chunks: list[np.ndarray] = []
    while len(chunks) < plan.chunks:
        for result in next_chunks(engine):
            chunks.append(result.frames.numpy()[: plan.frames])
    return chunks


# -- encoding ----------------------------------------------------------------------------------


def encode_all(chunks: list[np.ndarray], plan: StreamPlan) -> Encoded:
    from services.gateway.jpegs import fragment_jpegs
    from services.gpu_worker.fmp4 import chunk_start_s, encode_chunk
    from shared.settings import GatewaySettings, WorkerSettings

    bitrate = WorkerSettings.from_env().video_bitrate
    quality = GatewaySettings.from_env().jpeg_quality
    out = Encoded()
    fps = plan.frames / plan.period
    for run_ in range(plan.encode_runs):
        frames = chunks[run_ % len(chunks)]
        fragment = encode_chunk(frames, fps, chunk_start_s(run_, plan.period), bitrate=bitrate)
        out.fmp4_ms.append(fragment.encode_ms)
        started = time.perf_counter()
        fragment_jpegs(fragment.data, quality)
        out.jpeg_ms.append((time.perf_counter() - started) * 1000.0)
        if run_ < len(chunks):
            out.fmp4.append(fragment)
    return out


# -- delivery ----------------------------------------------------------------------------------


@dataclass
class ViewerTally:
    """What the viewers of a delivery run received while measuring: each chunk's latency, the
    body bytes, the errors of viewers that broke before the end, and the lag notices."""

    latencies_ms: list[float] = field(default_factory=list)
    bytes_received: int = 0
    errors: list[str] = field(default_factory=list)
    lags: int = 0


def sent_bytes(fmt: str, data: bytes) -> int:
    """What the gateway sends a client for this wire message (its own event code)."""
    from services.gateway.chunkview import ChunkView
    from services.gateway.jpegs import JpegFrames, fragment_jpegs
    from services.gateway.sse import fragment_event, jpeg_event
    from services.gateway.ws import fragment_message
    from shared.wire import decode

    view = decode("bench", data, ChunkView)
    if fmt == "fmp4_ws":
        return len(fragment_message(view))
    if fmt == "fmp4_sse":
        return len(fragment_event(view))
    return len(jpeg_event(view, JpegFrames(fragment_jpegs(view.fragment_bytes(), 80))))


async def deliver(fmt: str, encoded: Encoded, plan: StreamPlan) -> dict[str, Any]:
    """One format's delivery through a gateway process: bytes/s per viewer, delivery p99."""
    from shared.wire import encode

    biggest = max(
        len(encode(chunk_message(fmt, encoded, i, "s" * 32, 0, plan)))
        for i in range(len(encoded.fmp4))
    )
    limit = await _max_payload()
    if biggest > limit and fmt == "webrtc":
        return {
            "bytes_per_s": None,
            "delivery_ms_p99": None,
            "viewers": 0,
            "note": f"a chunk's fragment is {biggest} bytes on the wire, over NATS's "
            f"max_payload ({limit}): no fragment reaches the gateway to pass through",
        }
    if biggest > limit:
        rate = (
            statistics.mean(
                sent_bytes(fmt, encode(chunk_message(fmt, encoded, i, "s" * 32, 0, plan)))
                for i in range(len(encoded.fmp4))
            )
            / plan.period
        )
        return {
            "bytes_per_s": round(rate),
            "delivery_ms_p99": None,
            "viewers": 0,
            "note": f"a chunk is {biggest} bytes on the wire, over NATS's max_payload "
            f"({limit}): not deliverable in one message; bytes/s is what the "
            "gateway would send",
        }
    if fmt == "webrtc":
        from tools.bench.stream_webrtc import deliver_webrtc

        return await deliver_webrtc(encoded, plan)
    return await _through_gateway(fmt, encoded, plan)


async def _max_payload() -> int:
    import nats

    from shared.settings import GatewaySettings

    settings = GatewaySettings.from_env()
    try:
        nc = await nats.connect(settings.nats_url, connect_timeout=5, max_reconnect_attempts=0)
    except Exception as exc:  # noqa: BLE001 - said in one line
        raise BenchError(f"NATS at {settings.nats_url} does not answer: {exc!r}") from None
    try:
        return int(nc.max_payload)
    finally:
        await nc.close()


async def _through_gateway(fmt: str, encoded: Encoded, plan: StreamPlan) -> dict[str, Any]:
    import aiohttp
    import msgspec

    from shared.settings import GatewaySettings
    from shared.wire import Subjects
    from tools.bench.gateway import _create_sessions, gateway_process, watch_and_inject

    settings = GatewaySettings.from_env()
    tally = ViewerTally()
    measuring, stop = asyncio.Event(), asyncio.Event()
    async with gateway_process(settings.nats_url, settings.redis_url, "bstream") as (
        tag,
        port,
        url,
    ):
        async with aiohttp.ClientSession(url) as http:
            sessions = await _create_sessions(http, plan.sessions, settings.redis_url, tag)
            viewers = [
                _viewer(fmt, port, sessions[i % len(sessions)], tally, measuring, stop)
                for i in range(plan.viewers)
            ]
            # Each chunk made once per session, as a worker encodes it once.
            messages = [
                [
                    msgspec.to_builtins(chunk_message(fmt, encoded, c, sid, 0, plan))
                    for c in range(len(encoded.fmp4))
                ]
                for sid, _ in sessions
            ]
            _, window = await watch_and_inject(
                viewers,
                settings.nats_url,
                asyncio.sleep(1.0 + plan.viewers / 50),  # attached
                lambda nc: inject(
                    nc, Subjects(tag), plan, [s for s, _ in sessions], messages, stop
                ),
                plan.warmup,
                plan.seconds,
                measuring,
                stop,
            )
    if tally.errors:
        raise BenchError(f"{fmt}: {len(tally.errors)} viewers failed, e.g. {tally.errors[0]}")
    if not tally.latencies_ms:
        raise BenchError(f"{fmt}: no chunk reached a viewer")
    lat = tally.latencies_ms
    return {
        "bytes_per_s": round(tally.bytes_received / window.seconds / plan.viewers),
        "delivery_ms_p50": round(statistics.median(lat), 2),
        "delivery_ms_p99": round(quantile(lat, 0.99), 2),
        "viewers": plan.viewers,
        "sessions": plan.sessions,
        "chunks_received": len(lat),
        "lags": tally.lags,
    }


async def _viewer(
    fmt: str,
    port: int,
    session: tuple[str, str],
    tally: ViewerTally,
    measuring: asyncio.Event,
    stop: asyncio.Event,
) -> None:
    sid, token = session
    query = "fmp4" if fmt.startswith("fmp4") else "jpeg"
    if fmt.endswith("_ws"):
        await _ws_viewer(port, sid, token, query, tally, measuring, stop)
    else:
        await _sse_viewer(port, sid, token, query, tally, measuring, stop)


async def _sse_viewer(
    port: int,
    sid: str,
    token: str,
    fmt: str,
    tally: ViewerTally,
    measuring: asyncio.Event,
    stop: asyncio.Event,
) -> None:
    """A bare SSE reader (the gateway bench's protocol): the latency measured is the
    gateway's, not an HTTP library's. It counts the body bytes it receives."""
    from tools.bench.gateway import Tally, _SseClient

    class Counting(_SseClient):
        def data_received(self, data: bytes) -> None:
            if measuring.is_set():
                tally.bytes_received += len(data)
            super().data_received(data)

    shared = Tally(1)
    shared.latencies_ms = tally.latencies_ms
    request = (
        f"GET /v1/sessions/{sid}/stream?format={fmt} HTTP/1.1\r\nHost: bench\r\n"
        f"Authorization: Bearer {token}\r\nAccept: text/event-stream\r\n\r\n"
    ).encode()
    loop = asyncio.get_running_loop()
    opened: asyncio.Future[None] = loop.create_future()
    transport, _ = await loop.create_connection(
        lambda: Counting(request, shared, measuring, stop, opened), "127.0.0.1", port
    )
    try:
        await stop.wait()
    finally:
        transport.close()
        tally.errors.extend(shared.errors if not stop.is_set() else [])
        tally.lags += shared.lags


async def _ws_viewer(
    port: int,
    sid: str,
    token: str,
    fmt: str,
    tally: ViewerTally,
    measuring: asyncio.Event,
    stop: asyncio.Event,
) -> None:
    import aiohttp
    import orjson

    url = f"http://127.0.0.1:{port}/v1/sessions/{sid}/ws"
    async with (
        aiohttp.ClientSession() as client,
        client.ws_connect(url, params={"format": fmt, "token": token}, max_msg_size=0) as ws,
    ):
        async for msg in ws:
            received = time.time()
            if msg.type is aiohttp.WSMsgType.BINARY:
                if measuring.is_set():
                    tally.bytes_received += len(msg.data)
                    (n,) = struct.unpack(">I", msg.data[:4])
                    header = orjson.loads(msg.data[4 : 4 + n])
                    tally.latencies_ms.append((received - header["timing"]["done_at"]) * 1000.0)
            elif msg.type is aiohttp.WSMsgType.TEXT:
                if b'"type":"lag"' in msg.data.encode():
                    tally.lags += 1
            else:
                if not stop.is_set():
                    tally.errors.append(f"socket closed: {msg.type}")
                return


# -- the whole bench ---------------------------------------------------------------------------


async def bench(plan: StreamPlan) -> dict[str, Any]:
    from shared.wire import encode

    frames: dict[str, Any] = {}
    for kind in plan.kinds:
        make = {"standin": standin, "gradient": gradient, "textured": textured}[kind]
        chunks = await asyncio.to_thread(make, plan)
        encoded = await asyncio.to_thread(encode_all, chunks, plan)
        side: dict[str, Any] = {
            "nats_bytes_per_s": round(
                statistics.mean(
                    len(encode(chunk_message("fmp4_ws", encoded, i, "s" * 32, 0, plan)))
                    for i in range(len(encoded.fmp4))
                )
                / plan.period
            )
        }
        for fmt in FORMATS:
            times = encoded.jpeg_ms if fmt == "jpeg_sse" else encoded.fmp4_ms
            delivered = await deliver(fmt, encoded, plan)
            side[fmt] = {
                "bytes_per_s": delivered.pop("bytes_per_s"),
                "encode_ms_p50": round(statistics.median(times), 2),
                "encode_ms_p99": round(quantile(times, 0.99), 2),
                "delivery_ms_p99": delivered.pop("delivery_ms_p99"),
                **delivered,
            }
        side["webrtc"] = await webrtc_entry(encoded, plan)
        jpeg_rate, fmp4_rate = side["jpeg_sse"]["bytes_per_s"], side["fmp4_ws"]["bytes_per_s"]
        side["jpeg_over_fmp4_ws_bytes"] = round(jpeg_rate / fmp4_rate, 2) if fmp4_rate else None
        side["encode_p99_over_period"] = round(
            side["fmp4_ws"]["encode_ms_p99"] / (plan.period * 1000), 3
        )
        frames[kind] = side
    return {
        "frames": frames,
        "size": f"{plan.width}x{plan.height}",
        "frames_per_chunk": plan.frames,
        "period_s": plan.period,
        "viewers": plan.viewers,
        "sessions": plan.sessions,
        "seconds": plan.seconds,
        "encode_runs": plan.encode_runs,
        "cpu_count": os.cpu_count(),
        "codec": "H.264 (libx264 via PyAV), fragmented MP4, one keyframe-first fragment per "
        "chunk, capped CRF at TURBOSERVE_VIDEO_BITRATE; JPEG made by the gateway from it",
        "webrtc_viewers": plan.webrtc_viewers,
        "webrtc": (
            f"{plan.webrtc_viewers} loopback aiortc viewers offering H.264 (the worker's "
            "H.264 passed through); bytes/s: RTP payload received per viewer; encode: the "
            "gateway's fragment-to-Annex-B demux per chunk; delivery: NATS publish to the "
            "arrival of the packet completing the chunk's first frame (paced at the "
            "chunk's fps, before decoding)"
        ),
    }


async def webrtc_entry(encoded: Encoded, plan: StreamPlan) -> dict[str, Any]:
    from tools.bench.stream_webrtc import pass_through_ms

    times = await asyncio.to_thread(pass_through_ms, encoded, plan)
    delivered = await deliver("webrtc", encoded, plan)
    return {
        "bytes_per_s": delivered.pop("bytes_per_s"),
        "encode_ms_p50": round(statistics.median(times), 2),
        "encode_ms_p99": round(quantile(times, 0.99), 2),
        "delivery_ms_p99": delivered.pop("delivery_ms_p99"),
        **delivered,
    }


def print_table(result: dict[str, Any]) -> None:
    print(
        f"{result['size']}, {result['frames_per_chunk']} frames per {result['period_s']} s chunk, "
        f"{result['viewers']} viewers over {result['sessions']} sessions "
        f"({result['webrtc_viewers']} for webrtc)"
    )
    print(
        f"{'frames':<9} {'format':<9} {'KiB/s/viewer':>13} {'encode p50':>11} {'encode p99':>11} "
        f"{'delivery p99':>13}"
    )
    for kind, side in result["frames"].items():
        for fmt in (*FORMATS, "webrtc"):
            r = side[fmt]
            delivery = "n/a" if r["delivery_ms_p99"] is None else f"{r['delivery_ms_p99']:.1f} ms"
            rate = "n/a" if r["bytes_per_s"] is None else f"{r['bytes_per_s'] / 1024:.1f}"
            print(
                f"{kind:<9} {fmt:<9} {rate:>13} {r['encode_ms_p50']:>8.1f} ms "
                f"{r['encode_ms_p99']:>8.1f} ms {delivery:>13}"
            )
        for fmt in (*FORMATS, "webrtc"):
            if side[fmt].get("note"):
                print(f"  {kind} {fmt}: {side[fmt]['note']}")
        print(f"{kind:<9} NATS, per session: {side['nats_bytes_per_s'] / 1024:.1f} KiB/s")
    print(f"webrtc: {result['webrtc']}")
