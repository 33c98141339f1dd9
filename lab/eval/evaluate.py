"""The whole evaluation: plan the runs per trace, run them, analyse, plot, report.

``evaluate(trace_keys, quick=...)`` returns the JSON document of ``turboserve sim evaluate``
(``summary`` with the headline figures, ``traces`` with per-trace figures) and keeps the
detail needed for plots in memory only. ``evaluate_profiles`` runs it on several latency
profiles (the paper's H20 and our measured H200 by default): the first profile's figures stay
at the top of the document, every profile's are under ``by_profile``. ``evaluate_scales`` runs
that at several scales (scale N: each built-in trace as N copies superposed, ``synth.scaled``);
the first scale's document is the top level, every scale's profiles are under ``by_scale``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lab.eval.analysis import TraceFloors, analyse_trace, summarise
from lab.eval.extend import (
    HEADROOM_CAP,
    HEADROOM_STEPS,
    STATIC_CAP_FACTOR,
    extension_report,
    next_runs,
)
from lab.eval.plan import PlanConfig, TraceFacts, plan_trace
from lab.eval.quality import quality_budget, quality_summary
from lab.eval.runs import (
    DEFAULT_PROFILE,
    RunSpec,
    RunSummary,
    prime_trace_cache,
    run_all,
)

__all__ = [
    "DEFAULT_PROFILES",
    "Evaluation",
    "costs_at_slo",
    "evaluate",
    "evaluate_profiles",
    "evaluate_scales",
    "scaled_keys",
    "trace_keys_from_dir",
]

# The paper's H20 (derived, batches well: K = 12) and our wan-1.3b on one H200 (measured,
# batches hardly at all: K = 2).
DEFAULT_PROFILES = ("h20-longlive-1.3b-nvlink", "h200-wan-1.3b-measured")

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
    keys = sorted(
        str(p)
        for p in root.iterdir()
        if p.is_file() and (p.name.endswith(".csv") or p.name.endswith(".csv.gz"))
    )
    if not keys:
        raise FileNotFoundError(f"--traces {root}: no .csv or .csv.gz trace files")
    return keys


def scaled_keys(trace_keys: list[str], scale: int) -> list[str]:
    """The keys of the traces at ``scale`` (``bursty_x6``, which ``load_trace`` reads as six
    copies of ``bursty`` superposed); scale 1 keeps them."""
    if scale < 1:
        raise ValueError(f"scale must be >= 1, got {scale}")
    return list(trace_keys) if scale == 1 else [f"{key}_x{scale}" for key in trace_keys]


def evaluate(
    trace_keys: list[str],
    *,
    quick: bool = False,
    jobs: int | None = None,
    placement_instances: int = 1000,
    progress: bool = True,
    cfg: PlanConfig | None = None,
    scale: int = 1,
    placement: dict[str, Any] | None = None,
) -> Evaluation:
    """The evaluation of one profile (``cfg``) on the traces at ``scale``; ``placement``: the
    placement gap measured already (it depends on no trace), else measured here on
    ``placement_instances`` instances."""
    from lab.eval.placement_gap import placement_gap
    from lab.sim.catalog import load_trace
    from lab.sim.simulator import WARM_START_MIN_WINDOW_S
    from shared.profile import load_profile

    started = time.perf_counter()
    cfg = cfg or (PlanConfig.quick() if quick else PlanConfig.full())
    profile = load_profile(cfg.profile)
    capacity = profile.capacity
    traces = {key: load_trace(key) for key in trace_keys}
    prime_trace_cache(traces)  # forked workers inherit it instead of re-reading every file
    names = {key: tr.name for key, tr in traces.items()}
    if len(set(names.values())) != len(names):
        raise ValueError(f"two traces share a name: {sorted(names.values())}")
    plot_name = PLOT_TRACE if scale == 1 else f"{PLOT_TRACE}_x{scale}"
    plot_key = next((k for k, n in names.items() if n == plot_name), trace_keys[0])

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
    peaks = {name: fl.peak_active for name, fl in floors.items()}
    added = _extend_sweeps(by_trace, peaks, specs, names, capacity, jobs=jobs, progress=progress)
    if placement is None and placement_instances > 0:
        measured: dict[str, Any] = placement_gap(profile, instances=placement_instances).to_json()
        # The same with K = 4, so that capacity binds on instances of at most 12 sessions.
        measured["tight_capacity_4"] = placement_gap(
            profile, instances=placement_instances, capacity=4
        ).to_json()
        measured["mixed_kinds"] = _mixed_placement(placement_instances)
        placement = measured
    elif placement is None:  # measured once, with the first profile (evaluate_profiles)
        placement = {"instances": 0, "avg": None, "max": None}

    per_trace = {
        name: analyse_trace(name, runs, floors[name], cfg.boot_delay_s)
        for name, runs in by_trace.items()
    }
    planned = set(specs)
    for name, runs in by_trace.items():
        per_trace[name]["sweep_extension"] = extension_report(
            runs, planned, floors[name].peak_active, capacity
        )
        budget = quality_budget(runs)
        if budget is not None:
            per_trace[name]["quality_budget"] = budget
    headline = {"scale": scale, **summarise(per_trace, placement)}
    budget_summary = quality_summary(per_trace)
    if budget_summary is not None:
        headline["quality_budget"] = budget_summary
    document = {
        "scale": scale,
        "summary": headline,
        "traces": per_trace,
        "placement": placement,
        "config": {
            "quick": quick,
            "scale": scale,
            "profile": cfg.profile,
            "capacity": capacity,
            "boot_delay_s": cfg.boot_delay_s,
            "rho_hats": list(cfg.rho_hats),
            "hpa_targets": list(cfg.hpa_targets),
            "static_factors": list(cfg.static_factors),
            "rho_table": _table_path(cfg.profile).name,
            "rho_table_sha256": _table_digest(cfg.profile),
            "runs": len(specs) + added,
            "sweep_extension": {
                "runs": added,
                "headroom_steps": list(HEADROOM_STEPS),
                "headroom_cap": HEADROOM_CAP,
                "static_cap_factor": STATIC_CAP_FACTOR,
                "rule": "a curve that misses the service level gets more headroom (its knob "
                "at the steps below its sweep's lowest, down to the cap) or a larger "
                "static pool (up to the factor times the count the peak needs at K, "
                "then bisected to one GPU)",
            },
            "wall_s": round(time.perf_counter() - started, 1),
        },
    }
    return Evaluation(document, by_trace, floors, names[plot_key])


def _extend_sweeps(
    by_trace: dict[str, list[RunSummary]],
    peaks: dict[str, int],
    specs: list[RunSpec],
    name_of: dict[str, str],
    capacity: int,
    *,
    jobs: int | None,
    progress: bool,
) -> int:
    """Round after round, the runs ``extend.py`` asks for on curves that miss the service
    level, until none is asked for; returns how many were run. ``peaks``: each trace's most
    active sessions at once, by name."""
    from lab.eval.plan import STATIC_BASELINES

    planned_top = {name: 0 for name in by_trace}
    for spec in specs:
        if spec.curve in STATIC_BASELINES:
            name = name_of[spec.trace]
            planned_top[name] = max(planned_top[name], int(spec.param("gpus")))
    added = 0
    while True:
        extra = [
            spec
            for name, runs in by_trace.items()
            for spec in next_runs(runs, peaks[name], capacity, planned_top[name])
        ]
        if not extra:
            return added
        added += len(extra)
        for summary in run_all(extra, jobs=jobs, progress=progress):
            by_trace[name_of[summary.spec.trace]].append(summary)


def costs_at_slo(
    trace_key: str,
    policies: Sequence[str],
    *,
    profile: str = DEFAULT_PROFILE,
    boot_delay_s: float = 30.0,
    quick: bool = False,
    jobs: int | None = None,
    progress: bool = True,
) -> dict[str, dict[str, Any] | None]:
    """What each policy pays to serve 99% of chunk periods on time on one trace, the figure
    ``sim evaluate`` gives for it: the policy's sweep as the evaluation plans it (its main plan
    for the first default profile at scale 1, the other plan otherwise: ``for_profile``),
    extended as it extends it, read as ``service_level`` reads it (a static pool, and
    ``no_autoscale``, at the smallest GPU count that serves it; an autoscaler on its curve).
    Each entry carries ``runs``, the simulator runs behind it; None for a policy that the
    evaluation does not sweep."""
    from lab.eval.plan import STATIC_BASELINES
    from lab.eval.service_level import curve_at_slo, static_at_slo
    from lab.sim.catalog import load_trace, scale_of
    from lab.sim.simulator import WARM_START_MIN_WINDOW_S
    from shared.profile import load_profile

    trace = load_trace(trace_key)
    prime_trace_cache({trace_key: trace})
    capacity = load_profile(profile).capacity
    base = PlanConfig.quick() if quick else PlanConfig.full()
    cfg = replace(
        base.for_profile(
            profile, main=(profile == DEFAULT_PROFILES[0] and scale_of(trace.name) == 1)
        ),
        boot_delay_s=boot_delay_s,
    )
    initial = trace.initial_active(max(boot_delay_s, WARM_START_MIN_WINDOW_S))
    facts = TraceFacts(trace_key, trace.name, trace.peak_active(), initial, capacity)
    specs = plan_trace(facts, cfg)
    wanted = [spec for spec in specs if spec.curve in policies]
    runs = list(run_all(wanted, jobs=jobs, progress=progress))
    by_trace = {trace.name: runs}
    _extend_sweeps(
        by_trace,
        {trace.name: facts.peak_active},
        specs,
        {trace_key: trace.name},
        capacity,
        jobs=jobs,
        progress=progress,
    )
    out: dict[str, dict[str, Any] | None] = {}
    for policy in policies:
        curve = [r for r in by_trace[trace.name] if r.spec.curve == policy]
        if not curve:
            out[policy] = None
            continue
        static = policy in STATIC_BASELINES or policy == "no_autoscale"
        entry = static_at_slo(curve) if static else curve_at_slo(curve)
        out[policy] = {**entry, "runs": len(curve)}
    return out


def _table_path(profile: str) -> Path:
    from services.scheduler.shipped import table_path_for

    return table_path_for(profile)


def _table_digest(profile: str) -> str | None:
    """Which adaptive rho_hat table the runs used (its content changes every result)."""
    import hashlib

    path = _table_path(profile)
    if not path.is_file():
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def _mixed_placement(instances: int) -> dict[str, Any]:
    """The placement gap on GPUs of two kinds: the shipped H20 and H200 profiles (K = 12 and
    2), and two made-up kinds whose chunk-time lines cross (800 + 25 b ms, K = 15; 150 +
    150 b ms, K = 7), at the controller's eta and at eta 1."""
    from dataclasses import replace

    from lab.eval.placement_gap import placement_gap_mixed
    from shared.profile import load_profile

    h20, h200 = load_profile(DEFAULT_PROFILES[0]), load_profile(DEFAULT_PROFILES[1])
    flat = replace(
        h20,
        name="flat",
        gpu_memory_bytes=None,
        chunk_ms_table=tuple(800.0 + 25.0 * b for b in range(1, 16)),
    )
    steep = replace(
        h20,
        name="steep",
        gpu_memory_bytes=None,
        chunk_ms_table=tuple(150.0 + 150.0 * b for b in range(1, 8)),
    )
    return {
        "h20_h200": placement_gap_mixed([h20, h200], instances=instances).to_json(),
        "crossing": placement_gap_mixed([flat, steep], instances=instances).to_json(),
        "crossing_eta_1": placement_gap_mixed(
            [flat, steep], instances=instances, eta=1.0
        ).to_json(),
    }


def evaluate_profiles(
    trace_keys: list[str],
    profiles: tuple[str, ...] = DEFAULT_PROFILES,
    *,
    quick: bool = False,
    jobs: int | None = None,
    placement_instances: int = 1000,
    progress: bool = True,
    scale: int = 1,
    placement: dict[str, Any] | None = None,
) -> Evaluation:
    """:func:`evaluate` on each profile, the traces at ``scale``. The first profile's
    evaluation is the document's top level (plots, tables); ``by_profile`` holds every
    profile's ``summary``, ``traces`` and ``config``. Profiles after the first, and every
    profile at a scale above 1, run no sensitivity sweeps and sweep static pools near the
    knee only (``PlanConfig.for_profile``)."""
    if not profiles:
        raise ValueError("evaluate_profiles needs at least one profile")
    base = PlanConfig.quick() if quick else PlanConfig.full()
    first: Evaluation | None = None
    by_profile: dict[str, Any] = {}
    for i, name in enumerate(profiles):
        cfg = base.for_profile(name, main=(i == 0 and scale == 1))
        result = evaluate(
            scaled_keys(trace_keys, scale),
            quick=quick,
            jobs=jobs,
            placement_instances=placement_instances if i == 0 else 0,
            progress=progress,
            cfg=cfg,
            scale=scale,
            placement=placement if i == 0 else None,
        )
        doc = result.document
        by_profile[name] = {
            "summary": doc["summary"],
            "traces": doc["traces"],
            "config": doc["config"],
        }
        if first is None:
            first = result
    assert first is not None
    first.document["by_profile"] = by_profile
    return first


def evaluate_scales(
    trace_keys: list[str],
    profiles: tuple[str, ...] = DEFAULT_PROFILES,
    scales: tuple[int, ...] = (1,),
    *,
    quick: bool = False,
    jobs: int | None = None,
    placement_instances: int = 1000,
    progress: bool = True,
    done: Callable[[Evaluation], None] | None = None,
) -> Evaluation:
    """:func:`evaluate_profiles` at each scale. The first scale's evaluation is the document's
    top level; ``by_scale`` maps every scale (as text: JSON keys) to its ``scale`` and
    ``by_profile``. The placement gap, which no trace changes, is measured at the first
    scale only and reported at each. ``done`` is called with the evaluation so far after each scale."""
    if not scales:
        raise ValueError("evaluate_scales needs at least one scale")
    first: Evaluation | None = None
    by_scale: dict[str, Any] = {}
    for i, scale in enumerate(scales):
        result = evaluate_profiles(
            trace_keys,
            profiles,
            quick=quick,
            jobs=jobs,
            placement_instances=placement_instances if i == 0 else 0,
            progress=progress,
            scale=scale,
            placement=None if first is None else first.document["placement"],
        )
        by_scale[str(scale)] = {"scale": scale, "by_profile": result.document["by_profile"]}
        if first is None:
            first = result
        first.document["by_scale"] = by_scale
        if done is not None:
            done(first)
    assert first is not None
    return first
