"""``turboserve bench worker``: chunk time and throughput per batch size, state size, suspend
and resume time, and a latency profile the scheduler's latency model reads.

Per batch size it times lockstep chunks (every session in phase: ``passes_per_chunk`` passes of
``Engine.pass_step``, through ``next_chunks``), then single passes with the sessions staggered
across the phases of their chunks, as a serving worker runs them. With ``--steps 4,3,2`` it
also times lockstep chunks at each step count below the full one (the quality budget: ``s``
denoising steps and the cache-write pass), and the profile gets their table (``steps``).

On a GPU: ``turboserve bench worker --preset wan-1.3b --batch 1,2,4,8 --json out.json
--profile-out wan.json`` runs in one short go (bf16 weights and caches, pinned host memory
for suspend/resume, a device sync inside every timed pass).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tools.report import BenchUsageError

DEFAULT_FPS = 16.0  # Wan2.1 generates 16 frames per second of video


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "worker",
        help="benchmark the GPU worker's engine (chunk time per batch size)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", default="tiny", help="model preset (tiny, small, wan-1.3b)")
    parser.add_argument("--batch", default="1,2,4,8", help="comma-separated batch sizes")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--chunks", type=int, default=5, help="timed chunks per batch size")
    parser.add_argument(
        "--steps",
        default=None,
        help="comma-separated denoising step counts to time chunks at, e.g. 4,3,2 "
        "(default: the model's full count only)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed chunks per batch size (default: until every KV window is full, +1)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--checkpoint",
        default=None,
        help="the causal DiT (.pt or safetensors; TURBOSERVE_CHECKPOINT)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="a Wan2.1 model folder: umT5 and the Wan VAE (TURBOSERVE_MODEL)",
    )
    parser.add_argument(
        "--resolution", default=None, help="HEIGHTxWIDTH of a loaded model (default 480x832)"
    )
    parser.add_argument("--json", dest="json_out", default=None, help="write results here")
    parser.add_argument("--profile-out", default=None, help="write a scheduler latency profile")
    parser.add_argument("--gpu-kind", default=None, help="profile gpu_kind (default: device name)")
    parser.add_argument(
        "--deadline-ms",
        type=float,
        default=None,
        help="profile deadline (default: a chunk's playback time at 16 fps)",
    )
    parser.set_defaults(func=run)


def _fail(message: str) -> int:
    from shared.cli import fail

    return fail("bench worker", message)


def _parse_batches(text: str) -> list[int]:
    try:
        batches = sorted({int(b) for b in text.split(",") if b.strip()})
    except ValueError:
        raise BenchUsageError(
            f"--batch must be comma-separated integers >= 1, got {text!r}"
        ) from None
    if not batches or batches[0] < 1:
        raise BenchUsageError(f"--batch needs batch sizes >= 1, got {text!r}")
    return batches


def _parse_steps(text: str | None) -> list[int] | None:
    """``--steps``: step counts, highest first (None: the full count only). Their upper bound,
    the model's full count, is checked once the engine is loaded."""
    if text is None:
        return None
    try:
        counts = sorted({int(s) for s in text.split(",") if s.strip()}, reverse=True)
    except ValueError:
        raise BenchUsageError(
            f"--steps must be comma-separated integers >= 1, got {text!r}"
        ) from None
    if not counts or counts[-1] < 1:
        raise BenchUsageError(f"--steps needs step counts >= 1, got {text!r}")
    return counts


def _check_options(args: argparse.Namespace) -> None:
    """Everything that can be checked before building an engine, with a clear message."""
    from services.gpu_worker.model.config import PRESETS

    if args.preset not in PRESETS:
        raise BenchUsageError(
            f"unknown preset {args.preset!r}; known: {', '.join(sorted(PRESETS))}"
        )
    if args.chunks < 1:
        raise BenchUsageError(f"--chunks must be >= 1, got {args.chunks}")
    if args.warmup is not None and args.warmup < 0:
        raise BenchUsageError(f"--warmup must be >= 0, got {args.warmup}")
    if args.checkpoint is not None:
        path = Path(args.checkpoint)
        if not path.is_file():
            raise BenchUsageError(f"checkpoint {args.checkpoint!r} not found (or not a file)")
    _check_device(args.device)


def _check_device(name: str) -> None:
    import torch

    if name == "auto":
        return
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise BenchUsageError(f"--device must be auto, cpu, cuda or cuda:N, got {name!r}") from None
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise BenchUsageError(f"--device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if not torch.cuda.is_available():
        raise BenchUsageError(
            f"--device {name}: no CUDA GPU is available here (use --device cpu or auto)"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise BenchUsageError(f"--device {name}: only {count} CUDA device(s) are visible")


def run(args: argparse.Namespace) -> int:
    try:
        batches = _parse_batches(args.batch)
        steps = _parse_steps(args.steps)
        _check_options(args)
        report = run_benchmark(
            preset=args.preset,
            batches=batches,
            device=args.device,
            chunks=args.chunks,
            warmup=args.warmup,
            seed=args.seed,
            checkpoint=args.checkpoint,
            model=args.model,
            resolution=args.resolution,
            steps=steps,
        )
    except BenchUsageError as exc:
        return _fail(str(exc))
    print(format_table(report))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    if args.profile_out:
        profile = build_profile(report, gpu_kind=args.gpu_kind, deadline_ms=args.deadline_ms)
        problem = _validate_profile(profile)
        Path(args.profile_out).write_text(json.dumps(profile, indent=2) + "\n")
        print(f"wrote profile {args.profile_out}")
        if problem:
            print(f"warning: the scheduler would reject this profile: {problem}", file=sys.stderr)
            return 1
    return 0


def run_benchmark(
    preset: str,
    batches: list[int],
    device: str = "auto",
    chunks: int = 5,
    warmup: int | None = None,
    seed: int = 0,
    checkpoint: str | None = None,
    model: str | None = None,
    resolution: str | None = None,
    steps: list[int] | None = None,
    loaded: Any = None,
) -> dict[str, Any]:
    """``loaded``: model components built elsewhere (``Engine``'s), e.g. random weights in
    Wan's geometry (``tools/bench/random_wan.py``)."""
    import torch

    from services.gpu_worker import telemetry
    from services.gpu_worker.engine import Engine, EngineConfig, StepFloorAboveFull, next_chunks

    if chunks < 1:
        raise BenchUsageError(f"--chunks must be >= 1, got {chunks}")

    from services.gpu_worker.model.checkpoint import CheckpointMismatch
    from services.gpu_worker.model.folder import ModelFolderError
    from shared.settings import parse_resolution

    size = parse_resolution(resolution) if resolution else None
    if resolution and size is None:
        raise BenchUsageError(f"--resolution {resolution!r}: HEIGHTxWIDTH, multiples of 16")
    try:
        engine = Engine(
            EngineConfig(
                preset=preset,
                device=device,
                max_sessions=max(batches),
                seed=seed,
                checkpoint=checkpoint,
                model=model,
                resolution=size,
                min_steps=min(steps) if steps else None,
            ),
            loaded,
        )
    except StepFloorAboveFull as exc:
        raise BenchUsageError(
            f"--steps {max(steps or [])}: above the model's full count ({exc.full_steps})"
        ) from None
    except (CheckpointMismatch, ModelFolderError) as exc:
        raise BenchUsageError(str(exc)) from None
    except Exception as exc:
        if checkpoint and type(exc).__name__ == "SafetensorError":
            raise BenchUsageError(
                f"checkpoint {checkpoint!r} is not a safetensors file: {exc}"
            ) from None
        raise
    init_allocated = (
        torch.cuda.memory_allocated(engine.torch_device)
        if engine.torch_device.type == "cuda"
        else None
    )
    print(
        f"# {telemetry.describe(engine.torch_device)}; model {engine.model_config.name}; "
        f"dtype {engine.dtype}"
    )
    full = engine.full_steps
    if steps is not None and steps[0] > full:
        raise BenchUsageError(f"--steps {steps[0]}: above the model's full count ({full})")
    reduced = [s for s in steps or [] if s < full]
    if warmup is None:
        # Time the steady state: every session's window full, so attention runs unmasked.
        warmup = engine.fill_chunks + 1
    results: list[dict[str, Any]] = []
    for batch in batches:
        _set_batch(engine, batch)
        for _ in range(warmup):
            next_chunks(engine)
        engine.forget_decode_times()
        times = []
        for _ in range(chunks):  # the wall time of one chunk of every session, in phase
            started = time.perf_counter()
            next_chunks(engine)
            times.append((time.perf_counter() - started) * 1000.0)
        p50 = statistics.median(times)
        decode = engine.decode_ms_by_batch()[batch]  # the decodes of these very chunks
        pass_times, pass_chunks = _time_passes(engine, batch, chunks)
        at_steps = _chunk_ms_by_steps(engine, reduced, chunks) if reduced else {}
        results.append(
            {
                "batch": batch,
                "chunk_ms_p50": round(p50, 3),
                "chunk_ms_min": round(min(times), 3),
                "chunk_ms_max": round(max(times), 3),
                "sessions_per_s": round(batch * 1000.0 / p50, 4),
                "pass_ms_p50": round(statistics.median(pass_times), 3),
                "pass_ms_min": round(min(pass_times), 3),
                "pass_ms_max": round(max(pass_times), 3),
                # gen_ms of the chunks made by pass_step: the sum of their passes' times
                "pass_chunk_ms_p50": round(statistics.median(pass_chunks), 3)
                if pass_chunks
                else None,
                # The frame decoder's share of chunk_ms (timed inside those passes), and the rest:
                # the DiT's passes and the sampler.
                "decode_ms_p50": round(decode, 3),
                "dit_ms_p50": round(p50 - decode, 3),
                # The quality budget: lockstep chunk time per step count (full included, timed
                # in turn with the others), and its ratio to the chunk at full steps.
                **(
                    {
                        "steps_chunk_ms_p50": {str(s): round(ms, 3) for s, ms in at_steps.items()},
                        "steps_ratio": {
                            str(s): round(ms / at_steps[full], 4)
                            for s, ms in at_steps.items()
                            if s != full
                        },
                    }
                    if at_steps
                    else {}
                ),
            }
        )
    suspend_ms, resume_ms = _suspend_resume_ms(engine, repeats=max(chunks, 3))
    base = results[0]["sessions_per_s"]
    for row in results:
        row["speedup_vs_first"] = round(row["sessions_per_s"] / base, 3)
    config = engine.model_config
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    if isinstance(engine.decoder, torch.nn.Module):  # the stand-in or the Wan VAE
        weights += sum(p.numel() * p.element_size() for p in engine.decoder.parameters())
    text_ms = _text_encode_ms(engine, repeats=max(chunks, 3))
    report: dict[str, Any] = {
        "preset": engine.model_config.name,
        "device": engine.device,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "state_bytes": engine.state_bytes,
        "results": results,
        "passes_per_chunk": engine.passes_per_chunk,
        "full_steps": full,
        "steps": [full, *reduced],
        "suspend_ms": round(suspend_ms, 3),
        "resume_ms": round(resume_ms, 3),
        "video_frames_per_chunk": config.video_frames_per_chunk,
        "resolution": [config.height, config.width],
        "weights_bytes": weights,
        "params": sum(p.numel() for p in engine.model.parameters()),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "telemetry": engine.telemetry(),
        "model": engine.sources,
        "decoder": engine.decoder.kind,
        "text_encoder": engine.text_encoder.name,
        # One new prompt through the text encoder (off the generation pass in the worker).
        "text_encode_ms": round(text_ms, 3),
        "decoder_state_bytes": engine.pool.decoder_numel * engine.pool.misc.element_size(),
    }
    if engine.torch_device.type == "cuda":
        report["init_allocated_bytes"] = init_allocated
        report["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(engine.torch_device)
    return report


def _text_encode_ms(engine: Any, repeats: int) -> float:
    """Median wall time to encode a prompt the encoder has not seen (no cache)."""
    times = []
    for i in range(repeats):
        prompt = f"bench prompt number {i}: a slow pan over a misty valley at dawn"
        started = time.perf_counter()
        engine.text_encoder.encode(prompt)
        times.append((time.perf_counter() - started) * 1000.0)
    return statistics.median(times)


def _time_passes(engine: Any, batch: int, chunks: int) -> tuple[list[float], list[float]]:
    """Wall times of ``chunks * passes_per_chunk`` passes at ``batch`` sessions spread over
    the phases of their chunks (so the cache-write passes and decodes are spread too), and
    the gen_ms of the chunks completed meanwhile. Leaves every session at a chunk boundary."""
    sessions = engine.active_sessions()
    ppc = engine.passes_per_chunk
    # Stagger: park all but the first, then bring one back per (untimed) pass.
    for session_id in sessions[1:]:
        engine.suspend(session_id)
    for session_id in sessions[1:]:
        engine.pass_step()
        engine.resume(session_id)
    pass_times, chunk_times = [], []
    for _ in range(chunks * ppc):
        started = time.perf_counter()
        results = engine.pass_step()
        pass_times.append((time.perf_counter() - started) * 1000.0)
        chunk_times += [r.gen_ms for r in results if r.batch == batch]
    # Back into lockstep: each session parks at its own chunk boundary, then all come back.
    for session_id in sessions:
        engine.suspend(session_id, wait=True)
    while engine.active_sessions():
        engine.pass_step()
    for session_id in sessions:
        engine.resume(session_id)
    return pass_times, chunk_times


def _chunk_ms_by_steps(engine: Any, reduced: list[int], chunks: int) -> dict[int, float]:
    """Median wall time of a lockstep chunk of every session at the full step count and at
    each of ``reduced`` (``s + 1`` passes each), one chunk of each count in turn, ``chunks``
    rounds, so that a machine whose speed drifts weighs on every count alike. The budget goes
    back to full after."""
    from services.gpu_worker.engine import next_chunks

    counts = [engine.full_steps, *reduced]
    times: dict[int, list[float]] = {s: [] for s in counts}
    try:
        for _ in range(chunks):
            for steps in counts:
                engine.set_step_budget(steps)
                started = time.perf_counter()
                next_chunks(engine)
                times[steps].append((time.perf_counter() - started) * 1000.0)
    finally:
        engine.set_step_budget(engine.full_steps)
    return {s: statistics.median(t) for s, t in times.items()}


def _set_batch(engine: Any, batch: int) -> None:
    active = engine.active_sessions()
    for session_id in active[batch:]:
        engine.remove_session(session_id)
    for i in range(len(active), batch):
        engine.add_session(f"bench-{batch}-{i}", f"a bench prompt number {i}", seed=i)


def _suspend_resume_ms(engine: Any, repeats: int) -> tuple[float, float]:
    """Median time to move one session's state to host memory and back."""
    _set_batch(engine, 1)
    session_id = engine.active_sessions()[0]
    suspends, resumes = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        engine.suspend(session_id)
        suspends.append((time.perf_counter() - started) * 1000.0)
        started = time.perf_counter()
        engine.resume(session_id)
        resumes.append((time.perf_counter() - started) * 1000.0)
    return statistics.median(suspends), statistics.median(resumes)


def format_table(report: dict[str, Any]) -> str:
    from tools.report import markdown_table

    ppc = report.get("passes_per_chunk")
    rows = []
    for row in report["results"]:
        pass_p50 = row.get("pass_ms_p50")
        passes = (f"{pass_p50:.2f}", f"{pass_p50 * ppc:.1f}") if pass_p50 and ppc else ("-", "-")
        parts = (
            (f"{row['dit_ms_p50']:.1f}", f"{row['decode_ms_p50']:.1f}")
            if "decode_ms_p50" in row
            else ("-", "-")
        )
        rows.append(
            (
                row["batch"],
                f"{row['chunk_ms_p50']:.1f}",
                f"{row['chunk_ms_min']:.1f}",
                f"{row['chunk_ms_max']:.1f}",
                f"{row['sessions_per_s']:.2f}",
                f"{row['speedup_vs_first']:.2f}",
                *passes,
                *parts,
            )
        )
    columns = (
        "batch",
        "chunk ms p50",
        "min",
        "max",
        "sessions/s",
        "x first",
        "pass ms p50",
        f"x{ppc or '?'}",
        "DiT ms",
        "decode ms",
    )
    lines = [
        f"worker benchmark: model {report['preset']} on {report['device']} ({report['dtype']}), "
        f"{report['video_frames_per_chunk']} frames/chunk at "
        f"{report['resolution'][0]}x{report['resolution'][1]}",
        "",
        markdown_table(columns, rows, align="r" * len(columns)),
        "",
    ]
    if len(report.get("steps", [])) > 1:
        lines += [_steps_table(report), ""]
    lines.append(
        f"state per session: {report['state_bytes'] / 2**20:.2f} MiB; suspend "
        f"{report['suspend_ms']:.2f} ms, resume {report['resume_ms']:.2f} ms (median)"
    )
    if "text_encode_ms" in report:
        lines.append(
            f"decoder {report['decoder']} (state {report['decoder_state_bytes'] / 2**20:.2f} MiB "
            f"per session); text encoder {report['text_encoder']}: "
            f"{report['text_encode_ms']:.1f} ms per new prompt"
        )
    return "\n".join(lines)


def _steps_table(report: dict[str, Any]) -> str:
    """The quality budget: per batch, a column per step count, with the lockstep chunk time
    and its ratio to the chunk at full steps (the passes alone would give (s + 1) / (full + 1))."""
    from tools.report import markdown_table

    full, *reduced = report["steps"]
    columns = ("batch", f"{full} steps ms", *(f"{s} steps ms (x full)" for s in reduced))
    rows = []
    for row in report["results"]:
        at = row["steps_chunk_ms_p50"]
        cells = [f"{at[str(s)]:.1f} ({row['steps_ratio'][str(s)]:.2f})" for s in reduced]
        rows.append((row["batch"], f"{at[str(full)]:.1f}", *cells))
    passes = ", ".join(f"{s}: {(s + 1) / (full + 1):.2f}" for s in reduced)
    return "\n".join(
        [
            f"chunk time per denoising step count (lockstep chunks, the counts in turn, median; "
            f"the passes alone would give {passes})",
            "",
            markdown_table(columns, rows, align="r" * len(columns)),
        ]
    )


def build_profile(
    report: dict[str, Any], gpu_kind: str | None = None, deadline_ms: float | None = None
) -> dict[str, Any]:
    """A profile in the scheduler's format (``shared/profile.py``).

    The table covers batch 1..max measured: measured points as is, linear in between, and made
    non-decreasing (timing noise can make a larger batch look faster; the scheduler's model
    requires monotone latency)."""
    measured = {row["batch"]: row["chunk_ms_p50"] for row in report["results"]}
    table = _fill_table(measured)
    tele = report["telemetry"]
    if deadline_ms is None:
        deadline_ms = report["video_frames_per_chunk"] / DEFAULT_FPS * 1000.0
    kind = gpu_kind or tele.get("name") or report["device"]
    round_trip = report["suspend_ms"] + report["resume_ms"]
    profile: dict[str, Any] = {
        "name": f"{_slug(kind)}-{report['preset']}-measured",
        "gpu_kind": kind,
        "model": f"TurboServe-{report['preset']}",
        "interconnect": "host" if report["device"] == "cpu" else "pcie-host-roundtrip",
        "chunk_ms": [round(ms, 3) for ms in table],
        "deadline_ms": round(deadline_ms, 3),
        "state_bytes_per_session": int(report["state_bytes"]),
        "migration": {"per_session_ms": round(max(round_trip, 0.001), 3), "fixed_ms": 0.0},
        "sources": {
            "chunk_ms": f"turboserve bench worker: median lockstep chunk time at batches {sorted(measured)}"
            " on this device; linear in between, made non-decreasing.",
            "deadline_ms": f"playback time of one chunk ({report['video_frames_per_chunk']} "
            f"frames) at {DEFAULT_FPS:g} fps unless --deadline-ms was given.",
            "state_bytes_per_session": "the engine's slot size: KV window + sink + scratch, "
            "cross-attention cache, decoder context.",
            "migration": "measured suspend + resume (device -> host -> device) of one session; "
            "a direct device-to-device transport is faster.",
        },
    }
    total = tele.get("mem_total_bytes")
    if total:
        profile["memory"] = {
            "gpu_bytes": int(total),
            "reserved_bytes": int(report["weights_bytes"]),
        }
        profile["sources"]["memory"] = "device total memory; reserved = model + decoder weights."
    passes = report.get("passes_per_chunk", 1)
    if passes > 1:  # the engine's pass-level admission; its full step count is passes - 1
        profile["passes_per_chunk"] = passes
        profile["sources"]["passes_per_chunk"] = "the engine's denoising steps + 1 cache write."
    reduced = report.get("steps", [])[1:]
    if reduced:
        profile["steps"] = {
            "full": report["full_steps"],
            "chunk_ms": {str(s): _steps_table_ms(report, s) for s in reduced},
        }
        profile["sources"]["steps"] = (
            f"turboserve bench worker --steps: chunk_ms times the measured ratio of a lockstep "
            f"chunk at {reduced} denoising steps to one at full steps (timed in turn), at most "
            "1; linear in between, made non-decreasing."
        )
    return profile


def _steps_table_ms(report: dict[str, Any], steps: int) -> list[float]:
    """The profile's chunk times per batch at ``steps`` denoising steps: the full-step chunk
    time (``chunk_ms_p50``, as in ``chunk_ms``) times the ratio measured with the counts timed
    in turn, so the table agrees with ``chunk_ms`` whatever the machine's drift between the
    two timings; a ratio above 1 (noise: a chunk at fewer steps does a part of the work) is 1."""
    measured = {
        row["batch"]: row["chunk_ms_p50"] * min(1.0, row["steps_ratio"][str(steps)])
        for row in report["results"]
    }
    return [round(ms, 3) for ms in _fill_table(measured)]


def _fill_table(measured: dict[int, float]) -> list[float]:
    points = sorted(measured.items())
    table: list[float] = []
    for batch in range(1, points[-1][0] + 1):
        if batch <= points[0][0]:
            value = points[0][1]  # below the smallest measured batch: no faster than it
        else:
            (b0, t0), (b1, t1) = next(
                (points[i], points[i + 1])
                for i in range(len(points) - 1)
                if points[i][0] <= batch <= points[i + 1][0]
            )
            value = t0 + (t1 - t0) * (batch - b0) / (b1 - b0)
        table.append(max(value, table[-1]) if table else value)
    return table


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-") or "device"


def _validate_profile(profile: dict[str, Any]) -> str | None:
    """The scheduler's own loader's verdict, where that module is present."""
    try:
        from shared.profile import ProfileError, profile_from_dict
    except ImportError:
        return None
    try:
        profile_from_dict(profile, source="bench worker")
    except ProfileError as exc:
        return str(exc)
    return None
