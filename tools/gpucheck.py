"""``turboserve gpu-check [--device cuda|cpu] [--preset P] --out DIR``: the GPU path, measured
in one go, for a machine lent for a few minutes.

Eight steps, in order of value, each in a process of its own (a step that runs out of memory,
hangs or crashes takes nothing else with it) under its own time limit:

1. ``bench``: ``bench worker`` at the check's batches, with the real VAE and umT5-XXL geometry
   (random weights, ``tools/bench/random_wan.py``): pass, chunk and decode ms; memory after
   init and at peak; K at the 0.75 s period;
2. ``vae``: the VAE's decode alone per batch, and its encode of a video session's input chunk:
   ms and peak memory, out-of-memory caught;
3. ``sdpa``: attention at the model's real lengths, unmasked (flash) against masked;
4. ``umt5``: how much ``pass_ms`` grows while umT5 encodes, on the default stream and on its own;
5. ``handoff``: a session's state between two worker processes (CUDA IPC on one GPU, NCCL with
   two, gloo on the CPU) at a few sizes and one real session, against a copy on the device;
6. ``up``: a gateway, the scheduler and one worker (``bench pacing``) with sessions at their
   playback pace: on-time share and first chunk;
7. ``encode``: JPEG and x264 per chunk at the check's resolution;
8. ``profile``: the latency profile of step 1's figures, loaded by the scheduler's loader.

DIR gets ``gpu-check.json`` (``steps``: one entry per step, ``name``, ``ok``, ``seconds`` and
the step's figures, or ``skipped`` and why, or ``error``), ``gpu-check.md`` (the same as a
table), each step's own JSON under ``steps/``, ``bench-worker.json`` and the profile. Exits 1
when a step fails. On the CPU (``--device cpu --preset tiny``) every step runs shrunk: the CI's
dry run.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIB = 1 << 20
PERIOD_MS = 750.0  # the playback period the K is given at (12 frames at 16 fps)


@dataclass(frozen=True, slots=True)
class Options:
    device: str
    preset: str
    resolution: tuple[int, int] | None  # None: the preset's
    out: Path
    batches: list[int]
    chunks: int  # timed chunks per batch in the bench
    sessions: int  # the umT5 and up steps' sessions
    up_window_s: float
    handoff_mib: list[float]
    limit_scale: float

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    run: Callable[[Options], dict[str, Any]]
    limit_cuda_s: float
    limit_cpu_s: float
    what: str

    def limit_s(self, options: Options) -> float:
        base = self.limit_cuda_s if options.cuda else self.limit_cpu_s
        return base * options.limit_scale


class Skipped(Exception):
    """A step that cannot run here; says why (the check still passes)."""


# -- the steps (each runs in a child process: ``gpu-check --step NAME``) -------------------------
def _dtype(options: Options) -> Any:
    import torch

    return torch.bfloat16 if options.cuda else torch.float32


def _model(options: Options) -> Any:
    import torch

    from tools.bench.random_wan import random_wan

    return random_wan(
        options.preset,
        options.resolution,
        torch.device(options.device),
        _dtype(options),
        options.out,
    )


def step_bench(options: Options) -> dict[str, Any]:
    from services.gpu_worker.engine import MemoryBudgetExceeded
    from services.gpu_worker.engine.memory import plan
    from tools.bench.worker import build_profile, run_benchmark

    batches, refused = list(options.batches), None
    resolution = "x".join(map(str, options.resolution)) if options.resolution else None
    while True:
        try:
            report = run_benchmark(
                preset=options.preset,
                batches=batches,
                device=options.device,
                chunks=options.chunks,
                warmup=None if options.cuda else 1,  # the CPU's figures are not the point
                resolution=resolution,
                loaded=_model(options),
            )
            break
        except MemoryBudgetExceeded as exc:  # the budget's own verdict is a figure too
            fits = plan(exc.budget, None, max(batches)).sessions  # raises if not even one
            refused = str(exc)
            fewer = [b for b in batches if b <= fits] or [1]
            if fewer == batches:
                raise
            batches = fewer
            _free(options)
    (options.out / "bench-worker.json").write_text(json.dumps(report, indent=2) + "\n")
    # K: the most sessions whose chunk meets the period (0 where not even one does).
    table = build_profile(report, deadline_ms=PERIOD_MS)["chunk_ms"]
    k = max((batch for batch, ms in enumerate(table, 1) if ms <= PERIOD_MS), default=0)
    return {
        "batches": [
            {
                "batch": row["batch"],
                "pass_ms": row["pass_ms_p50"],
                "chunk_ms": row["chunk_ms_p50"],
                "decode_ms": row["decode_ms_p50"],
            }
            for row in report["results"]
        ],
        "memory_after_init_bytes": report.get("init_allocated_bytes"),
        "memory_peak_bytes": report.get("peak_allocated_bytes"),
        "slot_bytes": report["state_bytes"],
        "k_at_period": k,
        "period_ms": PERIOD_MS,
        "memory_budget_refused": refused,
        "text_encoder": report["text_encoder"],
        "decoder": report["decoder"],
    }


def step_vae(options: Options) -> dict[str, Any]:
    import torch

    from services.gpu_worker.model.vae import WanVaeEncoder
    from tools.bench.random_wan import preset_config, random_vae

    config = preset_config(options.preset, options.resolution)
    device = torch.device(options.device)
    decoder = random_vae(config, device, _dtype(options))
    rows: list[dict[str, Any]] = []
    for batch in options.batches:
        shape = (batch, config.out_dim, config.chunk_frames)
        latents = torch.randn(*shape, config.latent_height, config.latent_width, device=device)
        state = torch.zeros(batch, decoder.state_numel, device=device, dtype=_dtype(options))
        try:
            run = functools.partial(decoder.decode, latents, state, False)
            times, peak = _time(run, device, 3 if options.cuda else 1)
            rows.append({"batch": batch, "ms": times, "max_memory_allocated": peak})
        except torch.OutOfMemoryError as exc:
            rows.append({"batch": batch, "oom": str(exc).splitlines()[0]})
        del latents, state
        if device.type == "cuda":
            torch.cuda.empty_cache()
    # The encoder of a video session's input chunks (4 frames per latent frame, after the
    # first chunk), on camera-like random pixels.
    encoder = WanVaeEncoder(decoder.vae, (config.height, config.width), config.chunk_frames)
    encodes: list[dict[str, Any]] = []
    for batch in options.batches:
        frames_shape = (batch, encoder.input_frames(False), config.height, config.width, 3)
        frames = torch.randint(0, 256, frames_shape, dtype=torch.uint8, device=device)
        state = torch.zeros(batch, encoder.state_numel, device=device, dtype=_dtype(options))
        try:
            run = functools.partial(encoder.encode, frames, state, False)
            times, peak = _time(run, device, 3 if options.cuda else 1)
            encodes.append({"batch": batch, "ms": times, "max_memory_allocated": peak})
        except torch.OutOfMemoryError as exc:
            encodes.append({"batch": batch, "oom": str(exc).splitlines()[0]})
        del frames, state
        if device.type == "cuda":
            torch.cuda.empty_cache()
    item = _dtype(options).itemsize
    return {
        "decodes": rows,
        "state_bytes": decoder.state_numel * item,
        "encodes": encodes,
        "encoder_state_bytes": encoder.state_numel * item,
    }


def _time(run: Callable[[], Any], device: Any, repeats: int) -> tuple[float, int | None]:
    """Median ms of ``run`` (after a warm-up) and its peak allocation beyond what it started
    with (CUDA only)."""
    import torch

    with torch.inference_mode():
        run()  # warm
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            run()
            _sync(device)
            times.append((time.perf_counter() - started) * 1000.0)
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
    return round(statistics.median(times), 3), peak


def _free(options: Options) -> None:
    """Give back what a model built before holds (a retry builds it again)."""
    import gc

    import torch

    gc.collect()
    if options.cuda:
        torch.cuda.empty_cache()


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_sdpa(options: Options) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tools.bench.random_wan import preset_config

    config = preset_config(options.preset, options.resolution)
    device, dtype = torch.device(options.device), _dtype(options)
    batch = max(options.batches)
    heads, dim = config.num_heads, config.head_dim
    q_len = config.chunk_tokens
    k_len = config.cache_frames * config.tokens_per_frame
    q = torch.randn(batch, heads, q_len, dim, device=device, dtype=dtype)
    k = torch.randn(batch, heads, k_len, dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    mask = torch.ones(batch, 1, 1, k_len, dtype=torch.bool, device=device)
    mask[..., k_len // 3 : 2 * k_len // 3] = False  # a window not yet full

    def timed(fn: Callable[[], Any]) -> float:
        fn()
        _sync(device)
        times = []
        for _ in range(5):
            started = time.perf_counter()
            fn()
            _sync(device)
            times.append((time.perf_counter() - started) * 1000.0)
        return round(statistics.median(times), 3)

    with torch.inference_mode():
        unmasked = timed(lambda: F.scaled_dot_product_attention(q, k, v))
        masked = timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        flash: str | float = "not on the CPU"
        if device.type == "cuda":
            try:
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    flash = timed(lambda: F.scaled_dot_product_attention(q, k, v))
            except RuntimeError as exc:
                flash = f"refused: {str(exc).splitlines()[0]}"
    return {
        "batch": batch,
        "heads": heads,
        "head_dim": dim,
        "q_tokens": q_len,
        "k_tokens": k_len,
        "unmasked_ms": unmasked,
        "flash_ms": flash,
        "masked_ms": masked,
        "masked_over_unmasked": round(masked / unmasked, 3) if unmasked else None,
    }


def step_umt5(options: Options) -> dict[str, Any]:
    from services.gpu_worker.engine import Engine, EngineConfig, next_chunks
    from services.gpu_worker.model.text import UMT5TextEncoder

    loaded = _model(options)
    engine = Engine(
        EngineConfig(preset=options.preset, device=options.device, max_sessions=options.sessions),
        loaded,
    )
    for i in range(options.sessions):
        engine.add_session(f"s{i}", f"a red fox running through snow {i}", i)
    next_chunks(engine)  # warm, prompts in
    text = engine.text_encoder
    assert isinstance(text, UMT5TextEncoder)  # random_wan's
    passes = (3 if options.cuda else 1) * engine.passes_per_chunk

    def pass_ms(own_stream: bool | None) -> float:
        stop = threading.Event()

        def encode_forever() -> None:
            n = 0
            while not stop.is_set():
                text.encode(f"a storm at sea with lightning {n}", own_stream=bool(own_stream))
                n += 1

        thread = threading.Thread(target=encode_forever, daemon=True)
        if own_stream is not None:
            thread.start()
            time.sleep(0.05)
        times = []
        for _ in range(passes):
            started = time.perf_counter()
            engine.pass_step()
            times.append((time.perf_counter() - started) * 1000.0)
        stop.set()
        if own_stream is not None:
            thread.join(60)
        return round(statistics.median(times), 3)

    alone = pass_ms(None)
    default = pass_ms(False)
    own = pass_ms(True)
    return {
        "sessions": options.sessions,
        "pass_ms_alone": alone,
        "pass_ms_umt5_default_stream": default,
        "pass_ms_umt5_own_stream": own,
        "growth_default_stream_pct": round(100.0 * (default / alone - 1.0), 1),
        "growth_own_stream_pct": round(100.0 * (own / alone - 1.0), 1),
        "streams": "CUDA" if options.cuda else "none on the CPU: both run alike (threads only)",
        "text_encoder": text.name,
    }


def step_handoff(options: Options) -> dict[str, Any]:
    import asyncio

    import torch

    from tools.bench.migration import run_benchmark

    session_mib = round(_session_bytes(options) / MIB, 3)
    sizes = [*options.handoff_mib, session_mib]
    if options.cuda:
        devices, transport = [options.device, options.device], "cuda_ipc"
    else:
        devices, transport = ["cpu", "cpu"], "gloo"  # the CPU's own path (no IPC without CUDA)
    repeats = 3 if options.cuda else 1
    report = asyncio.run(run_benchmark(sizes, devices, repeats, 31, transport, False))
    device = torch.device(options.device)
    copies = {f"{mib:g}": _copy_gbps(int(mib * MIB), device) for mib in sizes}
    two_gpus = options.cuda and torch.cuda.device_count() >= 2
    return {
        "transport": report["transport"],
        "session_mib": session_mib,
        "results": [
            {
                "mib": mib,
                "transfer_ms": row.get("transfer_ms_p50"),
                "handoff_ms": row.get("handoff_ms_p50"),
                "gbps": row.get("transfer_gbps"),
                "device_copy_gbps": copies[f"{mib:g}"],
            }
            for mib, row in zip(sizes, report["results"], strict=True)
        ],
        "first_use_ms": report["first_use_ms"],
        "nccl": "not run: run bench migration --devices cuda:0,cuda:1"
        if two_gpus
        else "not run: NCCL needs two GPUs",
    }


def _session_bytes(options: Options) -> int:
    """One session's state for the preset at the check's resolution, with the VAE's cache."""
    import torch

    from services.gpu_worker.engine.slots import SlotPool
    from tools.bench.random_wan import preset_config, random_vae

    config = preset_config(options.preset, options.resolution)
    meta = torch.device("meta")
    numel = random_vae(config, meta, _dtype(options)).state_numel
    return SlotPool(config, 0, meta, _dtype(options), numel).bytes_per_slot


def _copy_gbps(nbytes: int, device: Any) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    times = []
    for _ in range(3):
        started = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - started)
    return round(nbytes / statistics.median(times) / 1e9, 3)


def step_up(options: Options) -> dict[str, Any]:
    import asyncio

    from tools.bench.pacing import measure
    from tools.launcher import Mesh

    args = argparse.Namespace(
        sessions=options.sessions,
        preset=options.preset,
        period=None,
        window=options.up_window_s,
        stagger=0.2,
        newcomers=1,
    )
    mesh = Mesh.from_env(quiet=True)
    try:
        mesh.start_infra()
        result = asyncio.run(measure(mesh.nats_url, mesh.redis_url, args))
    finally:
        mesh.stop()
    return {
        "sessions": options.sessions,
        "window_s": result["window_s"],
        "on_time_share": result["on_time_share"],
        "first_chunk_s": result["first_chunk_s_max"],
        "chunks_per_s_mean": result["chunks_per_s_mean"],
        "playback_chunks_per_s": result["playback_chunks_per_s"],
        "late_ms_p99": result["late_ms_p99"],
        "what": "bench pacing: the gateway, the scheduler and one worker (stand-in VAE and "
        "text encoder) in one process, on the real NATS and Redis",
    }


def step_encode(options: Options) -> dict[str, Any]:
    import numpy as np

    from services.gpu_worker.codec import encode_frames
    from services.gpu_worker.fmp4 import encode_chunk
    from tools.bench.random_wan import preset_config

    config = preset_config(options.preset, options.resolution)
    height, width = config.height, config.width
    count = config.video_frames_per_chunk
    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
    frames = np.empty((count, height, width, 3), dtype=np.uint8)
    for t in range(count):  # a moving gradient with some grain: neither flat nor pure noise
        grain = rng.normal(0.0, 12.0, (height, width, 3))
        frames[t] = np.clip((ramp + 4 * t) % 256 + grain, 0, 255).astype(np.uint8)

    def timed(fn: Callable[[], Any]) -> tuple[float, int]:
        out = fn()
        times = []
        for _ in range(3):
            started = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - started) * 1000.0)
        size = sum(map(len, out)) if isinstance(out, list) else len(out.data)
        return round(statistics.median(times), 3), size

    jpeg_ms, jpeg_bytes = timed(lambda: encode_frames(frames, "jpeg", 80))
    x264_ms, x264_bytes = timed(lambda: encode_chunk(frames, 16.0, 0.0))
    return {
        "resolution": [height, width],
        "frames": count,
        "jpeg_ms": jpeg_ms,
        "jpeg_bytes": jpeg_bytes,
        "x264_ms": x264_ms,
        "x264_bytes": x264_bytes,
    }


def step_profile(options: Options) -> dict[str, Any]:
    from shared.profile import load_profile
    from tools.bench.worker import build_profile

    source = options.out / "bench-worker.json"
    if not source.exists():
        raise RuntimeError(f"no {source.name}: the profile is made from the bench step's figures")
    report = json.loads(source.read_text())
    deadline = None  # a chunk's playback time (0.75 s): the profile a GPU serves by
    if not options.cuda:  # the tiny model on a CPU need not keep pace: twice its slowest chunk
        deadline = 2 * max(row["chunk_ms_p50"] for row in report["results"])
    profile = build_profile(report, deadline_ms=deadline)
    path = options.out / f"profile-{profile['name']}.json"
    path.write_text(json.dumps(profile, indent=2) + "\n")
    loaded = load_profile(path)  # the scheduler's own loader
    return {
        "path": path.name,
        "profile": loaded.name,
        "gpu_kind": loaded.gpu_kind,
        "capacity": loaded.capacity,
        "deadline_ms": loaded.deadline_ms,
        "chunk_ms": list(loaded.chunk_ms_table),
    }


STEPS = (
    Step("bench", step_bench, 140, 45, "bench worker: pass, chunk, decode ms; memory; K"),
    Step("vae", step_vae, 40, 30, "the VAE's decode alone per batch"),
    Step("sdpa", step_sdpa, 20, 15, "attention at the real lengths: flash vs masked"),
    Step("umt5", step_umt5, 60, 30, "pass_ms while umT5 encodes: default vs own stream"),
    Step("handoff", step_handoff, 75, 45, "state between two worker processes vs a device copy"),
    Step("up", step_up, 100, 45, "sessions at their pace on one worker: on time, first chunk"),
    Step("encode", step_encode, 20, 15, "JPEG and x264 per chunk"),
    Step("profile", step_profile, 10, 15, "a measured profile the scheduler loads"),
)
STEP_NAMES = tuple(step.name for step in STEPS)


# -- the runner ---------------------------------------------------------------------------------
def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "gpu-check",
        help="the GPU path measured in one go (8 steps); --device cpu: the dry run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (cuda)")
    parser.add_argument(
        "--preset", default=None, help="model preset (wan-1.3b on cuda, tiny on cpu)"
    )
    parser.add_argument(
        "--resolution", default=None, help="HEIGHTxWIDTH (480x832 on cuda; the preset's on cpu)"
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for the results")
    parser.add_argument("--batch", default=None, help="batch sizes (1,2,4,8 on cuda; 1,2 on cpu)")
    parser.add_argument(
        "--only", default=None, help=f"comma-separated steps to run, of {', '.join(STEP_NAMES)}"
    )
    parser.add_argument(
        "--limit-scale",
        type=float,
        default=1.0,
        help="multiply every step's time limit by this (a slower machine)",
    )
    parser.add_argument(
        "--step", default=None, choices=STEP_NAMES, help="run one step in this process"
    )
    parser.set_defaults(func=run)


def options_of(args: argparse.Namespace) -> Options:
    from shared.settings import parse_resolution

    cuda = args.device.startswith("cuda")
    preset = args.preset or ("wan-1.3b" if cuda else "tiny")
    text = args.resolution or ("480x832" if cuda else None)
    resolution = parse_resolution(text) if text else None
    if text and resolution is None:
        raise ValueError(f"--resolution {text!r}: HEIGHTxWIDTH, multiples of 16")
    batch = args.batch or ("1,2,4,8" if cuda else "1,2")
    batches = sorted({int(b) for b in batch.split(",") if b.strip()})
    if not batches or batches[0] < 1:
        raise ValueError(f"--batch needs sizes >= 1, got {batch!r}")
    if args.limit_scale <= 0:
        raise ValueError(f"--limit-scale must be > 0, got {args.limit_scale}")
    return Options(
        device=args.device,
        preset=preset,
        resolution=resolution,
        out=args.out,
        batches=batches,
        chunks=3 if cuda else 2,
        sessions=4 if cuda else 2,
        up_window_s=60.0 if cuda else 3.0,
        handoff_mib=[64.0, 1024.0] if cuda else [1.0, 4.0],
        limit_scale=args.limit_scale,
    )


def run(args: argparse.Namespace) -> int:
    try:
        options = options_of(args)
    except ValueError as exc:
        from shared.cli import fail

        return fail("gpu-check", str(exc))
    options.out.mkdir(parents=True, exist_ok=True)
    if args.step is not None:
        return _run_step(next(s for s in STEPS if s.name == args.step), options)
    names = [n.strip() for n in args.only.split(",")] if args.only else list(STEP_NAMES)
    unknown = sorted(set(names).difference(STEP_NAMES))
    if unknown:
        from shared.cli import fail

        return fail("gpu-check", f"--only: unknown steps {unknown}; known: {list(STEP_NAMES)}")
    started = time.perf_counter()
    entries = []
    for step in (s for s in STEPS if s.name in names):
        entry = _spawn_step(step, options, args)
        entries.append(entry)
        print(_line(entry), flush=True)
    report = {
        "device": options.device,
        "preset": options.preset,
        "resolution": list(options.resolution) if options.resolution else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "seconds": round(time.perf_counter() - started, 2),
        "steps": entries,
    }
    (options.out / "gpu-check.json").write_text(json.dumps(report, indent=2) + "\n")
    (options.out / "gpu-check.md").write_text(markdown(report))
    ok = all(entry["ok"] for entry in entries)
    print(f"gpu-check: {'ok' if ok else 'FAILED'} in {report['seconds']} s; {options.out}")
    return 0 if ok else 1


def _run_step(step: Step, options: Options) -> int:
    """In the child: run the step, write its figures (or why it was skipped) as JSON."""
    from shared.logging import configure_logging

    configure_logging("warning", "console", service="gpu-check")
    if not options.cuda:  # random weights make subnormals, ~100x slower on x86 (engine.py)
        import torch

        torch.set_flush_denormal(True)
    folder = options.out / "steps"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        figures: dict[str, Any] = step.run(options)
    except Skipped as why:
        figures = {"skipped": str(why)}
    (folder / f"{step.name}.json").write_text(json.dumps(figures, indent=2, default=str) + "\n")
    return 0


def _spawn_step(step: Step, options: Options, args: argparse.Namespace) -> dict[str, Any]:
    """Run one step in a child process under its time limit; its entry in the report."""
    result = options.out / "steps" / f"{step.name}.json"
    result.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "tools.cli", "gpu-check", "--step", step.name]
    argv += ["--device", options.device, "--preset", options.preset, "--out", str(options.out)]
    argv += ["--batch", ",".join(map(str, options.batches))]
    if options.resolution:
        argv += ["--resolution", "x".join(map(str, options.resolution))]
    limit = step.limit_s(options)
    entry: dict[str, Any] = {"name": step.name, "ok": False, "seconds": 0.0, "what": step.what}
    started = time.perf_counter()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=limit, check=False)
    except subprocess.TimeoutExpired:
        entry["error"] = f"timed out after its limit of {limit:g} s"
    else:
        if proc.returncode == 0 and result.exists():
            entry["ok"] = True
            entry.update(json.loads(result.read_text()))
        else:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            entry["error"] = f"exit {proc.returncode}: " + " | ".join(tail)
    entry["seconds"] = round(time.perf_counter() - started, 2)
    entry["limit_s"] = limit
    return entry


def _line(entry: dict[str, Any]) -> str:
    state = "skipped" if "skipped" in entry else "ok" if entry["ok"] else "FAILED"
    detail = entry.get("skipped") or entry.get("error") or ""
    return f"  {entry['name']:<8} {state:<7} {entry['seconds']:>7.2f} s  {detail}".rstrip()


def markdown(report: dict[str, Any]) -> str:
    """The report as a table: one row per step, its figures flattened into one cell."""
    lines = [
        f"# GPU check: {report['device']}, {report['preset']}, {report['date']}",
        "",
        f"Whole check: {report['seconds']} s.",
        "",
        "| step | ok | seconds | figures |",
        "| --- | --- | --- | --- |",
    ]
    for entry in report["steps"]:
        figures = {
            k: v for k, v in entry.items() if k not in ("name", "ok", "seconds", "what", "limit_s")
        }
        state = "skipped" if "skipped" in entry else "yes" if entry["ok"] else "**no**"
        cell = "; ".join(f"{k}: {_short(v)}" for k, v in figures.items()).replace("|", "/")
        lines.append(f"| {entry['name']} | {state} | {entry['seconds']} | {cell} |")
    return "\n".join(lines) + "\n"


def _short(value: Any) -> str:
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return ", ".join("{" + ", ".join(f"{k} {v}" for k, v in row.items()) + "}" for row in value)
    return str(value)
