"""``turboserve sim traces|run|profile`` (and ``evaluate`` and ``tables``, from ``lab.eval``).

Top-level imports stay light: numpy, the core and the simulator load inside ``run`` functions.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from lab.sim.run import DEFAULT_BOOT_DELAY_S, RunRequest, UsageError, sim_run, sweep_at_slo
from shared.cli import fail


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sim = subparsers.add_parser("sim", help="traces, the discrete-event simulator, the profiler")
    sim_sub = sim.add_subparsers(dest="sim_command", required=True, metavar="SIM_COMMAND")

    traces = sim_sub.add_parser("traces", help="write the built-in seeded synthetic traces")
    traces.add_argument("--out", required=True, type=Path, help="folder to write *.csv.gz into")
    traces.add_argument(
        "--duration", type=float, default=None, help="seconds per trace (default: 1800)"
    )
    traces.add_argument("--plain", action="store_true", help="write .csv instead of .csv.gz")
    traces.set_defaults(func=run_traces)

    run = sim_sub.add_parser("run", help="simulate one policy (or all) on one trace")
    run.add_argument("--trace", required=True, help="a trace file, or a built-in trace name")
    run.add_argument(
        "--policy",
        default="turboserve",
        help="a policy name (lab.sim.policies), several separated by commas, or 'all' "
        "(default: turboserve)",
    )
    run.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="GPU count for static policies (with --policy all the default is "
        "turboserve's cost: each figure interpolated between the GPU counts "
        "around its mean GPU count); for autoscalers, the pool they start "
        "with",
    )
    run.add_argument(
        "--cold-start",
        action="store_true",
        help="start autoscalers from one GPU instead of a pool sized for the "
        "trace's first boot delay (the warm start, the default)",
    )
    run.add_argument(
        "--rho-hat",
        type=float,
        default=None,
        help="fixed target utilisation (default: the adaptive table)",
    )
    run.add_argument("--delta", type=float, default=None, help="hysteresis band")
    run.add_argument(
        "--boot-delay",
        type=float,
        default=DEFAULT_BOOT_DELAY_S,
        help=f"GPU boot delay in seconds (default {DEFAULT_BOOT_DELAY_S:g})",
    )
    run.add_argument("--profile", default=None, help="latency profile name or JSON path")
    run.add_argument("--tick", type=float, default=1.0, help="TICK period in seconds")
    run.add_argument(
        "--resume-ms",
        type=float,
        default=0.0,
        help="cost of bringing an idle session's state back from host RAM "
        "(default 0, as in the paper)",
    )
    run.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra policy parameter (repeatable), e.g. --param eta=0.02",
    )
    run.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    run.add_argument(
        "--timeline",
        action="store_true",
        help="include (t, GPUs, active sessions) points in the JSON",
    )
    run.add_argument(
        "--at-slo",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also print each policy's cost to serve 99%% of chunk periods on "
        "time: its setting swept on this trace as sim evaluate sweeps it "
        "(default: on with --policy all, off otherwise; about a minute per "
        "30-minute trace for all policies)",
    )
    run.add_argument(
        "--jobs", type=int, default=1, help="worker processes for the --at-slo sweep (default 1)"
    )
    run.set_defaults(func=run_sim)

    prof = sim_sub.add_parser("profile", help="build the adaptive rho_hat table offline")
    prof.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where to write the table (default: the shipped rho_table.json)",
    )
    prof.add_argument("--quick", action="store_true", help="fewer traces and a coarser grid")
    prof.add_argument("--boot-delay", type=float, default=DEFAULT_BOOT_DELAY_S)
    prof.add_argument("--profile", default=None, help="latency profile name or JSON path")
    prof.add_argument("--jobs", type=int, default=1, help="worker processes")
    prof.add_argument("--json", type=Path, default=None, help="also write every grid point here")
    prof.add_argument(
        "--target",
        type=float,
        default=0.99,
        help="share of chunk periods that must be served on time at each level (default 0.99)",
    )
    prof.add_argument(
        "--rule",
        choices=("stall", "deadline"),
        default="stall",
        help="what the target counts: chunk periods served on time, a frozen "
        "stream missing one period per period (default), or chunks "
        "delivered on time",
    )
    prof.add_argument(
        "--pool",
        type=int,
        default=1,
        help="also count the N neighbouring levels on each side (default 1)",
    )
    prof.add_argument(
        "--no-monotone",
        action="store_true",
        help="let a burstier level get a higher rho_hat than a calmer one",
    )
    prof.add_argument(
        "--signal",
        choices=("dispersion", "std"),
        default="dispersion",
        help="volatility signal: variance/mean of activations per bin (default) or the paper's std",
    )
    prof.add_argument(
        "--idle-reserve",
        default=None,
        metavar="LIST",
        help="comma-separated idle reserves (share of idle sessions sized for as "
        "if active) searched per level with rho_hat and delta (default "
        "0,0.25,0.5; --quick: 0,0.5; 0 searches none)",
    )
    prof.add_argument(
        "--rho-hat",
        default=None,
        metavar="LIST",
        help="comma-separated rho_hat values searched (default "
        "0.5,0.6,0.7,0.8,0.9,0.95; --quick: 0.6,0.75,0.9)",
    )
    prof.add_argument(
        "--scale-in-delay",
        default=None,
        metavar="LIST",
        help="comma-separated scale-in stabilisation windows in seconds searched "
        "per level (the pool never shrinks below the highest target of the "
        "window; default 0,60,300; --quick: 0,60; 0 searches none)",
    )
    prof.add_argument(
        "--peak-rho",
        default=None,
        metavar="LIST",
        help="comma-separated peak caps searched per level: outside a surge "
        "beyond it, the pool never holds more than the last 300 s's peak "
        "active count needs at that utilisation (default 0,0.85,1; "
        "--quick: 0,1; 0 is no cap)",
    )
    prof.add_argument(
        "--check",
        choices=("eval", "train", "both"),
        default=None,
        help="do not profile: print turboserve's matched-cost p99 margins over "
        "the static baselines with the table (--out, else the shipped one) "
        "on the built-in traces, the training traces, or both",
    )
    prof.set_defaults(func=run_profile)

    from lab.eval import cli as eval_cli

    eval_cli.register(sim_sub)


# ---- sim traces ---------------------------------------------------------------------------


def run_traces(args: argparse.Namespace) -> int:
    from lab.sim import synth
    from lab.sim.traceio import write_trace

    args.out.mkdir(parents=True, exist_ok=True)
    suffix = ".csv" if args.plain else ".csv.gz"
    print(
        "| trace | seed | minutes | sessions | events "
        "| active sessions (min-max after 1 min) | shape |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in synth.BUILTIN_NAMES:
        kwargs = {} if args.duration is None else {"duration_s": args.duration}
        spec = synth.spec(name, **kwargs)
        trace = synth.generate(spec)
        write_trace(trace, args.out / f"{name}{suffix}")
        active = [n for t, n in trace.active_counts() if 60.0 <= t < trace.duration]
        print(
            f"| {name} | {spec.seed} | {trace.duration / 60:.0f} | {trace.sessions} | "
            f"{len(trace.events)} | {min(active, default=0)}-{max(active, default=0)} | "
            f"{spec.description} |"
        )
    return 0


# ---- sim run ------------------------------------------------------------------------------


def run_sim(args: argparse.Namespace) -> int:
    from lab.sim.simulator import PolicyError, SimulationError
    from lab.sim.traceio import TraceError
    from shared.profile import ProfileError

    request = RunRequest.of(args)
    try:
        report = sim_run(request)
        for line in report.warnings:
            print(line, file=sys.stderr)
        for line in report.lines():
            print(line)
        if request.sweeps:
            sweep_at_slo(report)
            for line in report.sweep_lines():
                print(line)
    except (
        TraceError,
        ProfileError,
        SimulationError,
        PolicyError,
        UsageError,
        FileNotFoundError,
        KeyError,
    ) as exc:
        # Bad input (a trace row, a profile field, an unknown name) or a policy decision the
        # environment cannot carry out: one line that names it, no traceback.
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        return fail("sim run", message)
    if args.json is not None:
        rows = report.rows
        doc: Any = rows[0] if len(rows) == 1 else {"trace": report.trace, "runs": rows}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


# ---- sim profile --------------------------------------------------------------------------


def run_profile(args: argparse.Namespace) -> int:
    from lab.sim.simulator import PolicyError, SimulationError
    from lab.sim.traceio import TraceError
    from services.scheduler.core.autoscale import RhoTableError
    from shared.profile import ProfileError

    try:
        return _run_profile(args)
    except (
        TraceError,
        ProfileError,
        SimulationError,
        PolicyError,
        UsageError,
        FileNotFoundError,
        RhoTableError,
    ) as exc:
        return fail("sim profile", exc)


def _run_profile(args: argparse.Namespace) -> int:
    from lab.sim.profiler import build_table, check_table
    from shared.profile import load_profile

    if args.profile is not None:
        load_profile(args.profile)  # a bad profile is a one-line error before any work
    if args.jobs < 1:
        raise UsageError(f"--jobs must be >= 1, got {args.jobs}")
    if not (math.isfinite(args.boot_delay) and args.boot_delay >= 0):
        raise UsageError(f"--boot-delay must be >= 0, got {args.boot_delay:g}")

    if args.check is not None:
        check_table(
            args.out,
            which=args.check,
            boot_delay_s=args.boot_delay,
            profile_name=args.profile,
            log=lambda line: print(line, file=sys.stdout, flush=True),
        )
        return 0
    build_table(
        quick=args.quick,
        out=args.out,
        boot_delay_s=args.boot_delay,
        profile_name=args.profile,
        jobs=args.jobs,
        json_out=args.json,
        target=args.target,
        rule=args.rule,
        pool=args.pool,
        monotone=not args.no_monotone,
        signal=args.signal,
        idle_reserves=None
        if args.idle_reserve is None
        else _shares("--idle-reserve", args.idle_reserve),
        scale_in_delays=None if args.scale_in_delay is None else _delays(args.scale_in_delay),
        peak_rhos=None if args.peak_rho is None else _shares("--peak-rho", args.peak_rho),
        rho_hats=None if args.rho_hat is None else _fractions("--rho-hat", args.rho_hat),
        log=lambda line: print(line, file=sys.stdout, flush=True),
    )
    return 0


def _fractions(flag: str, text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"{flag} takes numbers separated by commas, got {text!r}") from None
    if not values or any(not (math.isfinite(x) and 0 < x <= 1) for x in values):
        raise UsageError(f"{flag} values must be in (0, 1], got {text!r}")
    return values


def _delays(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(
            f"--scale-in-delay takes seconds separated by commas, got {text!r}"
        ) from None
    if not values or any(not (math.isfinite(x) and x >= 0) for x in values):
        raise UsageError(f"--scale-in-delay values must be >= 0, got {text!r}")
    return values


def _shares(flag: str, text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"{flag} takes numbers separated by commas, got {text!r}") from None
    if not values or any(not (math.isfinite(x) and 0 <= x <= 1) for x in values):
        raise UsageError(f"{flag} values must be in [0, 1], got {text!r}")
    return values
