"""The robustness bar on any traces, for the shipped rho_hat table and for candidate tables.

The bar (``docs/evaluation.md``, "Robustness"): at 99% of chunk periods on time, turboserve
costs at most 5% more than the cheaper of a static ``least_loaded`` pool and HPA, on every
trace. Each cost is read as ``sim evaluate`` reads it (``service_level.py``): the static pool
at the smallest GPU count of its sweep that serves the level, an autoscaler on its swept
curve, every sweep planned and extended as the evaluation plans and extends it.

A candidate table changes one run of that sweep only, turboserve's adaptive point (the fixed
rho_hat points use no table), so :func:`sweep` runs the rivals and the fixed points once per
trace and :func:`bar` re-reads the curve with each table's adaptive run. This is how a table
is chosen on the training traces (``synth.training_traces``) and then tested, unchanged, on
the evaluation traces::

    python -m lab.eval.robustness --traces train --table CANDIDATE.json
    python -m lab.eval.robustness --traces eval --table CANDIDATE.json

Each trace prints one row per table (``shipped`` is the shipped table): turboserve's cost at
99%, the rivals', the bar's figure, and the adaptive point's own cost, service and scale
events (a steady load that flaps shows in the last).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from lab.eval.extend import next_runs
from lab.eval.plan import PlanConfig, TraceFacts, plan_trace
from lab.eval.runs import (
    DEFAULT_PROFILE,
    RunSummary,
    execute,
    prime_trace_cache,
    run_all,
)
from lab.eval.service_level import SLO_ATTAINMENT, curve_at_slo, static_at_slo
from lab.eval.tables import markdown_table
from lab.sim.catalog import load_trace, scale_of
from lab.sim.simulator import WARM_START_MIN_WINDOW_S
from lab.sim.synth import BUILTIN_NAMES, training_traces
from lab.sim.traceio import write_trace
from services.scheduler.core.autoscale import RhoTable
from services.scheduler.shipped import load_rho_table, table_path_for
from shared.profile import load_profile

# The curves the bar reads: ours and the two rivals it names.
CURVES = ("turboserve", "least_loaded", "hpa")
BAR_PCT = 5.0


@dataclass(frozen=True, slots=True)
class TraceSweep:
    """One trace's runs of the three curves (turboserve's adaptive point with the shipped
    table), planned and extended as the evaluation does."""

    key: str
    name: str
    runs: tuple[RunSummary, ...]

    @property
    def adaptive(self) -> RunSummary:
        return next(r for r in self.runs if _is_adaptive(r))


@dataclass(frozen=True, slots=True)
class BarRow:
    """The bar's figure on one trace for one table."""

    trace: str
    table: str
    turboserve_gpu_h: float  # at 99%, on the fixed points and this table's adaptive point
    least_loaded_gpu_h: float
    hpa_gpu_h: float
    bar_pct: float | None  # over the cheaper rival that reaches 99%; None: neither does
    adaptive_gpu_h: float
    adaptive_attainment: float
    scale_events: int

    @property
    def met(self) -> bool:
        return self.bar_pct is not None and self.bar_pct <= BAR_PCT


def _is_adaptive(run: RunSummary) -> bool:
    return run.spec.curve == "turboserve" and run.spec.param("rho_hat") is None


def sweep(trace_key: str, profile: str = DEFAULT_PROFILE, boot_delay_s: float = 30.0) -> TraceSweep:
    """The three curves' runs on one trace, as ``sim evaluate`` plans them."""
    trace = load_trace(trace_key)
    prime_trace_cache({trace_key: trace})
    capacity = load_profile(profile).capacity
    # The evaluation's main plan is the default profile's at scale 1; every other is coarser.
    main = profile == DEFAULT_PROFILE and scale_of(trace.name) == 1
    cfg = replace(PlanConfig.full().for_profile(profile, main=main), boot_delay_s=boot_delay_s)
    initial = trace.initial_active(max(boot_delay_s, WARM_START_MIN_WINDOW_S))
    facts = TraceFacts(trace_key, trace.name, trace.peak_active(), initial, capacity)
    specs = [s for s in plan_trace(facts, cfg) if s.curve in CURVES]
    runs = list(run_all(specs, jobs=1, progress=False))
    planned_top = max(int(s.param("gpus")) for s in specs if s.curve == "least_loaded")
    while extra := next_runs(runs, facts.peak_active, capacity, planned_top):
        runs.extend(run_all(extra, jobs=1, progress=False))
    return TraceSweep(trace_key, trace.name, tuple(runs))


def bar(swept: TraceSweep, table: RhoTable | None, label: str = "shipped") -> BarRow:
    """The bar's figure on ``swept`` with ``table`` for the adaptive point (None: the
    shipped table's run of the sweep)."""
    adaptive = swept.adaptive
    if table is not None:
        prime_trace_cache({swept.key: load_trace(swept.key)})
        adaptive = execute(
            replace(adaptive.spec, params=(*adaptive.spec.params, ("rho_table", table)))
        )
    ours = curve_at_slo(
        [*(r for r in swept.runs if r.spec.curve == "turboserve" and not _is_adaptive(r)), adaptive]
    )
    ll = static_at_slo([r for r in swept.runs if r.spec.curve == "least_loaded"])
    hpa = curve_at_slo([r for r in swept.runs if r.spec.curve == "hpa"])
    rivals = [e["cost_gpu_hours"] for e in (ll, hpa) if e["reached"]]
    pct = (
        100.0 * (ours["cost_gpu_hours"] / min(rivals) - 1.0) if rivals and ours["reached"] else None
    )
    return BarRow(
        trace=swept.name,
        table=label,
        turboserve_gpu_h=ours["cost_gpu_hours"],
        least_loaded_gpu_h=ll["cost_gpu_hours"],
        hpa_gpu_h=hpa["cost_gpu_hours"],
        bar_pct=pct,
        adaptive_gpu_h=adaptive.cost_gpu_h,
        adaptive_attainment=adaptive.stall_adjusted_attainment,
        scale_events=adaptive.scale_events,
    )


def level_shares(trace_key: str, table: RhoTable) -> list[float]:
    """The share of the trace's 10 s bins spent at each of ``table``'s volatility levels, the
    level read as the controller reads it (its middle level until the window has three
    bins), from the activations alone (arrivals and idle->active flips)."""
    trace = load_trace(trace_key)
    tracker = table.tracker()
    activations = [e.t for e in trace.events if e.event in ("arrive", "active")]
    counts = [0] * len(table.rho_hat)
    i = 0
    t = 0.0
    while t < trace.duration:
        while i < len(activations) and activations[i] < t:
            tracker.record(activations[i])
            i += 1
        tracker.observe(t)
        value = tracker.value(t)
        counts[len(counts) // 2 if value is None else table.level(value)] += 1
        t += table.bin_s
    total = sum(counts)
    return [c / total for c in counts]


def trace_keys(which: str, folder: Path) -> list[str]:
    """``eval``: the built-in traces; ``train``: the profiler's training traces at 30 minutes,
    written to ``folder``; otherwise a comma-separated list of trace names or paths."""
    if which == "eval":
        return list(BUILTIN_NAMES)
    if which != "train":
        return [k for k in which.split(",") if k]
    keys = []
    for trace in training_traces(duration_s=1800.0):
        path = folder / f"{trace.name}.csv"
        write_trace(trace, path)
        keys.append(str(path))
    return keys


def _load_table(path: str) -> tuple[str, RhoTable | None]:
    if path == "shipped":
        return "shipped", None
    return Path(path).stem, RhoTable.from_dict(json.loads(Path(path).read_text()))


def report(rows: Sequence[BarRow]) -> str:
    """A markdown table of ``rows`` and, per table, the worst trace and the average."""
    body = [
        [
            r.trace,
            r.table,
            r.turboserve_gpu_h,
            r.least_loaded_gpu_h,
            r.hpa_gpu_h,
            "not reached" if r.bar_pct is None else f"{r.bar_pct:+.1f}",
            r.adaptive_gpu_h,
            100.0 * r.adaptive_attainment,
            r.scale_events,
        ]
        for r in rows
    ]
    out = [
        markdown_table(
            [
                "trace",
                "table",
                f"ts GPU-h @ {100 * SLO_ATTAINMENT:g}%",
                "least_loaded",
                "hpa",
                "vs cheaper %",
                "adaptive GPU-h",
                "adaptive %",
                "scale ev.",
            ],
            body,
            digits=2,
        )
    ]
    for label in dict.fromkeys(r.table for r in rows):
        mine = [r.bar_pct for r in rows if r.table == label and r.bar_pct is not None]
        if mine:
            out.append(
                f"{label}: worst {max(mine):+.1f}%, average {sum(mine) / len(mine):+.1f}% "
                f"over {len(mine)} traces; bar (<= +{BAR_PCT:g}% everywhere) "
                f"{'met' if max(mine) <= BAR_PCT else 'NOT met'}"
            )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lab.eval.robustness",
        description="The robustness bar for the shipped and candidate rho_hat tables.",
    )
    parser.add_argument(
        "--traces", default="train", help="train, eval, or names/paths, comma-separated"
    )
    parser.add_argument(
        "--table",
        action="append",
        default=[],
        help="a candidate rho_hat table (JSON); repeatable; 'shipped' is always included",
    )
    parser.add_argument(
        "--levels",
        action="store_true",
        help="print the share of time each trace spends at each level of the shipped table",
    )
    parser.add_argument("--profile", default=DEFAULT_PROFILE)
    parser.add_argument("--boot-delay", type=float, default=30.0)
    args = parser.parse_args(argv)
    try:
        tables = [_load_table(p) for p in ("shipped", *args.table)]
    except (OSError, ValueError) as exc:
        print(f"robustness: {exc}", file=sys.stderr)
        return 2
    try:
        return _run(args, tables)
    except FileNotFoundError as exc:
        print(f"robustness: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, tables: list[tuple[str, RhoTable | None]]) -> int:
    rows: list[BarRow] = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.levels:
            shipped = load_rho_table(table_path_for(args.profile))
            if shipped is None:
                print(f"robustness: no shipped table for {args.profile}", file=sys.stderr)
                return 2
            body = [
                [load_trace(key).name, *(f"{100 * x:.0f}" for x in level_shares(key, shipped))]
                for key in trace_keys(args.traces, Path(tmp))
            ]
            print(markdown_table(["trace", *(f"level {i} %" for i in range(10))], body))
            return 0
        for key in trace_keys(args.traces, Path(tmp)):
            swept = sweep(key, args.profile, args.boot_delay)
            rows.extend(bar(swept, table, label) for label, table in tables)
    print(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
