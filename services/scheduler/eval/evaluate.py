"""The whole evaluation: plan the runs per trace, run them, analyse, plot, report.

``evaluate(trace_keys, quick=...)`` returns the JSON document of ``turboserve sim evaluate``
(``summary`` with the keys of issue 4, ``traces`` with per-trace figures) and keeps the
detail needed for plots in memory only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.scheduler.eval.analysis import TraceFloors, analyse_trace, summarise
from services.scheduler.eval.plan import PlanConfig, TraceFacts, plan_trace
from services.scheduler.eval.runs import RunSummary, prime_trace_cache, run_all

__all__ = ["Evaluation", "evaluate", "trace_keys_from_dir"]

PLOT_TRACE = "bursty"  # the trace whose GPUs-over-time and latency CDF are drawn


@dataclass
class Evaluation:
    document: dict[str, Any]
    runs: dict[str, list[RunSummary]] = field(default_factory=dict)
    floors: dict[str, TraceFloors] = field(default_factory=dict)
    plot_trace: str | None = None


def trace_keys_from_dir(folder: str | Path) -> list[str]:
    """Every ``.csv`` / ``.csv.gz`` file in ``folder``, sorted by name."""
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"--traces {root}: not a directory")
    keys = sorted(str(p) for p in root.iterdir()
                  if p.is_file() and (p.name.endswith(".csv") or p.name.endswith(".csv.gz")))
    if not keys:
        raise FileNotFoundError(f"--traces {root}: no .csv or .csv.gz trace files")
    return keys


def evaluate(trace_keys: list[str], *, quick: bool = False, jobs: int | None = None,
             placement_instances: int = 1000, progress: bool = True,
             cfg: PlanConfig | None = None) -> Evaluation:
    from services.scheduler.eval.placement_gap import placement_gap
    from services.scheduler.shipped import load_profile
    from services.scheduler.sim.simulator import WARM_START_MIN_WINDOW_S
    from services.scheduler.sim.traceio import load_trace

    started = time.perf_counter()
    cfg = cfg or (PlanConfig.quick() if quick else PlanConfig.full())
    profile = load_profile(cfg.profile)
    capacity = profile.capacity
    traces = {key: load_trace(key) for key in trace_keys}
    prime_trace_cache(traces)  # forked workers inherit it instead of re-reading every file
    names = {key: tr.name for key, tr in traces.items()}
    if len(set(names.values())) != len(names):
        raise ValueError(f"two traces share a name: {sorted(names.values())}")
    plot_key = next((k for k, n in names.items() if n == PLOT_TRACE), trace_keys[0])

    floors: dict[str, TraceFloors] = {}
    specs = []
    for key, trace in traces.items():
        fl = TraceFloors(trace, capacity, cfg.boot_delays)
        floors[names[key]] = fl
        initial = trace.initial_active(max(cfg.boot_delay_s, WARM_START_MIN_WINDOW_S))
        facts = TraceFacts(key, names[key], fl.peak_active, initial, capacity)
        specs.extend(plan_trace(facts, cfg, detail=(key == plot_key)))

    by_trace: dict[str, list[RunSummary]] = {n: [] for n in names.values()}
    for summary in run_all(specs, jobs=jobs, progress=progress):
        by_trace[names[summary.spec.trace]].append(summary)
    placement = placement_gap(profile, instances=placement_instances).to_json()
    # The same with K = 4, so that capacity binds on instances of at most 12 sessions.
    placement["tight_capacity_4"] = placement_gap(
        profile, instances=placement_instances, capacity=4).to_json()

    per_trace = {
        name: analyse_trace(name, runs, floors[name], cfg.boot_delay_s)
        for name, runs in by_trace.items()
    }
    document = {
        "summary": summarise(per_trace, placement),
        "traces": per_trace,
        "placement": placement,
        "config": {
            "quick": quick,
            "profile": cfg.profile,
            "capacity": capacity,
            "boot_delay_s": cfg.boot_delay_s,
            "rho_hats": list(cfg.rho_hats),
            "hpa_targets": list(cfg.hpa_targets),
            "static_factors": list(cfg.static_factors),
            "rho_table_sha256": _table_digest(),
            "runs": len(specs),
            "wall_s": round(time.perf_counter() - started, 1),
        },
    }
    return Evaluation(document, by_trace, floors, names[plot_key])


def _table_digest() -> str | None:
    """Which adaptive rho_hat table the runs used (its content changes every result)."""
    import hashlib

    from services.scheduler.shipped import DEFAULT_TABLE_PATH

    if not DEFAULT_TABLE_PATH.is_file():
        return None
    return hashlib.sha256(DEFAULT_TABLE_PATH.read_bytes()).hexdigest()[:12]
