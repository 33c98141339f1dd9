"""``turboserve sim traces|run|profile`` (and ``evaluate`` and ``tables``, from ``lab.eval``).

Top-level imports stay light: numpy, the core and the simulator load inside ``run`` functions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.cli import fail

# The paper's static baselines: they take a fixed ``gpus`` count and never scale.
STATIC_POLICIES = ("round_robin", "least_loaded", "memory_aware")
DEFAULT_BOOT_DELAY_S = 30.0


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


def _parse_params(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--param needs KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(text)
        except json.JSONDecodeError:
            out[key] = text
    return out


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


class UsageError(ValueError):
    """A command-line value out of range: printed as one line, exit status 2."""


@dataclass(frozen=True, slots=True)
class RunRequest:
    """What ``sim run`` is asked, its flags as values (``--param`` as KEY=VALUE strings)."""

    trace: str
    policy: str = "turboserve"
    gpus: int | None = None
    cold_start: bool = False
    rho_hat: float | None = None
    delta: float | None = None
    boot_delay: float = DEFAULT_BOOT_DELAY_S
    profile: str | None = None
    tick: float = 1.0
    resume_ms: float = 0.0
    param: tuple[str, ...] = ()
    timeline: bool = False
    at_slo: bool | None = None
    jobs: int = 1

    @property
    def sweeps(self) -> bool:
        """Whether ``sim run`` also sweeps each policy's cost to serve 99% of periods (by
        default with ``--policy all`` only)."""
        return self.at_slo if self.at_slo is not None else self.policy == "all"

    @classmethod
    def of(cls, args: argparse.Namespace) -> RunRequest:
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
        return cls(**{**values, "param": tuple(values["param"])})


@dataclass(slots=True)
class RunReport:
    """What ``sim run`` measured: one row per policy run (``SimResult.to_json()``, with
    ``cost_at_slo`` once :func:`sweep_at_slo` ran), and what it prints: :meth:`lines`, then
    :meth:`sweep_lines`."""

    request: RunRequest
    trace: str
    heading: str  # the trace and the profile
    profile: str  # the profile's name
    rows: list[dict[str, Any]]
    note: str  # how the static pools were sized (--policy all), or ""
    wall_s: float  # the runs' wall time
    price: float | None  # the profile's price of a GPU-hour (None: it has none)
    # The sweep (:func:`sweep_at_slo`): each policy's cost to serve 99% of periods (None: not
    # swept yet) and its wall time.
    at_slo: dict[str, dict[str, Any] | None] | None = None
    sweep_wall_s: float = 0.0
    warnings: list[str] = field(default_factory=list)  # for stderr: what was left out

    def lines(self, wall: bool = True) -> list[str]:
        """The runs' report as ``sim run`` prints it; ``wall``: with the wall-time line."""
        from lab.sim.report import quality_lines, results_table

        out = [self.heading, results_table(self.rows, extra=["gpus"] if self.note else ())]
        if self.note:
            out.append(self.note)
        out += quality_lines(self.rows)
        out.append(
            "late ms: past each chunk's due time (0: on time); deadline % and stall-adj. %: "
            "the periods served on time in these runs."
            + (
                ""
                if self.request.sweeps
                else " The cost to serve 99% of periods (the headline figure) needs a sweep of "
                "each policy's setting: --at-slo, or turboserve sim evaluate [--traces DIR]"
            )
        )
        if wall:
            out.append(f"simulated {len(self.rows)} run(s) in {self.wall_s:.2f} s wall")
        return out

    def sweep_lines(self, wall: bool = True) -> list[str]:
        """The sweep's report as ``sim run`` prints it (nothing before :func:`sweep_at_slo`);
        ``wall``: with the wall-time line."""
        from lab.eval.service_level import SLO_ATTAINMENT, cost_cell
        from lab.eval.tables import markdown_table

        if self.at_slo is None:
            return []
        request, price = self.request, self.price
        table = []
        for row in self.rows:
            entry = self.at_slo[row["policy"]]
            if entry is None:
                table.append([row["policy"], "not swept by the evaluation", None, None, None])
                continue
            table.append(
                [
                    row["policy"],
                    cost_cell(entry),
                    entry["cost_gpu_hours"] * price
                    if price is not None and entry["reached"]
                    else None,
                    (
                        f"none of its sweep (up to {entry['gpus']} GPUs)"
                        if not entry["reached"] and "gpus" in entry
                        else "none of its sweep"
                        if not entry["reached"]
                        else f"{entry['gpus']} GPUs"
                        if "gpus" in entry
                        else "its curve, at most (its cheapest point serves more)"
                        if entry.get("upper_bound")
                        else "its curve"
                    ),
                    entry["runs"],
                ]
            )
        level = f"{100 * SLO_ATTAINMENT:g}%"
        out = [
            "",
            f"cost to serve {level} of chunk periods on time (stall-adjusted), each policy's "
            f"setting swept on {request.trace} as sim evaluate sweeps it:",
            markdown_table(
                ["policy", f"GPU-h @ {level}", f"$ @ {level}", "read at", "runs"], table, digits=2
            ),
            *_comparisons_at_slo(self.at_slo),
        ]
        ignored = [
            flag
            for flag, given in (
                ("--rho-hat", request.rho_hat is not None),
                ("--delta", request.delta is not None),
                ("--param", bool(request.param)),
                ("--gpus", request.gpus is not None),
                ("--cold-start", request.cold_start),
                ("--tick", request.tick != 1.0),
                ("--resume-ms", request.resume_ms != 0.0),
            )
            if given
        ]
        if ignored:
            out.append(
                f"note: {', '.join(ignored)} apply to the runs above, not to the sweep (it uses "
                f"the evaluation's settings)"
            )
        if wall:
            runs = sum(e["runs"] for e in self.at_slo.values() if e)
            out.append(f"simulated {runs} run(s) for the sweep in {self.sweep_wall_s:.1f} s wall")
        return out


def _check_run_args(request: RunRequest) -> None:
    """Ranges the simulator itself needs; the policy checks its own knobs (rho_hat, delta,
    --param) when it is built and says what it does not take."""
    if request.gpus is not None and request.gpus < 0:
        raise UsageError(f"--gpus must be >= 0, got {request.gpus}")
    if not (math.isfinite(request.boot_delay) and request.boot_delay >= 0):
        raise UsageError(
            f"--boot-delay must be a finite number of seconds >= 0, got {request.boot_delay:g}"
        )
    if not (math.isfinite(request.tick) and request.tick > 0):
        raise UsageError(f"--tick must be > 0 seconds, got {request.tick:g}")
    if not (math.isfinite(request.resume_ms) and request.resume_ms >= 0):
        raise UsageError(f"--resume-ms must be >= 0, got {request.resume_ms:g}")
    if request.rho_hat is not None and not (0.0 < request.rho_hat <= 1.0):
        raise UsageError(f"--rho-hat must be in (0, 1], got {request.rho_hat:g}")
    if request.delta is not None and not (math.isfinite(request.delta) and request.delta >= 0):
        raise UsageError(f"--delta must be >= 0, got {request.delta:g}")
    if request.jobs < 1:
        raise UsageError(f"--jobs must be >= 1, got {request.jobs}")
    if not any(name.strip() for name in request.policy.split(",")):
        raise UsageError(f"--policy needs a policy name, got {request.policy!r}")


def sim_run(request: RunRequest) -> RunReport:
    """Run the policies ``request`` names on its trace (``sim run``'s runs, without printing;
    the sweep is :func:`sweep_at_slo`)."""
    from lab.sim.report import progress_bar
    from lab.sim.simulator import simulate
    from lab.sim.traceio import load_trace
    from shared.profile import load_profile

    _check_run_args(request)
    trace = load_trace(request.trace)
    profile = load_profile() if request.profile is None else load_profile(request.profile)
    params = _parse_params(list(request.param))
    if request.rho_hat is not None:
        params["rho_hat"] = request.rho_hat
    if request.delta is not None:
        params["delta"] = request.delta
    warnings: list[str] = []

    def one(policy: str, gpus: int | None, static_params: dict[str, Any]) -> dict[str, Any]:
        kw = dict(params)
        if policy in STATIC_POLICIES or policy == "no_autoscale":
            # Static pools: default size is the trace's peak at K. Every other parameter goes
            # to the policy, which names any it does not take (PolicyError), never dropped.
            kw = {
                **static_params,
                "gpus": gpus if gpus is not None else _default_static_gpus(trace, profile),
            }
        elif gpus is not None and "gpus" not in kw:
            kw["gpus"] = gpus
        elif request.cold_start and "gpus" not in kw and "initial_gpus" not in kw:
            kw["warm_start"] = False  # the policy's own default start (one GPU)
        try:
            result = simulate(
                trace,
                policy,
                profile,
                boot_delay_s=request.boot_delay,
                tick_s=request.tick,
                progress=progress_bar(f"{policy} on {trace.name}"),
                resume_ms=request.resume_ms,
                **kw,
            )
        except TypeError as exc:
            if "future=" not in str(exc):
                raise
            # An oracle (the evaluation's clairvoyant policy) is told the trace it runs on.
            result = simulate(
                trace,
                policy,
                profile,
                boot_delay_s=request.boot_delay,
                tick_s=request.tick,
                progress=progress_bar(f"{policy} on {trace.name}"),
                resume_ms=request.resume_ms,
                future=trace,
                **kw,
            )
        return result.to_json(timeline=request.timeline)

    rows: list[dict[str, Any]] = []
    note = ""
    if request.policy == "all":
        rows.append(one("turboserve", None, {}))
        mean_gpus = rows[0]["cost_gpu_seconds"] / trace.duration
        if params:
            # With --policy all the autoscaling knobs are meant for the autoscalers: say so
            # instead of silently ignoring them for the static pools.
            warnings.append(
                f"note: {', '.join(sorted(params))} not given to the static pools "
                f"({', '.join(STATIC_POLICIES)}, no_autoscale)"
            )
        for name in _all_policies():
            if name == "turboserve":
                continue
            try:
                if name in STATIC_POLICIES and request.gpus is None:
                    rows.append(_at_equal_cost(name, mean_gpus, one))
                else:
                    rows.append(one(name, request.gpus if name in STATIC_POLICIES else None, {}))
            except TypeError as exc:  # e.g. a policy that needs a parameter we cannot guess
                warnings.append(f"skipped {name}: {exc}")
        if request.gpus is None:
            note = (
                f"static pools ({', '.join(STATIC_POLICIES)}) at turboserve's cost: each "
                f"figure interpolated between {math.floor(mean_gpus)} and "
                f"{math.ceil(mean_gpus)} GPUs (its mean, {mean_gpus:.2f}), as sim evaluate "
                f"matches them; no_autoscale is sized for the trace's peak"
            )
        else:
            note = f"static pools at {request.gpus} GPUs (--gpus): not matched to any cost"
    else:
        for name in (p.strip() for p in request.policy.split(",") if p.strip()):
            rows.append(one(name, request.gpus, params))
    report = RunReport(
        request=request,
        trace=trace.name,
        heading=(
            f"trace {trace.name}: {trace.duration / 60:.0f} min, {trace.sessions} sessions, "
            f"peak {trace.peak_active()} active; profile {profile.name} (K={profile.capacity}, "
            f"deadline {profile.deadline_ms:g} ms); boot delay {request.boot_delay:g} s"
        ),
        rows=rows,
        note=note,
        wall_s=sum(r["wall_s"] for r in rows),
        price=profile.price_usd_per_gpu_hour,
        profile=profile.name,
        warnings=warnings,
    )
    return report


def sweep_at_slo(report: RunReport) -> None:
    """Each row's policy swept on the trace as ``sim evaluate`` sweeps it: its cost to serve
    99% of chunk periods on time, kept in the report and in the row (``cost_at_slo``)."""
    from lab.eval.evaluate import costs_at_slo

    request = report.request
    started = time.perf_counter()
    entries = costs_at_slo(
        request.trace,
        [row["policy"] for row in report.rows],
        profile=request.profile or report.profile,
        boot_delay_s=request.boot_delay,
        jobs=request.jobs,
        progress=sys.stderr.isatty(),
    )
    for row in report.rows:
        row["cost_at_slo"] = entries[row["policy"]]
    report.at_slo = entries
    report.sweep_wall_s = time.perf_counter() - started


def _comparisons_at_slo(entries: dict[str, dict[str, Any] | None]) -> list[str]:
    """Turboserve against the best static pool and against the clairvoyant at the service
    level, as the evaluation compares them; who did not reach it, where one did not."""
    from lab.eval.service_level import gap_bound

    ours = entries.get("turboserve")
    if ours is None:
        return []
    out = []
    static = {n: e for n in STATIC_POLICIES if (e := entries.get(n)) is not None}
    if len(static) == len(STATIC_POLICIES):
        reached = {n: e for n, e in static.items() if e["reached"]}
        if reached and ours["reached"]:
            best = min(reached, key=lambda n: reached[n]["cost_gpu_hours"])
            theirs = reached[best]["cost_gpu_hours"]
            out.append(
                f"turboserve against the best static pool ({best} x "
                f"{reached[best]['gpus']}): "
                f"{100 * (ours['cost_gpu_hours'] / theirs - 1):+.1f}% cost"
            )
        else:
            who = ["turboserve"] if not ours["reached"] else list(STATIC_POLICIES)
            out.append(f"turboserve against the best static pool: not reached ({', '.join(who)})")
    clairvoyant = entries.get("clairvoyant")
    if clairvoyant is not None:
        who = [
            n for n, e in (("turboserve", ours), ("clairvoyant", clairvoyant)) if not e["reached"]
        ]
        bound = gap_bound(ours, clairvoyant)
        gap = (
            f"not reached ({', '.join(who)})"
            if who
            else f"{100 * (ours['cost_gpu_hours'] / clairvoyant['cost_gpu_hours'] - 1):+.1f}%"
            + (f" ({bound}: a cheapest run served more than the level)" if bound else "")
        )
        out.append(f"gap to the clairvoyant (our cost over its, minus 1): {gap}")
    return out


def _at_equal_cost(name: str, mean_gpus: float, one: Any) -> dict[str, Any]:
    """A static pool at a fractional GPU count: every figure linearly interpolated between the
    runs at the counts around it (the rule of the evaluation's matched comparisons), so the
    row costs what turboserve cost instead of a rounded count."""
    lo, hi = max(1, math.floor(mean_gpus)), max(1, math.ceil(mean_gpus))
    low = one(name, lo, {})
    if hi == lo:
        return {**low, "interpolated_between_gpus": [lo, hi]}
    high = one(name, hi, {})
    f = mean_gpus - lo

    def mix(a: Any, b: Any) -> Any:
        if isinstance(a, dict):
            return {k: mix(a[k], b[k]) for k in a if k in b}
        if isinstance(a, bool) or not isinstance(a, int | float):
            return a
        return a + (b - a) * f

    row: dict[str, Any] = mix(low, high)
    row["policy"] = name
    for key in (
        "migrations",
        "scale_events",
        "chunks",
        "peak_gpus",
        "sessions",
        "on_time_full",
        "on_time_reduced",
        "late",
    ):
        if key in row:
            row[key] = round(row[key])
    row["params"] = {**low.get("params", {}), "gpus": f"{mean_gpus:.2f} ({lo}-{hi})"}
    row["interpolated_between_gpus"] = [lo, hi]
    return row


def _all_policies() -> list[str]:
    from lab.sim.policies import POLICIES

    return list(POLICIES)


def _default_static_gpus(trace: Any, profile: Any) -> int:
    """A static pool sized for the trace's peak at full capacity K (the least that fits)."""
    peak: int = trace.peak_active()
    capacity: int = profile.capacity
    return max(1, math.ceil(peak / capacity))


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
