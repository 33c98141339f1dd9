"""Sweeps extended until they reach the service level, or a stated cap.

A sweep that stops short of 99% of chunk periods on time says nothing about whether the policy
could reach it: the grid may simply have ended. So after the planned runs, every curve read at
the service level (``service_level.py``) whose sweep never reached it gets more runs:

* an **autoscaler** (``turboserve``, ``no_migration``, ``clairvoyant``,
  ``turboserve_predictive``, ``least_loaded_autoscale``, ``hpa``, ``turboserve_q``) gets more
  headroom: its knob (rho_hat; HPA's utilisation target; the scale-out threshold) at the values
  of ``HEADROOM_STEPS`` (0.45, 0.35, 0.25, 0.15) below its sweep's lowest, one value a round,
  down to ``HEADROOM_CAP`` (0.15: a pool sized for GPUs a sixth full, at K = 2 about three
  GPUs per active session);
* a **static pool** gets GPUs, up to ``STATIC_CAP_FACTOR`` (2) times the count the trace's
  peak needs at K (one session per GPU at the peak when K = 2): the cap first; if it reaches
  the level, the smallest count that does is found by bisection between the sweep's largest
  pool that missed and the cap (each step one GPU apart at the end).

A curve that misses at its cap reads "not reached": the policy cannot reach the level within
that headroom, not the grid stopped short. The rounds run until no curve has a run left to
add; ``extension_report`` says what was added and where the caps stopped it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from lab.eval.plan import STATIC_BASELINES
from lab.eval.runs import RunSpec, RunSummary
from lab.eval.service_level import reaches

__all__ = [
    "HEADROOM_CAP",
    "HEADROOM_STEPS",
    "STATIC_CAP_FACTOR",
    "extension_report",
    "next_runs",
    "static_cap",
]

HEADROOM_STEPS = (0.45, 0.35, 0.25, 0.15)
HEADROOM_CAP = HEADROOM_STEPS[-1]
STATIC_CAP_FACTOR = 2.0
# least_loaded_autoscale scales in below its scale-out threshold minus this (its default).
THRESHOLD_BAND = 0.3
AUTOSCALING_CURVES = (
    "turboserve",
    "no_migration",
    "clairvoyant",
    "turboserve_predictive",
    "least_loaded_autoscale",
    "hpa",
    "turboserve_q",
)


def static_cap(peak_active: int, capacity: int) -> int:
    """The largest static pool an extended sweep tries."""
    return max(1, math.ceil(STATIC_CAP_FACTOR * max(1, math.ceil(peak_active / capacity))))


def _knob(curve: str) -> str:
    return "target" if curve == "hpa" else "rho_hat"


def _next_headroom(runs: Sequence[RunSummary], curve: str) -> RunSpec | None:
    knob = _knob(curve)
    fixed = [r for r in runs if r.spec.param(knob) is not None]
    lowest = min((float(r.spec.param(knob)) for r in fixed), default=math.inf)
    below = [v for v in HEADROOM_STEPS if v < lowest - 1e-9]
    if not below:
        return None  # at the cap
    if fixed:
        template = min(fixed, key=lambda r: float(r.spec.param(knob))).spec
        params = tuple((k, below[0] if k == knob else v) for k, v in template.params)
    else:  # only the adaptive run was planned (a quick sweep)
        template = runs[0].spec
        params = (*template.params, (knob, below[0]))
    if curve == "least_loaded_autoscale" and below[0] < THRESHOLD_BAND:
        # Its scale-in threshold (the scale-out one minus the band) would be negative: at 0
        # the pool never shrinks, the most headroom this rival can have.
        params = (*params, ("low", 0.0))
    return replace(template, params=params, detail=False)


def _next_static(runs: Sequence[RunSummary], cap: int) -> RunSpec | None:
    by_count = {int(r.spec.param("gpus")): r for r in runs}
    missed = [n for n, r in by_count.items() if not reaches(r)]
    ok = [n for n, r in by_count.items() if reaches(r)]
    template = runs[0].spec
    if not ok:
        top = max(by_count)
        return None if top >= cap else _with_gpus(template, cap)
    hi = min(ok)
    lo = max((n for n in missed if n < hi), default=None)
    if lo is None or hi - lo <= 1:
        return None
    return _with_gpus(template, (lo + hi) // 2)


def _with_gpus(spec: RunSpec, gpus: int) -> RunSpec:
    params = tuple((k, gpus if k == "gpus" else v) for k, v in spec.params)
    return replace(spec, params=params, detail=False)


def next_runs(
    runs: Sequence[RunSummary], peak_active: int, capacity: int, planned_top: int
) -> list[RunSpec]:
    """The next round of runs for one trace's curves that miss the level (empty: done).

    ``planned_top``: the largest static pool of the planned sweep; a static curve that reached
    the level within it is read as planned (its smallest reaching count is already exact to
    the grid), one that needed the extension is bisected down to one GPU."""
    curves: dict[str, list[RunSummary]] = {}
    for run in runs:
        curves.setdefault(run.spec.curve, []).append(run)
    out: list[RunSpec] = []
    cap = static_cap(peak_active, capacity)
    for curve in STATIC_BASELINES:
        rs = curves.get(curve)
        if not rs:
            continue
        extended = max(int(r.spec.param("gpus")) for r in rs) > planned_top
        if extended or not any(reaches(r) for r in rs):
            spec = _next_static(rs, cap)
            if spec is not None:
                out.append(spec)
    for curve in AUTOSCALING_CURVES:
        rs = curves.get(curve)
        if rs and not any(reaches(r) for r in rs):
            spec = _next_headroom(rs, curve)
            if spec is not None:
                out.append(spec)
    return out


def extension_report(
    runs: Sequence[RunSummary], planned: set[RunSpec], peak_active: int, capacity: int
) -> dict[str, Any]:
    """What the extension added to one trace's sweeps, and which curves still miss at the cap."""
    added: dict[str, list[Any]] = {}
    for run in runs:
        if run.spec in planned:
            continue
        knob = "gpus" if run.spec.curve in STATIC_BASELINES else _knob(run.spec.curve)
        added.setdefault(run.spec.curve, []).append(run.spec.param(knob))
    curves: dict[str, list[RunSummary]] = {}
    for run in runs:
        curves.setdefault(run.spec.curve, []).append(run)
    missing = [
        c
        for c in (*STATIC_BASELINES, *AUTOSCALING_CURVES)
        if c in curves and not any(reaches(r) for r in curves[c])
    ]
    return {
        "added": {c: sorted(v) for c, v in added.items()},
        "static_cap_gpus": static_cap(peak_active, capacity),
        "not_reached_at_cap": missing,
    }
