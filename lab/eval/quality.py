"""The quality budget in the evaluation: what the budget policy pays for the service level when
only a small share of chunks may run fewer denoising steps.

Per trace, ``quality_budget`` reads the ``turboserve_q`` sweep (turboserve with a floor of
denoising steps, ``core/quality.py``) at the service level (99% of chunk periods on time,
``service_level.py``) twice more: on the runs with at most 1% of chunks at fewer steps
(``max_reduced_1pct``) and on those with at most 5% (``max_reduced_5pct``). A sweep point is a
rho_hat setting; more headroom means fewer bursts outrun the pool and fewer reduced chunks, so
the constraint moves the reading towards dearer points. Each is set against the costs at the
service level the evaluation reads already: ``turboserve`` without the budget, the cheapest
static pool, and the autoscaling rivals. ``quality_summary`` averages the comparisons over the
traces where both sides reached the level, and names the traces it left out.

Nothing here measures quality: a chunk at fewer steps is counted, not scored (no trained
weights run in the simulator; docs/evaluation.md, "The quality budget").
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from lab.eval.plan import STATIC_BASELINES
from lab.eval.runs import RunSummary
from lab.eval.service_level import (
    AUTOSCALERS_AT_SLO,
    curve_at_slo,
    reaches,
    static_at_slo,
)

__all__ = [
    "BUDGET_CURVE",
    "REDUCED_LIMITS",
    "quality_budget",
    "quality_summary",
    "quality_table",
]

BUDGET_CURVE = "turboserve_q"
# (key, the most chunks at fewer steps a run may have, in %)
REDUCED_LIMITS = (("max_reduced_1pct", 1.0), ("max_reduced_5pct", 5.0))
_EPS = 1e-9


def _at_slo_within(runs: Sequence[RunSummary], limit_pct: float | None) -> dict[str, Any]:
    """The cost at the service level on the runs with at most ``limit_pct`` % of chunks at
    fewer steps (None: all of them), with the share at the cheapest run that serves it."""
    kept = [r for r in runs if limit_pct is None or r.reduced_pct <= limit_pct + _EPS]
    if not kept:
        return {"cost_gpu_hours": None, "reached": False, "runs": 0}
    entry = {**curve_at_slo(kept), "runs": len(kept)}
    serving = [r for r in kept if reaches(r)]
    if serving:
        cheapest = min(serving, key=lambda r: r.cost_gpu_h)
        entry["reduced_pct"] = round(cheapest.reduced_pct, 4)
    return entry


def _versus(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """Ours over theirs minus 1, in %, and whether both sides reached the level."""
    reached = bool(ours["reached"] and theirs["reached"])
    if ours["cost_gpu_hours"] is None or not theirs["cost_gpu_hours"]:
        return {"pct": None, "reached": False}
    pct = 100.0 * (ours["cost_gpu_hours"] / theirs["cost_gpu_hours"] - 1.0)
    return {"pct": round(pct, 3), "reached": reached}


def quality_budget(trace_runs: Sequence[RunSummary]) -> dict[str, Any] | None:
    """The quality budget's figures on one trace's runs (see the module docstring); None when
    they have no budget curve."""
    curves: dict[str, list[RunSummary]] = {}
    for run in trace_runs:
        curves.setdefault(run.spec.curve, []).append(run)
    runs = curves.get(BUDGET_CURVE)
    if not runs:
        return None
    plain = curve_at_slo(curves["turboserve"]) if curves.get("turboserve") else None
    static = {b: static_at_slo(curves[b]) for b in STATIC_BASELINES if curves.get(b)}
    rivals = {r: curve_at_slo(curves[r]) for r in AUTOSCALERS_AT_SLO if curves.get(r)}
    reached_static = [b for b in static if static[b]["reached"]]
    best_static = (
        min(reached_static, key=lambda b: static[b]["cost_gpu_hours"]) if reached_static else None
    )
    out: dict[str, Any] = {
        "policy": BUDGET_CURVE,
        "min_steps": _min_steps(runs),
        "any_reduced": _at_slo_within(runs, None),
        "turboserve": plain,
        "best_static": best_static,
        "static": static,
        "rivals": rivals,
        "reduced_pct_adaptive": round(_adaptive(runs).reduced_pct, 4),
    }
    for key, limit in (("any_reduced", None), *REDUCED_LIMITS):
        ours = out["any_reduced"] if limit is None else _at_slo_within(runs, limit)
        versus: dict[str, Any] = {}
        if plain is not None:
            versus["turboserve"] = _versus(ours, plain)
        if best_static is not None:
            versus["best_static"] = _versus(ours, static[best_static])
        for name, entry in rivals.items():
            versus[name] = _versus(ours, entry)
        out[key] = {**ours, "versus": versus}
    return out


def _adaptive(runs: Sequence[RunSummary]) -> RunSummary:
    """The run with the adaptive rho_hat table (no fixed rho_hat), else the first."""
    return next((r for r in runs if r.spec.param("rho_hat") is None), runs[0])


def _min_steps(runs: Sequence[RunSummary]) -> int:
    from lab.sim.policies import QUALITY_MIN_STEPS

    given = {r.spec.param("min_steps") for r in runs} - {None}
    return int(given.pop()) if len(given) == 1 else QUALITY_MIN_STEPS


def quality_summary(traces: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Over the traces: for each reduced-chunk limit, the budget policy's cost at the service
    level against turboserve without the budget and against the cheapest static pool, as the
    average and maximum of the traces where both sides reached it; the others are named."""
    per = {n: t["quality_budget"] for n, t in traces.items() if t.get("quality_budget")}
    if not per:
        return None
    out: dict[str, Any] = {"policy": BUDGET_CURVE, "traces": len(per)}
    for key in ("any_reduced", *(k for k, _ in REDUCED_LIMITS)):
        block: dict[str, Any] = {}
        for side in ("turboserve", "best_static"):
            values, left_out = [], []
            for name, q in sorted(per.items()):
                v = q[key]["versus"].get(side)
                if v is not None and v["reached"] and v["pct"] is not None:
                    values.append(v["pct"])
                else:
                    left_out.append(name)
            block[f"vs_{side}_pct"] = {
                "avg": round(statistics.fmean(values), 3) if values else None,
                "max": round(max(values), 3) if values else None,
                "min": round(min(values), 3) if values else None,
                "traces": len(values),
                "left_out": left_out,
            }
        block["reached"] = sorted(n for n, q in per.items() if q[key]["reached"])
        out[key] = block
    return out


_HEAD = [
    "trace",
    "q GPU-h @ 99%",
    "reduced % (cheapest run at 99%)",
    "q, <= 1% reduced",
    "q, <= 5% reduced",
    "turboserve GPU-h @ 99%",
    "best static",
    "hpa",
    "<= 1% vs turboserve %",
    "<= 5% vs turboserve %",
    "<= 5% vs best static %",
]


def _rows(traces: dict[str, dict[str, Any]]) -> list[list[object]]:
    from lab.eval.service_level import cost_cell

    rows = []
    for name, t in traces.items():
        q = t.get("quality_budget")
        if not q:
            continue
        best = q["best_static"]
        rows.append(
            [
                name,
                cost_cell(q["any_reduced"]),
                q["any_reduced"].get("reduced_pct"),
                _limited_cell(q["max_reduced_1pct"]),
                _limited_cell(q["max_reduced_5pct"]),
                cost_cell(q["turboserve"]),
                "-" if best is None else f"{cost_cell(q['static'][best])} ({best})",
                cost_cell(q["rivals"].get("hpa")),
                *(_pct_cell(q[key], "turboserve") for key, _ in REDUCED_LIMITS),
                _pct_cell(q["max_reduced_5pct"], "best_static"),
            ]
        )
    return rows


def quality_table(document: dict[str, Any]) -> str:
    """Per trace, at each scale of the document (its first profile): the budget policy's
    (``q``) cost at the service level with any share, at most 1% and at most 5% of chunks at
    fewer steps (and the share at its cheapest run that serves it), against turboserve without
    the budget, the cheapest static pool and HPA; "not reached" where a sweep never served the
    level, and a comparison in parentheses where a side did not reach it."""
    from lab.eval.tables import markdown_table

    scales = document.get("by_scale") or {}
    if not scales:
        return markdown_table(_HEAD, _rows(document["traces"]))
    rows = []
    for entry in scales.values():
        traces = next(iter(entry["by_profile"].values()))["traces"]
        rows += [[entry["scale"], *row] for row in _rows(traces)]
    return markdown_table(["scale", *_HEAD], rows)


def _limited_cell(entry: dict[str, Any]) -> float | str | None:
    """The cost under a limit on reduced chunks; "no run within the limit" when none was."""
    from lab.eval.service_level import cost_cell

    return "not reached (no run within the limit)" if not entry["runs"] else cost_cell(entry)


def _pct_cell(ours: dict[str, Any], side: str) -> float | str | None:
    """Ours against ``side``: "at most" where our cheapest run within the limit already
    serves more than the level (our cost there is at most that run's)."""
    v = ours["versus"].get(side)
    if v is None or v["pct"] is None:
        return None
    if not v["reached"]:
        return f"({v['pct']:+.1f}, not reached)"
    return f"{v['pct']:+.1f} (at most)" if ours.get("upper_bound") else v["pct"]
