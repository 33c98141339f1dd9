"""The bar for one setting of any autoscaling policy, against the rivals the bar names.

``robustness.py`` re-reads turboserve's curve with a candidate rho_hat table. A policy whose
knob states a service level (``turboserve_staffing``'s ``confidence``) is chosen instead as
one setting: this runs each setting once per trace and reads it against the rivals' sweeps,
run once per trace as ``sim evaluate`` plans and extends them:

* the robustness bar: its cost over the cheaper of static ``least_loaded`` (the smallest pool
  of its sweep that serves 99%) and ``hpa`` (its curve read at 99%);
* the cost bar: over the best static pool (``round_robin``, ``least_loaded``,
  ``memory_aware``, each at its smallest pool that serves 99%);
* flapping: its scale events over HPA's at its default target (0.7);
* with ``--references``: the gap to the clairvoyant (its quick curve at 99%), and today's
  ``turboserve`` beside it.

A setting that serves less than 99% on a trace has no cost there: the row says so and the
summary counts it. Settings are chosen on the training traces (``--traces train``: the
profiler's, written at 30 minutes, and ``--scale 6`` superposes six copies of each), never on
the evaluation's::

    python -m lab.eval.candidates --traces train --scale 1,6 \\
        --set confidence=0.9 --set confidence=0.95,fill=0.9 --json lab/sweeps/staffing/NAME.jsonl

Each finished row is printed (and appended to ``--json`` as one JSON line) as it comes.
With ``--curve`` the settings (a sweep of the policy's knob) are also read per trace as one
curve at 99%, as ``sim evaluate`` reads HPA's targets and turboserve's rho_hat values
(:func:`curve_rows`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lab.eval.extend import next_runs
from lab.eval.matched import CurvePoint, cost_at_latency
from lab.eval.plan import STATIC_BASELINES, PlanConfig, TraceFacts, plan_trace
from lab.eval.runs import DEFAULT_PROFILE, RunSpec, execute, prime_trace_cache, run_all
from lab.eval.service_level import SLO_ATTAINMENT, curve_at_slo, reaches, static_at_slo
from lab.sim.catalog import load_trace
from lab.sim.simulator import WARM_START_MIN_WINDOW_S, warm_pool
from lab.sim.synth import BUILTIN_NAMES, scaled, training_traces
from lab.sim.traceio import write_trace
from shared.profile import load_profile

# The rivals' curves a setting is read against, and the references read beside them on
# request (today's table and the clairvoyant, each on its quick sweep).
RIVAL_CURVES = (*STATIC_BASELINES, "hpa")
REFERENCE_CURVES = ("turboserve", "clairvoyant")
HPA_DEFAULT_TARGET = 0.7


@dataclass(frozen=True, slots=True)
class Rivals:
    """One trace's rivals at 99%: the cheaper of least_loaded and HPA, the best static pool,
    and HPA's scale events at its default target (None where a sweep never served 99%)."""

    key: str
    name: str
    initial_gpus: int
    least_loaded_gpu_h: float | None
    hpa_gpu_h: float | None
    best_static_gpu_h: float | None
    hpa_scale_events: int
    turboserve_gpu_h: float | None = None
    clairvoyant_gpu_h: float | None = None

    @property
    def cheaper_gpu_h(self) -> float | None:
        costs = [c for c in (self.least_loaded_gpu_h, self.hpa_gpu_h) if c is not None]
        return min(costs) if costs else None


def rivals(
    key: str,
    profile: str = DEFAULT_PROFILE,
    boot_delay_s: float = 30.0,
    references: bool = False,
) -> Rivals:
    """The rivals' sweeps on one trace, planned (the quick plan's counts and targets) and
    extended until they serve 99% as the evaluation does; with ``references``, turboserve's
    and the clairvoyant's curves too."""
    trace = load_trace(key)
    prime_trace_cache({key: trace})
    capacity = load_profile(profile).capacity
    cfg = replace(PlanConfig.quick().for_profile(profile, main=False), boot_delay_s=boot_delay_s)
    initial = trace.initial_active(max(boot_delay_s, WARM_START_MIN_WINDOW_S))
    facts = TraceFacts(key, trace.name, trace.peak_active(), initial, capacity)
    curves = (*RIVAL_CURVES, *(REFERENCE_CURVES if references else ()))
    specs = [s for s in plan_trace(facts, cfg) if s.curve in curves]
    runs = list(run_all(specs, jobs=1, progress=False))
    planned_top = max(int(s.param("gpus")) for s in specs if s.curve == "least_loaded")
    while extra := next_runs(runs, facts.peak_active, capacity, planned_top):
        runs.extend(run_all(extra, jobs=1, progress=False))

    def cost(entry: dict[str, Any]) -> float | None:
        return float(entry["cost_gpu_hours"]) if entry["reached"] else None

    statics = [
        cost(static_at_slo([r for r in runs if r.spec.curve == c])) for c in STATIC_BASELINES
    ]
    hpa_runs = [r for r in runs if r.spec.curve == "hpa"]
    default = [r for r in hpa_runs if r.spec.param("target") == HPA_DEFAULT_TARGET]
    return Rivals(
        key=key,
        name=trace.name,
        initial_gpus=warm_pool(initial, capacity),
        least_loaded_gpu_h=cost(static_at_slo([r for r in runs if r.spec.curve == "least_loaded"])),
        hpa_gpu_h=cost(curve_at_slo(hpa_runs)),
        best_static_gpu_h=min((c for c in statics if c is not None), default=None),
        hpa_scale_events=default[0].scale_events if default else 0,
        **{
            f"{c}_gpu_h": cost(curve_at_slo([r for r in runs if r.spec.curve == c]))
            for c in (REFERENCE_CURVES if references else ())
        },
    )


def _pct(ours: float, theirs: float | None) -> float | None:
    return None if theirs is None else round(100.0 * (ours / theirs - 1.0), 2)


def candidate_row(
    found: Rivals,
    policy: str,
    params: dict[str, Any],
    profile: str = DEFAULT_PROFILE,
    boot_delay_s: float = 30.0,
) -> dict[str, Any]:
    """One setting's run on one trace, read against its rivals."""
    spec = RunSpec(
        trace=found.key,
        policy=policy,
        curve=policy,
        params=(("initial_gpus", found.initial_gpus), *sorted(params.items())),
        profile=profile,
        boot_delay_s=boot_delay_s,
    )
    run = execute(spec)
    ok = reaches(run)
    cost = run.cost_gpu_h
    return {
        "trace": found.name,
        "policy": policy,
        "params": params,
        "gpu_h": round(cost, 4),
        "attainment": round(run.stall_adjusted_attainment, 5),
        "reached": ok,
        "scale_events": run.scale_events,
        "reduced_pct": round(run.reduced_pct, 3),  # chunks at fewer steps (the quality budget)
        "hpa_scale_events": found.hpa_scale_events,
        "least_loaded_gpu_h": found.least_loaded_gpu_h,
        "hpa_gpu_h": found.hpa_gpu_h,
        "best_static_gpu_h": found.best_static_gpu_h,
        "vs_cheaper_pct": _pct(cost, found.cheaper_gpu_h) if ok else None,
        "vs_best_static_pct": _pct(cost, found.best_static_gpu_h) if ok else None,
        "turboserve_gpu_h": found.turboserve_gpu_h,
        "clairvoyant_gpu_h": found.clairvoyant_gpu_h,
        "vs_clairvoyant_pct": _pct(cost, found.clairvoyant_gpu_h) if ok else None,
    }


def summary(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Per setting: traces served, worst and average against the cheaper rival, average
    against the best static pool, and the worst ratio of scale events to HPA's."""
    out = []
    for key in dict.fromkeys(json.dumps(r["params"], sort_keys=True) for r in rows):
        mine = [r for r in rows if json.dumps(r["params"], sort_keys=True) == key]
        served = [r for r in mine if r["reached"]]
        vs = [r["vs_cheaper_pct"] for r in served if r["vs_cheaper_pct"] is not None]
        st = [r["vs_best_static_pct"] for r in served if r["vs_best_static_pct"] is not None]
        oracle = [r["vs_clairvoyant_pct"] for r in served if r["vs_clairvoyant_pct"] is not None]
        flap = max((r["scale_events"] / max(1, r["hpa_scale_events"]) for r in mine), default=0)
        out.append(
            f"{key}: served {len(served)}/{len(mine)} traces"
            + (f", worst {max(vs):+.1f}% avg {sum(vs) / len(vs):+.1f}% vs cheaper" if vs else "")
            + (f", avg {sum(st) / len(st):+.1f}% vs best static" if st else "")
            + (f", avg {sum(oracle) / len(oracle):+.1f}% vs clairvoyant" if oracle else "")
            + f", events <= {flap:.1f}x HPA"
            + (
                f"; missed on {', '.join(r['trace'] for r in mine if not r['reached'])}"
                if len(served) < len(mine)
                else ""
            )
        )
    return out


def curve_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per trace, the settings' runs read as one curve at 99%, as the evaluation reads every
    autoscaler's sweep (HPA's targets, turboserve's rho_hat values): the cost on the (cost,
    missed share) envelope at the level, None where no setting served it; with the most scale
    events of the settings that did."""
    out = []
    for trace in dict.fromkeys(r["trace"] for r in rows):
        mine = [r for r in rows if r["trace"] == trace]
        first = mine[0]
        served = [r for r in mine if r["reached"]]
        cost: float | None = None
        if served:
            points = [CurvePoint(r["gpu_h"], 1.0 - r["attainment"]) for r in mine]
            cost = round(cost_at_latency(points, 1.0 - SLO_ATTAINMENT).value, 4)
        cheaper = [c for c in (first["least_loaded_gpu_h"], first["hpa_gpu_h"]) if c is not None]
        out.append(
            {
                "trace": trace,
                "gpu_h": cost,
                "best_attainment": max(r["attainment"] for r in mine),
                "scale_events": max((r["scale_events"] for r in served), default=None),
                "hpa_scale_events": first["hpa_scale_events"],
                "least_loaded_gpu_h": first["least_loaded_gpu_h"],
                "hpa_gpu_h": first["hpa_gpu_h"],
                "vs_cheaper_pct": _pct(cost, min(cheaper) if cheaper else None) if cost else None,
                "vs_best_static_pct": _pct(cost, first["best_static_gpu_h"]) if cost else None,
                "turboserve_gpu_h": first.get("turboserve_gpu_h"),
                "clairvoyant_gpu_h": first.get("clairvoyant_gpu_h"),
                "vs_clairvoyant_pct": (
                    _pct(cost, first.get("clairvoyant_gpu_h")) if cost else None
                ),
            }
        )
    return out


def trace_keys(which: str, scales: Sequence[int], folder: Path, variants: int = 2) -> list[str]:
    """``train``: the profiler's training traces at 30 minutes (``variants`` seeds of each
    shape, at each scale, written to ``folder``); a name after ``train:`` keeps the shapes
    named (``train:bursty,churny``); ``eval``: the built-in traces (``<name>_xN`` at scale N); otherwise a
    comma-separated list of names or paths."""
    if which == "eval":
        return [n if s == 1 else f"{n}_x{s}" for s in scales for n in BUILTIN_NAMES]
    shapes: set[str] | None = None
    if which.startswith("train:"):
        which, shapes = "train", set(which.removeprefix("train:").split(","))
    if which != "train":
        return [k for k in which.split(",") if k]
    keys = []
    base = [
        t
        for t in training_traces(duration_s=1800.0, variants=variants)
        if shapes is None or t.name.rsplit("_", 1)[0].removeprefix("train_") in shapes
    ]
    for s in scales:
        for trace in base:
            t = trace if s == 1 else scaled(trace, s)
            path = folder / f"{t.name}.csv"
            write_trace(t, path)
            keys.append(str(path))
    return keys


def _cached_rivals(key: str, args: argparse.Namespace) -> Rivals:
    """The rivals of ``key``, from ``--rivals-cache`` when it holds them for the same trace
    name, profile, boot delay and references (the sweeps are deterministic)."""
    name = load_trace(key).name
    tag = f"{name}|{args.profile}|{args.boot_delay:g}|{bool(args.references)}"
    path = Path(args.rivals_cache) if args.rivals_cache else None
    cache: dict[str, Any] = json.loads(path.read_text()) if path and path.is_file() else {}
    if tag in cache:
        return Rivals(**{**cache[tag], "key": key})
    found = rivals(key, args.profile, args.boot_delay, args.references)
    if path is not None:
        cache[tag] = {f: getattr(found, f) for f in Rivals.__dataclass_fields__}
        path.write_text(json.dumps(cache, indent=1))
    return found


def _setting(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set wants KEY=VALUE[,KEY=VALUE...], got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lab.eval.candidates",
        description="Settings of an autoscaling policy against the rivals of the bar.",
    )
    parser.add_argument("--traces", default="train", help="train, eval, or names/paths")
    parser.add_argument("--scale", default="1", help="comma-separated scales (default 1)")
    parser.add_argument("--variants", type=int, default=2, help="training seeds per shape")
    parser.add_argument("--policy", default="turboserve_staffing")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        help="one setting, KEY=VALUE[,KEY=VALUE...]; repeatable (none: the defaults)",
    )
    parser.add_argument("--json", help="append each row here as one JSON line")
    parser.add_argument(
        "--curve",
        action="store_true",
        help="also read the settings as one curve per trace at 99%% (as sim evaluate reads "
        "an autoscaler's sweep)",
    )
    parser.add_argument(
        "--rivals-cache",
        help="a JSON file of the rivals' figures by trace: read before a sweep, written after",
    )
    parser.add_argument(
        "--references",
        action="store_true",
        help="also read turboserve's and the clairvoyant's curves at 99%% (quick sweeps)",
    )
    parser.add_argument("--profile", default=DEFAULT_PROFILE)
    parser.add_argument("--boot-delay", type=float, default=30.0)
    args = parser.parse_args(argv)
    try:
        settings = [_setting(s) for s in args.set] or [{}]
        scales = [int(s) for s in args.scale.split(",") if s]
    except ValueError as exc:
        print(f"candidates: {exc}", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for key in trace_keys(args.traces, scales, Path(tmp), args.variants):
            found = _cached_rivals(key, args)
            for params in settings:
                row = candidate_row(found, args.policy, params, args.profile, args.boot_delay)
                rows.append(row)
                line = json.dumps(row)
                print(line, flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(line + "\n")
    print(f"at {100 * SLO_ATTAINMENT:g}% of chunk periods on time:")
    print("\n".join(summary(rows)))
    if args.curve:
        print("the settings read as one curve per trace:")
        for row in curve_rows(rows):
            print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
