"""Cost at the service level: what each policy pays to serve 99% of chunk periods on time.

A static pool costs the smallest GPU count of its sweep that serves the level (an operator buys
whole GPUs); an autoscaler's cost is read on its (cost, missed share) envelope at the level
(``matched.py``). When no point of a sweep serves the level, the policy's cost there is
unknown: the entry keeps the sweep's dearest point as ``cost_gpu_hours`` (a lower bound: it
would need at least that much) beside ``reached: false``, and names the sweep's best service
(``best_attainment`` at ``best_cost_gpu_hours``). Such a number is never a cost: a comparison
that depends on it is flagged, printed as "not reached", and left out of every average and
maximum, which name the traces they left out (:func:`slo_summary`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from lab.eval.matched import (
    CurvePoint,
    cost_at_latency,
    latency_at_cost,
    reduction_pct,
)
from lab.eval.plan import STATIC_BASELINES
from lab.eval.runs import RunSummary

__all__ = [
    "AUTOSCALERS_AT_SLO",
    "averaged_text",
    "ROBUST_BAR_PCT",
    "ROBUST_RIVALS",
    "SLO_ATTAINMENT",
    "comparison_cell",
    "comparison_sides_not_reached",
    "cost_cell",
    "curve_at_slo",
    "gap_bound",
    "left_out_text",
    "not_reached_text",
    "reaches",
    "service_level",
    "slo_summary",
    "static_at_slo",
    "summary_blocks",
]

SLO_ATTAINMENT = 0.99  # chunk periods served on time, stall-adjusted
# The robustness bar: at the service level, never more than this above the cheaper of a static
# least-loaded pool and HPA.
ROBUST_RIVALS = ("least_loaded", "hpa")
ROBUST_BAR_PCT = 5.0
# The autoscaling curves read at the service level (beside ours and the static pools).
AUTOSCALERS_AT_SLO = (
    "hpa",
    "least_loaded_autoscale",
    "no_migration",
    "clairvoyant",
    "turboserve_predictive",
)
_EPS = 1e-12


def reaches(run: RunSummary) -> bool:
    return run.stall_adjusted_attainment >= SLO_ATTAINMENT - _EPS


def _missed_curve(runs: Sequence[RunSummary]) -> list[CurvePoint]:
    """Cost against the share of chunk periods *not* served on time (lower is better, so the
    envelope and interpolation of ``matched.py`` apply unchanged)."""
    return [CurvePoint(r.cost_gpu_h, 1.0 - r.stall_adjusted_attainment) for r in runs]


def _best_service(runs: Sequence[RunSummary]) -> dict[str, Any]:
    """The sweep's best service and what it cost (the cheaper point among equals)."""
    best = max(runs, key=lambda r: (r.stall_adjusted_attainment, -r.cost_gpu_h))
    return {
        "best_attainment": round(best.stall_adjusted_attainment, 5),
        "best_cost_gpu_hours": round(best.cost_gpu_h, 4),
    }


def static_at_slo(runs: Sequence[RunSummary]) -> dict[str, Any]:
    """The smallest static pool of the sweep that serves the service level; when none does,
    the sweep's dearest pool, ``reached: false``, and its best service."""
    ok = [r for r in runs if reaches(r)]
    pick = min(ok, key=lambda r: r.cost_gpu_h) if ok else max(runs, key=lambda r: r.cost_gpu_h)
    out = {
        "cost_gpu_hours": round(pick.cost_gpu_h, 4),
        "gpus": pick.spec.param("gpus"),
        "attainment": round(pick.stall_adjusted_attainment, 5),
        "reached": bool(ok),
    }
    return out if ok else {**out, **_best_service(runs)}


def curve_at_slo(runs: Sequence[RunSummary]) -> dict[str, Any]:
    """An autoscaler's cost at the service level, read on its (cost, missed share) envelope.

    ``reached``: some point of the sweep serves the level. When even its cheapest point serves
    more than the level, the cost there is at most that point's (``upper_bound: true``). When
    none serves it, ``cost_gpu_hours`` is the dearest point's (a lower bound, not a cost) and
    the entry names the sweep's best service."""
    m = cost_at_latency(_missed_curve(runs), 1.0 - SLO_ATTAINMENT)
    if any(reaches(r) for r in runs):
        return {
            "cost_gpu_hours": round(m.value, 4),
            "reached": True,
            **({} if m.reached else {"upper_bound": True}),
        }
    return {"cost_gpu_hours": round(m.value, 4), "reached": False, **_best_service(runs)}


def gap_bound(ours: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """What a gap ours / theirs - 1 is when a side's cheapest run already served more than the
    level (its cost there is at most that run's, ``upper_bound``): "at least" when it is
    theirs, "at most" when ours, "unknown" when both; None when both costs are read on their
    curves."""
    return {(False, True): "at least", (True, False): "at most", (True, True): "unknown"}.get(
        (bool(ours.get("upper_bound")), bool(theirs.get("upper_bound")))
    )


def not_reached_text(entry: dict[str, Any]) -> str:
    """How a table prints an entry whose sweep never served the level."""
    if "best_attainment" not in entry:  # a document written before the best was kept
        return f"not reached (needs over {entry['cost_gpu_hours']:.1f} GPU-h)"
    return (
        f"not reached (best {100 * entry['best_attainment']:.1f}% at "
        f"{entry['best_cost_gpu_hours']:.1f} GPU-h)"
    )


def cost_cell(entry: dict[str, Any] | None) -> float | str | None:
    """A table cell for one policy's cost at the level: the cost, or "not reached (...)"."""
    if entry is None:
        return None
    return entry["cost_gpu_hours"] if entry["reached"] else not_reached_text(entry)


_OTHER_SIDE = {
    "cost_reduction_vs_best_baseline": "best_baseline",
    "cost_vs_best_of_least_loaded_and_hpa": "best_of_least_loaded_and_hpa",
}


def _entry(v: dict[str, Any], name: str) -> dict[str, Any]:
    entry: dict[str, Any] = (
        v["turboserve"] if name == "turboserve" else v["static"].get(name) or v["rivals"][name]
    )
    return entry


def comparison_sides_not_reached(v: dict[str, Any], comparison: str) -> list[str]:
    """The sides of a comparison of ``service_level`` (``cost_reduction_vs_best_baseline`` or
    ``cost_vs_best_of_least_loaded_and_hpa``) whose sweeps never served the level. Read from
    the entries themselves, so that a document written before the ``_reached`` flags were
    kept is read the same way."""
    return [
        name
        for name in ("turboserve", v[_OTHER_SIDE[comparison]])
        if not _entry(v, name)["reached"]
    ]


def comparison_cell(v: dict[str, Any], comparison: str, sign: float = 1.0) -> float | str:
    """A table cell for a comparison: the percentage, or which side did not reach the level."""
    who = comparison_sides_not_reached(v, comparison)
    if who:
        return f"not reached ({', '.join(who)})"
    return sign * float(v[comparison + "_pct"])


def _increase(ours: float, theirs: float) -> float:
    return 100.0 * (theirs / ours - 1.0) if ours > 0 else 0.0


def _cheapest(entries: dict[str, dict[str, Any]], names: Sequence[str]) -> str:
    """The cheapest at the level among those that reach it; when none does, the one that came
    closest (its figure is flagged as not reached)."""
    reached = [n for n in names if entries[n]["reached"]]
    if reached:
        return min(reached, key=lambda n: entries[n]["cost_gpu_hours"])
    return max(
        names, key=lambda n: (entries[n].get("best_attainment", 0.0), -entries[n]["cost_gpu_hours"])
    )


def service_level(curves: dict[str, list[RunSummary]], ours_run: RunSummary) -> dict[str, Any]:
    """Cost at the service level for every policy, our cost against the best static pool and
    against the cheaper of a static least-loaded pool and HPA, and service at matched cost.

    Each comparison carries ``..._reached``: both sides served the level somewhere in their
    sweeps. When it is false the percentage is kept for the record and means nothing as a
    cost; ``not_reached`` lists the policies whose sweeps never served the level."""
    ours = curve_at_slo(curves["turboserve"])
    static = {b: static_at_slo(curves[b]) for b in STATIC_BASELINES}
    rivals = {r: curve_at_slo(curves[r]) for r in AUTOSCALERS_AT_SLO if r in curves}
    best = _cheapest(static, STATIC_BASELINES)
    robust = {
        "least_loaded": static["least_loaded"],
        **({"hpa": rivals["hpa"]} if "hpa" in rivals else {}),
    }
    robust_best = _cheapest(robust, [r for r in ROBUST_RIVALS if r in robust])
    at_cost = {}
    for rival in (*STATIC_BASELINES, "hpa", "least_loaded_autoscale"):
        if rival in curves:
            m = latency_at_cost(_missed_curve(curves[rival]), ours_run.cost_gpu_h)
            at_cost[rival] = {"attainment": round(1.0 - m.value, 5), "in_range": m.reached}
    not_reached = [
        name
        for name, entry in (("turboserve", ours), *static.items(), *rivals.items())
        if not entry["reached"]
    ]
    clairvoyant = rivals.get("clairvoyant")
    gap = (
        {}
        if clairvoyant is None
        else {
            # Ours over the clairvoyant controller's cost for the same service, minus 1.
            "gap_to_clairvoyant_at_slo_pct": round(
                _increase(clairvoyant["cost_gpu_hours"], ours["cost_gpu_hours"]), 3
            ),
            "gap_to_clairvoyant_at_slo_reached": ours["reached"] and clairvoyant["reached"],
            "gap_to_clairvoyant_at_slo_bound": gap_bound(ours, clairvoyant),
        }
    )
    return {
        "slo_attainment": SLO_ATTAINMENT,
        "turboserve": {
            **ours,
            "adaptive_cost_gpu_hours": round(ours_run.cost_gpu_h, 4),
            "adaptive_attainment": round(ours_run.stall_adjusted_attainment, 5),
            "adaptive_meets": reaches(ours_run),
        },
        "static": static,
        "rivals": rivals,
        "not_reached": not_reached,
        "best_baseline": best,
        "cost_reduction_vs_best_baseline_pct": round(
            reduction_pct(static[best]["cost_gpu_hours"], ours["cost_gpu_hours"]), 3
        ),
        "cost_reduction_vs_best_baseline_reached": ours["reached"] and static[best]["reached"],
        "cost_vs_best_of_least_loaded_and_hpa_pct": round(
            _increase(robust[robust_best]["cost_gpu_hours"], ours["cost_gpu_hours"]), 3
        ),
        "cost_vs_best_of_least_loaded_and_hpa_reached": ours["reached"]
        and robust[robust_best]["reached"],
        "best_of_least_loaded_and_hpa": robust_best,
        "attainment_at_our_cost": at_cost,
        **gap,
    }


def slo_summary(traces: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The summary's service-level blocks: our cost against the best static pool, against the
    cheaper of a static least-loaded pool and HPA (the robustness bar), and against the
    clairvoyant controller (``gap_to_clairvoyant_at_slo_pct``: ours over its cost, minus 1). Averages, minima and maxima are taken over the
    traces where both sides of the comparison reached the level; ``per_trace`` holds None for
    the others, and ``left_out`` names them with the policies that did not reach it."""
    cost: dict[str, float | None] = {}
    cost_out: dict[str, list[str]] = {}
    robust: dict[str, float | None] = {}
    robust_out: dict[str, list[str]] = {}
    robust_lost: list[str] = []
    for name, t in traces.items():
        v = t["service_level"]
        missing = comparison_sides_not_reached(v, "cost_reduction_vs_best_baseline")
        cost[name] = None if missing else v["cost_reduction_vs_best_baseline_pct"]
        if missing:
            cost_out[name] = missing
        missing = comparison_sides_not_reached(v, "cost_vs_best_of_least_loaded_and_hpa")
        robust[name] = None if missing else v["cost_vs_best_of_least_loaded_and_hpa_pct"]
        if missing:
            robust_out[name] = missing
        if missing == ["turboserve"]:
            robust_lost.append(name)  # a rival serves the level, we do not
    gap: dict[str, float | None] = {}
    gap_out: dict[str, list[str]] = {}
    gap_bounds: dict[str, str] = {}
    for name, t in traces.items():
        v = t["service_level"]
        if "gap_to_clairvoyant_at_slo_pct" not in v:
            continue  # no clairvoyant sweep on this trace
        missing = [
            who
            for who, entry in (
                ("turboserve", v["turboserve"]),
                ("clairvoyant", v["rivals"]["clairvoyant"]),
            )
            if not entry["reached"]
        ]
        gap[name] = None if missing else v["gap_to_clairvoyant_at_slo_pct"]
        if missing:
            gap_out[name] = missing
        elif v.get("gap_to_clairvoyant_at_slo_bound"):
            gap_bounds[name] = v["gap_to_clairvoyant_at_slo_bound"]
    gaps = [x for x in gap.values() if x is not None]
    costs = [x for x in cost.values() if x is not None]
    robusts = [x for x in robust.values() if x is not None]
    reached = {n: x for n, x in cost.items() if x is not None}
    worst = min(reached, key=lambda n: reached[n], default=None)
    return {
        "cost_reduction_at_matched_slo_pct": {
            "slo_attainment": SLO_ATTAINMENT,
            "avg_vs_best_baseline": _avg(costs),
            "worst_vs_best_baseline": None if worst is None else cost[worst],
            "worst_trace": worst,
            "per_trace": cost,
            "traces_averaged": len(costs),
            "left_out": cost_out,
        },
        "gap_to_clairvoyant_at_slo_pct": {
            "slo_attainment": SLO_ATTAINMENT,
            "avg": _avg(gaps),
            "max": round(max(gaps), 3) if gaps else None,
            "per_trace": gap,
            "traces_averaged": len(gaps),
            "left_out": gap_out,
            # Traces whose gap is a bound: a side's cheapest run served more than the level.
            "bounds": gap_bounds,
        },
        "robustness": {
            "bar_pct": ROBUST_BAR_PCT,
            "max_cost_above_best_of_least_loaded_and_hpa_pct": (
                round(max(robusts), 3) if robusts else None
            ),
            "per_trace": robust,
            "traces_compared": len(robusts),
            "left_out": robust_out,
            # A trace where a rival serves the level and we do not fails the bar outright.
            "turboserve_not_reached_where_a_rival_reaches": robust_lost,
            "met": bool(robusts) and not robust_lost and all(x <= ROBUST_BAR_PCT for x in robusts),
        },
    }


def _avg(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 3) if values else None


def left_out_text(block: dict[str, Any]) -> str:
    """'; left out: bursty (turboserve not reached)' or '' for a summary block."""
    out = block.get("left_out") or {}
    if not out:
        return ""
    parts = [f"{name} ({', '.join(who) or 'a side'} not reached)" for name, who in out.items()]
    return "; left out: " + ", ".join(parts)


def summary_blocks(summary: dict[str, Any], traces: dict[str, Any]) -> dict[str, Any]:
    """The summary's service-level blocks; recomputed from the traces for a document written
    before they named what they left out (its averages took unreached levels in)."""
    block = summary.get("cost_reduction_at_matched_slo_pct")
    if block is not None and "left_out" in block and "left_out" in summary.get("robustness", {}):
        return {"cost_reduction_at_matched_slo_pct": block, "robustness": summary["robustness"]}
    return slo_summary(traces)


def averaged_text(block: dict[str, Any], count_key: str) -> str:
    """'7 of 7 traces' or '6 of 7 traces; left out: bursty (turboserve not reached)'."""
    total = len(block["per_trace"])
    return f"{block[count_key]} of {total} traces" + left_out_text(block)
