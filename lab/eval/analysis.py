"""From the runs of one trace to its figures, and from the traces to the summary.

Conventions (``shared/design/evaluation.md``): cost in GPU-hours, latency is p99 per-chunk.
"Ours" is the ``turboserve`` run with the adaptive rho_hat table.  Every matched value says
whether it was inside the rival's measured range (``reached``), see ``matched.py``.

The measure of service is the **stall-adjusted attainment** (``sim/viewer.py``): the share of
chunk periods, while sessions are active, served on time. **Cost at the service level** is
what an operator pays to serve ``SLO_ATTAINMENT`` (99%) of them: a static pool sized to the
smallest GPU count of its sweep that reaches it; an autoscaler's curve (its knob swept: rho_hat,
a target, a threshold) read on its envelope at 99% (``matched.py``). Ours is the ``turboserve``
curve read the same way (the adaptive point, and the fixed rho_hat values around it).
A level that a sweep never reached is no cost: ``service_level.py`` says how it is flagged and
left out of the summary's averages.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from lab.eval.floor import (
    active_steps,
    floor_gpu_seconds,
    floor_with_boot_gpu_seconds,
)
from lab.eval.matched import (
    CurvePoint,
    cost_at_latency,
    latency_at_cost,
    reduction_pct,
)
from lab.eval.plan import STATIC_BASELINES
from lab.eval.runs import RunSummary
from lab.eval.service_level import service_level, slo_summary

__all__ = ["TraceFloors", "analyse_trace", "summarise"]

STRONG_RIVALS = ("least_loaded_autoscale", "hpa", "turboserve_fixed")
_EPS_H = 1e-9


class TraceFloors:
    """The floor and the boot-aware floors (GPU-hours) of one trace at capacity K."""

    def __init__(self, trace: Any, capacity: int, boot_delays: Sequence[float]) -> None:
        steps = active_steps(trace.events, t_end=trace.duration)
        self.capacity = capacity
        self.floor_h = floor_gpu_seconds(steps, capacity) / 3600.0
        self.with_boot_h = {
            float(b): floor_with_boot_gpu_seconds(steps, capacity, b) / 3600.0 for b in boot_delays
        }
        # The same with one session less per GPU: paced sessions at different phases stall
        # at a full batch (docs/evaluation.md), so no controller serves them at K for long.
        self.with_boot_below_k_h = {
            float(b): floor_with_boot_gpu_seconds(steps, max(1, capacity - 1), b) / 3600.0
            for b in boot_delays
        }
        self.peak_active = max((s.active for s in steps), default=0)
        self.steps = steps


def _adaptive(run: RunSummary) -> bool:
    return run.spec.param("rho_hat") is None and run.spec.param("target") is None


def _pt(run: RunSummary) -> CurvePoint:
    label = run.spec.param("rho_hat") or run.spec.param("target") or run.spec.param("gpus")
    return CurvePoint(run.cost_gpu_h, run.p99_ms, "adaptive" if label is None else str(label))


def _curves(runs: Sequence[RunSummary]) -> dict[str, list[RunSummary]]:
    out: dict[str, list[RunSummary]] = {}
    for run in runs:
        out.setdefault(run.spec.curve, []).append(run)
    for curve in out.values():
        curve.sort(key=lambda r: r.cost_gpu_h)
    return out


def _one(curves: dict[str, list[RunSummary]], curve: str) -> RunSummary:
    """The adaptive run of an autoscaling curve (or the only run of a one-run curve)."""
    runs = curves[curve]
    adaptive = [r for r in runs if _adaptive(r)]
    return adaptive[0] if adaptive else runs[0]


def _match(rival: list[CurvePoint], ours: CurvePoint) -> dict[str, Any]:
    at_cost = latency_at_cost(rival, ours.cost)
    at_lat = cost_at_latency(rival, ours.latency)
    return {
        "latency_reduction_at_matched_cost_pct": round(
            reduction_pct(at_cost.value, ours.latency), 3
        ),
        "rival_latency_ms": round(at_cost.value, 1),
        "latency_match_in_range": at_cost.reached,
        "cost_reduction_at_matched_latency_pct": round(reduction_pct(at_lat.value, ours.cost), 3),
        "rival_cost_gpu_hours": round(at_lat.value, 4),
        "cost_match_in_range": at_lat.reached,
    }


def _best(vs: dict[str, Any], rivals: Sequence[str], value: str, in_range: str) -> str:
    """The rival with the lowest matched value among matches inside the rival's measured
    range; a rival that never reaches our latency (or cost) in its sweep is no match for it.
    Falls back to every rival when none is in range."""
    candidates = [r for r in rivals if vs[r][in_range]] or list(rivals)
    return min(candidates, key=lambda r: vs[r][value])


def _increase(ours: float, theirs: float) -> float:
    return 100.0 * (theirs / ours - 1.0) if ours > 0 else 0.0


def analyse_trace(
    name: str, runs: Sequence[RunSummary], floors: TraceFloors, boot_delay_s: float
) -> dict[str, Any]:
    curves = _curves(runs)
    ours_run = _one(curves, "turboserve")
    ours = _pt(ours_run)
    points = {c: [_pt(r) for r in rs] for c, rs in curves.items()}
    points["turboserve_fixed"] = [_pt(r) for r in curves["turboserve"] if not _adaptive(r)]

    vs = {rival: _match(points[rival], ours) for rival in (*STATIC_BASELINES, *STRONG_RIVALS)}
    rivals_all = (*STATIC_BASELINES, *STRONG_RIVALS)
    best_lat = _best(vs, STATIC_BASELINES, "rival_latency_ms", "latency_match_in_range")
    best_cost = _best(vs, STATIC_BASELINES, "rival_cost_gpu_hours", "cost_match_in_range")
    best_rival_lat = _best(vs, rivals_all, "rival_latency_ms", "latency_match_in_range")
    best_rival_cost = _best(vs, rivals_all, "rival_cost_gpu_hours", "cost_match_in_range")
    # The same, letting clamped (out-of-range) matches compete: the most conservative reading.
    clamped_lat = min(STATIC_BASELINES, key=lambda b: vs[b]["rival_latency_ms"])
    clamped_cost = min(STATIC_BASELINES, key=lambda b: vs[b]["rival_cost_gpu_hours"])

    # Ablations at matched latency: the cost each ablated curve needs to reach our p99.
    ablation = {}
    for key, curve in (("no_migration", "no_migration"), ("no_autoscale", "no_autoscale")):
        m = cost_at_latency(points[curve], ours.latency)
        ablation[key] = {
            "cost_increase_pct": round(_increase(ours.cost, m.value), 3),
            "matched_cost_gpu_hours": round(m.value, 4),
            "in_range": m.reached,
        }
    nm = _one(curves, "no_migration")
    ablation["no_migration"]["same_setting_cost_increase_pct"] = round(
        _increase(ours.cost, nm.cost_gpu_h), 3
    )
    ablation["no_migration"]["same_setting_p99_ms"] = round(nm.p99_ms, 1)

    # The autoscaler against the clairvoyant controller and the floor.
    clair = _one(curves, "clairvoyant")
    clair_m = cost_at_latency(points["clairvoyant"], ours.latency)
    floor_boot = floors.with_boot_h.get(float(boot_delay_s), floors.floor_h)
    oracle = {
        "clairvoyant_cost_gpu_hours": round(clair.cost_gpu_h, 4),
        "clairvoyant_p99_ms": round(clair.p99_ms, 1),
        "clairvoyant_attainment": round(clair.attainment, 5),
        "gap_to_clairvoyant_matched_latency_pct": round(_increase(clair_m.value, ours.cost), 3),
        "clairvoyant_match_in_range": clair_m.reached,
        "gap_to_clairvoyant_same_rho_pct": round(_increase(clair.cost_gpu_h, ours.cost), 3),
        "floor_gpu_hours": round(floors.floor_h, 4),
        "floor_with_boot_gpu_hours": round(floor_boot, 4),
        "gap_to_floor_pct": round(_increase(floors.floor_h, ours.cost), 3),
        "gap_to_floor_with_boot_pct": round(_increase(floor_boot, ours.cost), 3),
        "clairvoyant_gap_to_floor_pct": round(_increase(floors.floor_h, clair.cost_gpu_h), 3),
        "clairvoyant_gap_to_floor_with_boot_pct": round(_increase(floor_boot, clair.cost_gpu_h), 3),
        "floor_with_boot_below_k_gpu_hours": round(
            floors.with_boot_below_k_h.get(float(boot_delay_s), floor_boot), 4
        ),
        "gap_to_floor_with_boot_below_k_pct": round(
            _increase(floors.with_boot_below_k_h.get(float(boot_delay_s), floor_boot), ours.cost), 3
        ),
    }

    predictive = _predictive(curves, points, ours_run, floors)
    sensitivity = _sensitivity(curves, floors, ours_run, clair, boot_delay_s)
    # The headline comparison again at each boot delay (static baselines never boot).
    for row in sensitivity["boot_delay_s"].values():
        point = CurvePoint(row["turboserve_cost_gpu_hours"], row["turboserve_p99_ms"])
        matched = {base: _match(points[base], point) for base in STATIC_BASELINES}
        lat = _best(matched, STATIC_BASELINES, "rival_latency_ms", "latency_match_in_range")
        cost = _best(matched, STATIC_BASELINES, "rival_cost_gpu_hours", "cost_match_in_range")
        row["latency_reduction_vs_best_baseline_pct"] = matched[lat][
            "latency_reduction_at_matched_cost_pct"
        ]
        row["cost_reduction_vs_best_baseline_pct"] = matched[cost][
            "cost_reduction_at_matched_latency_pct"
        ]
    bound = _lower_bound(runs, floors)
    slo = service_level(curves, ours_run)

    return {
        "peak_active": floors.peak_active,
        "capacity": floors.capacity,
        "turboserve": ours_run.to_json(),
        "vs": vs,
        "best_baseline": {
            "latency_reduction_at_matched_cost_pct": vs[best_lat][
                "latency_reduction_at_matched_cost_pct"
            ],
            "latency_best_baseline": best_lat,
            "cost_reduction_at_matched_latency_pct": vs[best_cost][
                "cost_reduction_at_matched_latency_pct"
            ],
            "cost_best_baseline": best_cost,
            "latency_reduction_clamped_included_pct": vs[clamped_lat][
                "latency_reduction_at_matched_cost_pct"
            ],
            "cost_reduction_clamped_included_pct": vs[clamped_cost][
                "cost_reduction_at_matched_latency_pct"
            ],
        },
        "best_rival": {
            "latency_reduction_at_matched_cost_pct": vs[best_rival_lat][
                "latency_reduction_at_matched_cost_pct"
            ],
            "latency_best_rival": best_rival_lat,
            "cost_reduction_at_matched_latency_pct": vs[best_rival_cost][
                "cost_reduction_at_matched_latency_pct"
            ],
            "cost_best_rival": best_rival_cost,
        },
        "ablation": ablation,
        "service_level": slo,
        "oracle": oracle,
        "predictive": predictive,
        "sensitivity": sensitivity,
        "lower_bound": bound,
        "curves": {c: [r.to_json() for r in rs] for c, rs in curves.items()},
    }


def _attainment_curve(runs: list[RunSummary]) -> list[CurvePoint]:
    # "Latency" axis = missed-deadline share, so the envelope machinery applies unchanged.
    return [CurvePoint(r.cost_gpu_h, 1.0 - r.attainment) for r in runs]


def _predictive(
    curves: dict[str, list[RunSummary]],
    points: dict[str, list[CurvePoint]],
    ours_run: RunSummary,
    floors: TraceFloors,
) -> dict[str, Any]:
    pred = _one(curves, "turboserve_predictive")
    at_att = cost_at_latency(_attainment_curve(curves["turboserve"]), 1.0 - pred.attainment)
    at_p99 = cost_at_latency(points["turboserve"], pred.p99_ms)
    return {
        "cost_gpu_hours": round(pred.cost_gpu_h, 4),
        "p99_ms": round(pred.p99_ms, 1),
        "attainment": round(pred.attainment, 5),
        "turboserve_attainment": round(ours_run.attainment, 5),
        "gap_to_floor_pct": round(_increase(floors.floor_h, pred.cost_gpu_h), 3),
        "cost_vs_turboserve_same_setting_pct": round(
            _increase(ours_run.cost_gpu_h, pred.cost_gpu_h), 3
        ),
        "cost_vs_turboserve_matched_attainment_pct": round(
            _increase(at_att.value, pred.cost_gpu_h), 3
        ),
        "matched_attainment_in_range": at_att.reached,
        "cost_vs_turboserve_matched_p99_pct": round(_increase(at_p99.value, pred.cost_gpu_h), 3),
        "matched_p99_in_range": at_p99.reached,
    }


def _sensitivity(
    curves: dict[str, list[RunSummary]],
    floors: TraceFloors,
    ours_run: RunSummary,
    clair: RunSummary,
    boot_delay_s: float,
) -> dict[str, Any]:
    boot: dict[str, Any] = {}
    for b, floor_h in sorted(floors.with_boot_h.items()):
        if b == float(boot_delay_s):
            ts, cv = ours_run, clair
        else:
            key = f"sens_boot_{b:g}"
            if key not in curves:
                continue
            ts, cv = _one(curves, key), _one(curves, f"{key}_clairvoyant")
        clair_curve = (
            curves["clairvoyant"]
            if b == float(boot_delay_s)
            else curves.get(f"sens_boot_{b:g}_clairvoyant", [])
        )
        matched = None
        if len(clair_curve) > 1:
            m = cost_at_latency([_pt(r) for r in clair_curve], ts.p99_ms)
            matched = {
                "gap_to_clairvoyant_matched_latency_pct": round(
                    _increase(m.value, ts.cost_gpu_h), 3
                ),
                "clairvoyant_match_in_range": m.reached,
            }
        boot[f"{b:g}"] = {
            **(matched or {}),
            "turboserve_cost_gpu_hours": round(ts.cost_gpu_h, 4),
            "turboserve_p99_ms": round(ts.p99_ms, 1),
            "turboserve_attainment": round(ts.attainment, 5),
            "clairvoyant_cost_gpu_hours": round(cv.cost_gpu_h, 4),
            "clairvoyant_p99_ms": round(cv.p99_ms, 1),
            "floor_with_boot_gpu_hours": round(floor_h, 4),
            "gap_to_clairvoyant_same_rho_pct": round(_increase(cv.cost_gpu_h, ts.cost_gpu_h), 3),
            "gap_to_floor_with_boot_pct": round(_increase(floor_h, ts.cost_gpu_h), 3),
        }
    migration: dict[str, Any] = {}
    nm = _one(curves, "no_migration")
    for label, run, nom in (("nvlink", ours_run, nm), ("pcie", _get(curves, "sens_pcie"), nm)):
        if run is None or nom is None:
            continue
        migration[label] = {
            "turboserve_cost_gpu_hours": round(run.cost_gpu_h, 4),
            "turboserve_p99_ms": round(run.p99_ms, 1),
            "turboserve_attainment": round(run.attainment, 5),
            "migrations": run.migrations,
            "no_migration_cost_gpu_hours": round(nom.cost_gpu_h, 4),
            "no_migration_p99_ms": round(nom.p99_ms, 1),
            "no_migration_cost_increase_pct": round(_increase(run.cost_gpu_h, nom.cost_gpu_h), 3),
        }
    return {"boot_delay_s": boot, "migration": migration}


def _get(curves: dict[str, list[RunSummary]], key: str) -> RunSummary | None:
    return curves[key][0] if key in curves else None


def _lower_bound(runs: Sequence[RunSummary], floors: TraceFloors) -> dict[str, Any]:
    """Check both proven bounds on every run (see ``floor.py`` and ``runs.py``)."""
    served_ok = all(r.cost_gpu_h >= r.served_floor_gpu_h - _EPS_H for r in runs)
    full = [r for r in runs if r.unserved_session_s == 0.0]
    floor_ok = all(r.cost_gpu_h >= floors.floor_h - _EPS_H for r in full)
    boot_ok = all(
        r.cost_gpu_h >= floors.with_boot_h.get(r.spec.boot_delay_s, floors.floor_h) - _EPS_H
        for r in full
    )
    below = [r for r in runs if r.cost_gpu_h < floors.floor_h - _EPS_H]
    return {
        "holds": served_ok and floor_ok and boot_ok,
        "runs": len(runs),
        "runs_serving_everyone": len(full),
        # Runs that left some session waiting are checked against their own served-slot bound
        # only, not against the trace floor (they did not give everyone a slot).
        "runs_checked_against_floor": len(full),
        "runs_excluded_from_floor_check": len(runs) - len(full),
        "runs_below_floor": [
            {
                "curve": r.spec.curve,
                "params": r.to_json()["params"],
                "cost_gpu_hours": round(r.cost_gpu_h, 4),
                "unserved_session_seconds": round(r.unserved_session_s, 1),
            }
            for r in below
        ],
        "min_cost_over_floor": round(min(r.cost_gpu_h for r in runs) / floors.floor_h, 4)
        if floors.floor_h > 0
        else None,
    }


def _avg_max(values: list[float]) -> dict[str, float]:
    return {"avg": round(statistics.fmean(values), 3), "max": round(max(values), 3)}


def _oracle_gap(traces: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Our gap to the clairvoyant controller at matched p99, over the traces where the
    clairvoyant's sweep reaches our p99: elsewhere its cost there is a clamp to an end of its
    sweep, not a cost, and the trace is named in ``left_out``."""
    inside = {
        name: x["oracle"]["gap_to_clairvoyant_matched_latency_pct"]
        for name, x in traces.items()
        if x["oracle"]["clairvoyant_match_in_range"]
    }
    values = list(inside.values())
    return {
        **(_avg_max(values) if values else {"avg": None, "max": None}),
        "traces_averaged": len(values),
        "left_out": [name for name in traces if name not in inside],
    }


def summarise(traces: dict[str, dict[str, Any]], placement: dict[str, Any]) -> dict[str, Any]:
    """The summary block of the evaluation JSON (its keys are part of the JSON's interface)."""
    t = list(traces.values())
    lat = [x["best_baseline"]["latency_reduction_at_matched_cost_pct"] for x in t]
    cost = [x["best_baseline"]["cost_reduction_at_matched_latency_pct"] for x in t]
    return {
        "cost_reduction_at_matched_latency_pct": {
            "avg_vs_best_baseline": round(statistics.fmean(cost), 3),
            "max_vs_best_baseline": round(max(cost), 3),
            "avg_vs_best_rival": round(
                statistics.fmean(
                    [x["best_rival"]["cost_reduction_at_matched_latency_pct"] for x in t]
                ),
                3,
            ),
            "avg_vs_best_baseline_clamped_included": round(
                statistics.fmean(
                    [x["best_baseline"]["cost_reduction_clamped_included_pct"] for x in t]
                ),
                3,
            ),
        },
        "latency_reduction_at_matched_cost_pct": {
            "avg_vs_best_baseline": round(statistics.fmean(lat), 3),
            "max_vs_best_baseline": round(max(lat), 3),
            "avg_vs_best_rival": round(
                statistics.fmean(
                    [x["best_rival"]["latency_reduction_at_matched_cost_pct"] for x in t]
                ),
                3,
            ),
            "avg_vs_best_baseline_clamped_included": round(
                statistics.fmean(
                    [x["best_baseline"]["latency_reduction_clamped_included_pct"] for x in t]
                ),
                3,
            ),
        },
        "ablation_cost_increase_pct": {
            "no_migration": round(
                statistics.fmean([x["ablation"]["no_migration"]["cost_increase_pct"] for x in t]), 3
            ),
            "no_autoscale": round(
                statistics.fmean([x["ablation"]["no_autoscale"]["cost_increase_pct"] for x in t]), 3
            ),
            "no_migration_max": round(
                max(x["ablation"]["no_migration"]["cost_increase_pct"] for x in t), 3
            ),
            "no_autoscale_max": round(
                max(x["ablation"]["no_autoscale"]["cost_increase_pct"] for x in t), 3
            ),
        },
        "autoscaler_gap_to_oracle_pct": {
            **_oracle_gap(traces),
            "same_rho_avg": round(
                statistics.fmean([x["oracle"]["gap_to_clairvoyant_same_rho_pct"] for x in t]), 3
            ),
        },
        "autoscaler_gap_to_floor_pct": {
            **_avg_max([x["oracle"]["gap_to_floor_pct"] for x in t]),
            "with_boot_avg": round(
                statistics.fmean([x["oracle"]["gap_to_floor_with_boot_pct"] for x in t]), 3
            ),
        },
        "gap_to_boot_aware_floor_pct": {
            "avg": round(
                statistics.fmean([x["oracle"]["gap_to_floor_with_boot_pct"] for x in t]), 3
            ),
            "per_trace": {
                name: x["oracle"]["gap_to_floor_with_boot_pct"] for name, x in traces.items()
            },
            # What stands in the way: the clairvoyant controller's own gap, and ours to the
            # same floor with one session less per GPU.
            "clairvoyant_avg": round(
                statistics.fmean(
                    [x["oracle"]["clairvoyant_gap_to_floor_with_boot_pct"] for x in t]
                ),
                3,
            ),
            "below_k_avg": round(
                statistics.fmean([x["oracle"]["gap_to_floor_with_boot_below_k_pct"] for x in t]), 3
            ),
        },
        **slo_summary(traces),
        "predictive_gap_to_floor_pct": _avg_max([x["predictive"]["gap_to_floor_pct"] for x in t]),
        "placement_gap_to_oracle_pct": {
            "avg": placement["avg"],
            "max": placement["max"],
            "instances": placement["instances"],
            **(
                {
                    "tight_capacity_4_avg": placement["tight_capacity_4"]["avg"],
                    "tight_capacity_4_max": placement["tight_capacity_4"]["max"],
                }
                if "tight_capacity_4" in placement
                else {}
            ),
        },
        **(
            {"placement_mixed_kinds": placement["mixed_kinds"]}
            if "mixed_kinds" in placement
            else {}
        ),
        "by_boot_delay_s": _by_boot(t),
        "oracle_is_lower_bound": all(x["lower_bound"]["holds"] for x in t),
        "lower_bound_runs": {
            "runs": sum(x["lower_bound"]["runs"] for x in t),
            "checked_against_floor": sum(x["lower_bound"]["runs_checked_against_floor"] for x in t),
            "excluded_from_floor_check": sum(
                x["lower_bound"]["runs_excluded_from_floor_check"] for x in t
            ),
        },
        "out_of_range_matches": sum(
            1
            for x in t
            for b in STATIC_BASELINES
            for k in ("latency_match_in_range", "cost_match_in_range")
            if not x["vs"][b][k]
        ),
    }


def _by_boot(t: list[dict[str, Any]]) -> dict[str, Any]:
    """Headline averages and the autoscaler's gaps at each boot delay of the sensitivity sweep."""
    out: dict[str, Any] = {}
    boots = t[0]["sensitivity"]["boot_delay_s"].keys() if t else ()
    for b in boots:
        rows = [
            x["sensitivity"]["boot_delay_s"][b] for x in t if b in x["sensitivity"]["boot_delay_s"]
        ]
        keys = [
            "latency_reduction_vs_best_baseline_pct",
            "cost_reduction_vs_best_baseline_pct",
            "gap_to_clairvoyant_same_rho_pct",
            "gap_to_floor_with_boot_pct",
        ]
        out[b] = {key: round(statistics.fmean(r[key] for r in rows), 3) for key in keys}
        # At matched p99, only where the clairvoyant's sweep reaches our p99 (see _oracle_gap).
        inside = [
            r["gap_to_clairvoyant_matched_latency_pct"]
            for r in rows
            if r.get("clairvoyant_match_in_range")
        ]
        if all("gap_to_clairvoyant_matched_latency_pct" in r for r in rows):
            out[b]["gap_to_clairvoyant_matched_latency_pct"] = (
                round(statistics.fmean(inside), 3) if inside else None
            )
            out[b]["gap_to_clairvoyant_matched_latency_traces"] = len(inside)
    return out
