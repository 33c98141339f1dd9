"""What a WebRTC viewer costs the gateway's CPU, one viewer's work in one process: re-encoded,
each chunk's fragment decoded (:func:`chunktrack.decode_fragment`) and encoded again by aiortc's
own encoders (``vp8``, ``h264``, at aiortc's default bitrates, as a peer without bandwidth
feedback gets them); passed through (``h264-pass``), each chunk's fMP4 fragment demuxed to
Annex B packets (:func:`chunktrack.annexb_packets`; "decode" in the table).

``turboserve bench webrtc-cost [--size 480x832] [--fps 16] [--seconds 6]`` prints,
per content and codec, the CPU milliseconds (process time: every thread the encoder uses) per
second of video and per chunk, what share of one core a viewer takes, and the bitrate sent.
Every viewer of a session pays it again: aiortc encodes per peer (its encoder follows that
peer's bandwidth and keyframe requests).
"""

from __future__ import annotations

import argparse
import time
from fractions import Fraction

import numpy as np
from aiortc.codecs import get_encoder
from aiortc.rtcrtpparameters import RTCRtpCodecParameters

from services.gateway.chunktrack import VIDEO_CLOCK, annexb_packets, decode_fragment
from services.gpu_worker.fmp4 import chunk_start_s, encode_chunk

CODECS = {
    "vp8": RTCRtpCodecParameters(mimeType="video/VP8", clockRate=VIDEO_CLOCK, payloadType=96),
    "h264": RTCRtpCodecParameters(
        mimeType="video/H264",
        clockRate=VIDEO_CLOCK,
        payloadType=102,
        parameters={
            "packetization-mode": "1",
            "level-asymmetry-allowed": "1",
            "profile-level-id": "42e01f",
        },
    ),
}
CHUNK_FRAMES = 12  # 0.75 s at 16 fps, as Wan's chunks


def frames_of(content: str, count: int, height: int, width: int) -> list[np.ndarray]:
    """``textured``: 16-pixel random cells scrolling (hard for an encoder); ``smooth``: a
    gradient with a moving disc (easy)."""
    rng = np.random.default_rng(7)
    out = []
    if content == "textured":
        cells = rng.integers(0, 256, (height // 16, width // 16, 3), dtype=np.uint8)
        field = np.repeat(np.repeat(cells, 16, 0), 16, 1)
        return [np.roll(field, 4 * i, axis=1) for i in range(count)]
    ys, xs = np.mgrid[0:height, 0:width]
    base = np.stack([xs * 255 // width, ys * 255 // height, np.full_like(xs, 128)], -1).astype(
        np.uint8
    )
    for i in range(count):
        frame = base.copy()
        cx, cy = (40 + 8 * i) % width, height // 2
        frame[(xs - cx) ** 2 + (ys - cy) ** 2 < 60**2] = (250, 250, 250)
        out.append(frame)
    return out


def measure_pass_through(
    content: str, height: int, width: int, fps: float, seconds: float
) -> dict[str, float]:
    """An H.264 peer: each chunk's fragment (as the worker makes it) demuxed to Annex B
    packets; aiortc then only packetizes them (not counted: it does so for every codec)."""
    count = max(CHUNK_FRAMES, round(fps * seconds))
    frames = np.stack(frames_of(content, count, height, width))
    period = CHUNK_FRAMES / fps
    fragments = [
        encode_chunk(
            frames[i : i + CHUNK_FRAMES], fps, chunk_start_s(i // CHUNK_FRAMES, period)
        ).data
        for i in range(0, count, CHUNK_FRAMES)
    ]
    started = time.process_time()
    sent = sum(p.size for data in fragments for p in annexb_packets(data))
    cpu_s = time.process_time() - started
    video_s = count / fps
    return {
        "decode_ms_per_s": 1000 * cpu_s / video_s,
        "encode_ms_per_s": 0.0,
        "cpu_ms_per_s": 1000 * cpu_s / video_s,
        "cpu_ms_per_chunk": 1000 * cpu_s / len(fragments),
        "kbit_per_s": 8 * sent / video_s / 1000,
    }


def measure(
    content: str, codec: str, height: int, width: int, fps: float, seconds: float
) -> dict[str, float]:
    if codec == "h264-pass":
        return measure_pass_through(content, height, width, fps, seconds)
    count = max(CHUNK_FRAMES, round(fps * seconds))
    frames_in = np.stack(frames_of(content, count, height, width))
    period = CHUNK_FRAMES / fps
    fragments = [
        encode_chunk(
            frames_in[i : i + CHUNK_FRAMES], fps, chunk_start_s(i // CHUNK_FRAMES, period)
        ).data
        for i in range(0, count, CHUNK_FRAMES)
    ]
    encoder = get_encoder(CODECS[codec])
    tick = round(VIDEO_CLOCK / fps)
    decode_s = encode_s = 0.0
    sent = 0
    for start in range(0, count, CHUNK_FRAMES):
        t0 = time.process_time()
        frames = decode_fragment(fragments[start // CHUNK_FRAMES])
        t1 = time.process_time()
        for i, frame in enumerate(frames):
            frame.pts, frame.time_base = (start + i) * tick, Fraction(1, VIDEO_CLOCK)
            payloads, _ = encoder.encode(frame, False)
            sent += sum(len(p) for p in payloads)
        decode_s += t1 - t0
        encode_s += time.process_time() - t1
    video_s = count / fps
    return {
        "decode_ms_per_s": 1000 * decode_s / video_s,
        "encode_ms_per_s": 1000 * encode_s / video_s,
        "cpu_ms_per_s": 1000 * (decode_s + encode_s) / video_s,
        "cpu_ms_per_chunk": 1000 * (decode_s + encode_s) / (count / CHUNK_FRAMES),
        "kbit_per_s": 8 * sent / video_s / 1000,
    }


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "webrtc-cost",
        help="one WebRTC viewer's CPU cost to the gateway: re-encoded vs passed through",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--size", default="480x832", help="HEIGHTxWIDTH (Wan2.1's: 480x832)")
    p.add_argument("--fps", type=float, default=16.0)
    p.add_argument("--seconds", type=float, default=6.0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shared.cli import fail

    try:
        height, width = (int(v) for v in args.size.split("x"))
    except ValueError:
        return fail("bench webrtc-cost", f"--size must be HEIGHTxWIDTH, got {args.size!r}")
    if height <= 0 or width <= 0 or args.fps <= 0 or args.seconds <= 0:
        return fail("bench webrtc-cost", "--size, --fps and --seconds must be positive")
    print(
        f"one WebRTC viewer, {height}x{width} at {args.fps:g} fps, {CHUNK_FRAMES}-frame chunks; "
        "CPU = process time (all threads)"
    )
    print(
        f"{'content':<9} {'codec':<9} {'decode ms/s':>11} {'encode ms/s':>11} {'CPU ms/s':>9} "
        f"{'ms/chunk':>9} {'% core':>7} {'kbit/s':>7}"
    )
    for content in ("smooth", "textured"):
        for codec in (*CODECS, "h264-pass"):
            m = measure(content, codec, height, width, args.fps, args.seconds)
            print(
                f"{content:<9} {codec:<9} {m['decode_ms_per_s']:>11.1f} {m['encode_ms_per_s']:>11.1f} "
                f"{m['cpu_ms_per_s']:>9.1f} {m['cpu_ms_per_chunk']:>9.1f} "
                f"{m['cpu_ms_per_s'] / 10:>7.1f} {m['kbit_per_s']:>7.0f}"
            )
    return 0
