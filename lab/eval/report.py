"""Markdown tables and PNG plots from an :class:`~lab.eval.evaluate.Evaluation`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lab.eval.analysis import STRONG_RIVALS
from lab.eval.matched import CurvePoint
from lab.eval.plan import STATIC_BASELINES
from lab.eval.quality import quality_table
from lab.eval.service_level import (
    SLO_ATTAINMENT,
    averaged_text,
    comparison_cell,
    cost_cell,
    summary_blocks,
)
from lab.eval.tables import markdown_table

__all__ = ["markdown_report", "write_plots"]

PAPER = {
    "latency": 37.5,
    "latency_max": 51.6,
    "cost": 37.2,
    "cost_max": 49.0,
    "no_migration": 15.0,
    "no_autoscale": 42.9,
    "placement": 3.6,
    "oracle": 6.1,
    "oracle_max": 8.3,
}


def _summary_table(s: dict[str, Any], traces: dict[str, Any]) -> str:
    c = s["cost_reduction_at_matched_latency_pct"]
    lat = s["latency_reduction_at_matched_cost_pct"]
    ab = s["ablation_cost_increase_pct"]
    og = s["autoscaler_gap_to_oracle_pct"]
    fg = s["autoscaler_gap_to_floor_pct"]
    pg = s["placement_gap_to_oracle_pct"]
    rows = [
        [
            "p99 latency reduction at matched cost vs best baseline, avg (max)",
            f"{PAPER['latency']} ({PAPER['latency_max']})",
            f"{lat['avg_vs_best_baseline']:.1f} ({lat['max_vs_best_baseline']:.1f})",
            "> 37.5",
            _met(lat["avg_vs_best_baseline"] > 37.5),
        ],
        [
            "cost reduction at matched p99 vs best baseline, avg (max)",
            f"{PAPER['cost']} ({PAPER['cost_max']})",
            f"{c['avg_vs_best_baseline']:.1f} ({c['max_vs_best_baseline']:.1f})",
            "> 37.2",
            _met(c["avg_vs_best_baseline"] > 37.2),
        ],
        [
            "same, letting clamped out-of-range matches be 'best' (most conservative)",
            "-",
            f"{lat['avg_vs_best_baseline_clamped_included']:.1f} / "
            f"{c['avg_vs_best_baseline_clamped_included']:.1f}",
            "reported",
            "-",
        ],
        [
            "same, vs best of all rivals (HPA, autoscaled least-loaded, fixed rho_hat)",
            "-",
            f"{lat['avg_vs_best_rival']:.1f} / {c['avg_vs_best_rival']:.1f}",
            "reported",
            "-",
        ],
        [
            "cost without migration / without autoscaling, avg %",
            f"+{PAPER['no_migration']} / +{PAPER['no_autoscale']}",
            f"{ab['no_migration']:+.1f} / {ab['no_autoscale']:+.1f}",
            "both > 0",
            _met(ab["no_migration"] > 0 and ab["no_autoscale"] > 0),
        ],
        [
            "placement gap to exhaustive optimum, avg (max) %; with K = 4",
            f"{PAPER['placement']}",
            "not measured (--placement-instances 0)"
            if pg["avg"] is None
            else f"{pg['avg']:.3f} ({pg['max']:.2f}); "
            f"{pg.get('tight_capacity_4_avg', float('nan')):.3f} "
            f"({pg.get('tight_capacity_4_max', float('nan')):.2f})",
            "< 2",
            "-" if pg["avg"] is None else _met(pg["avg"] < 2.0),
        ],
        [
            "autoscaler gap to clairvoyant at matched p99, avg (max) %, where the clairvoyant's "
            "sweep reaches our p99",
            f"{PAPER['oracle']} ({PAPER['oracle_max']})",
            _oracle_text(og, len(traces)),
            "< 4",
            _met(og["avg"] is not None and og["avg"] < 4.0),
        ],
        [
            "autoscaler gap to the floor, avg (max) %; boot-aware floor avg",
            "not reported",
            f"{fg['avg']:.1f} ({fg['max']:.1f}); {fg['with_boot_avg']:.1f}",
            "reported",
            "-",
        ],
        [
            "floor is a lower bound on every run",
            "no (one cell)",
            _bound_text(s),
            "yes",
            _met(s["oracle_is_lower_bound"]),
        ],
    ]
    if "cost_reduction_at_matched_slo_pct" in s:
        blocks = summary_blocks(s, traces)
        slo = blocks["cost_reduction_at_matched_slo_pct"]
        gb = s["gap_to_boot_aware_floor_pct"]
        rb = blocks["robustness"]
        rows[2:2] = [
            [
                f"cost reduction at matched service ({100 * slo['slo_attainment']:g}% of chunk "
                f"periods on time) vs best static pool, avg (min), over the traces where both "
                f"reach it",
                "-",
                _avg_min(slo) + "; " + averaged_text(slo, "traces_averaged"),
                "reported",
                "-",
            ],
            *(
                [
                    [
                        f"gap to the clairvoyant at matched service ({100 * slo['slo_attainment']:g}% "
                        f"of chunk periods on time): our cost over its, minus 1, avg (max) %",
                        "-",
                        _gap_text(s["gap_to_clairvoyant_at_slo_pct"]),
                        "reported",
                        "-",
                    ]
                ]
                if "gap_to_clairvoyant_at_slo_pct" in s
                else []
            ),
            [
                "cost at matched service above the cheaper of static least_loaded and HPA, max %",
                "-",
                _signed(rb["max_cost_above_best_of_least_loaded_and_hpa_pct"])
                + "; "
                + averaged_text(rb, "traces_compared")
                + _lost(rb),
                f"<= +{rb['bar_pct']:g}",
                _met(rb["met"]),
            ],
        ]
        rows.append(
            [
                "gap to the boot-aware floor, avg (max) %",
                "not reported",
                f"{gb['avg']:.1f} ({max(gb['per_trace'].values()):.1f})",
                "< 6",
                _met(gb["avg"] < 6.0),
            ]
        )
    mixed = s.get("placement_mixed_kinds")
    if mixed:
        rows.append(
            [
                "placement gap on two GPU kinds, avg (max) %: H20 + H200; crossing "
                "kinds; crossing at eta 1",
                "-",
                "; ".join(f"{v['avg']:.3f} ({v['max']:.1f})" for v in mixed.values()),
                "reported",
                "-",
            ]
        )
    return markdown_table(["figure", "paper", "ours", "bar", "met"], rows)


def _gap_text(block: dict[str, Any]) -> str:
    """'12.3 (40.1); 7 of 7 traces' for the gap to the clairvoyant at the service level."""
    text = "-" if block["avg"] is None else f"{block['avg']:+.1f} ({block['max']:+.1f})"
    return text + "; " + averaged_text(block, "traces_averaged")


def _per_trace_gap(name: str, gap: float | None, block: dict[str, Any]) -> str:
    if gap is None:
        return f"{name} not reached"
    bound = block.get("bounds", {}).get(name)
    return f"{name} {_signed(gap)}" + (f" ({bound})" if bound else "")


def _gap_by_scale_table(by_scale: dict[str, Any]) -> str:
    """The gap to the clairvoyant at the service level for every scale and profile."""
    rows = []
    for entry in by_scale.values():
        for name, doc in entry["by_profile"].items():
            block = doc["summary"].get("gap_to_clairvoyant_at_slo_pct")
            if block is None:
                continue
            rows.append(
                [
                    entry["scale"],
                    name,
                    block["avg"],
                    block["max"],
                    f"{block['traces_averaged']} of {len(block['per_trace'])}",
                    ", ".join(_per_trace_gap(t, v, block) for t, v in block["per_trace"].items()),
                ]
            )
    return markdown_table(
        ["scale", "profile", "avg %", "max %", "traces averaged", "per trace %"], rows
    )


def _service_table(traces: dict[str, Any]) -> str:
    """Cost for each policy to serve 99% of chunk periods on time, per trace; a policy whose
    sweep never served it reads "not reached (best X% at Y GPU-h)", and so do the comparisons
    that would need its cost."""
    rows = []
    for name, t in traces.items():
        v = t["service_level"]
        ts = v["turboserve"]
        best = v["static"][v["best_baseline"]]
        rivals = v["rivals"]
        rows.append(
            [
                name,
                cost_cell(ts),
                ts["adaptive_cost_gpu_hours"],
                100 * ts["adaptive_attainment"],
                t["turboserve"]["latency_ms"]["p99"],
                f"{v['best_baseline']} x {best['gpus']}",
                cost_cell(best),
                cost_cell(rivals.get("hpa")),
                cost_cell(rivals.get("least_loaded_autoscale")),
                cost_cell(rivals.get("no_migration")),
                cost_cell(rivals.get("clairvoyant")),
                comparison_cell(v, "cost_reduction_vs_best_baseline"),
                comparison_cell(v, "cost_vs_best_of_least_loaded_and_hpa"),
                _gap_cell(v),
                t["oracle"]["gap_to_floor_with_boot_pct"],
            ]
        )
    return markdown_table(
        [
            "trace",
            "ts GPU-h @ 99%",
            "adaptive GPU-h",
            "adaptive stall-adj. %",
            "adaptive p99 ms",
            "best static",
            "its GPU-h",
            "hpa GPU-h @ 99%",
            "ll_autoscale GPU-h @ 99%",
            "no-migr. GPU-h @ 99%",
            "clairv. GPU-h @ 99%",
            "cost red. vs static %",
            "vs best of ll/hpa %",
            "gap clairv. @ 99% %",
            "gap boot-floor %",
        ],
        rows,
    )


def _gap_cell(v: dict[str, Any]) -> float | str | None:
    """Our cost over the clairvoyant's at the service level, minus 1 (%), or who missed it."""
    if "gap_to_clairvoyant_at_slo_pct" not in v:
        return None
    who = [
        name
        for name, entry in (
            ("turboserve", v["turboserve"]),
            ("clairvoyant", v["rivals"]["clairvoyant"]),
        )
        if not entry["reached"]
    ]
    if who:
        return f"not reached ({', '.join(who)})"
    bound = v.get("gap_to_clairvoyant_at_slo_bound")
    gap = float(v["gap_to_clairvoyant_at_slo_pct"])
    return f"{gap:+.1f} ({bound})" if bound else gap


def _oracle_text(og: dict[str, Any], total: int) -> str:
    text = "-" if og["avg"] is None else f"{og['avg']:.1f} ({og['max']:.1f})"
    if "traces_averaged" not in og:  # a document written before the gap named its traces
        return text
    left = og["left_out"]
    return (
        text
        + f"; {og['traces_averaged']} of {total} traces"
        + (f"; left out: {', '.join(left)} (our p99 outside its sweep)" if left else "")
    )


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}"


def _avg_min(block: dict[str, Any]) -> str:
    if block["avg_vs_best_baseline"] is None:
        return "-"
    return f"{block['avg_vs_best_baseline']:.1f} ({block['worst_vs_best_baseline']:.1f})"


def _lost(block: dict[str, Any]) -> str:
    lost = block.get("turboserve_not_reached_where_a_rival_reaches") or []
    return f"; turboserve alone misses it on {', '.join(lost)}" if lost else ""


def _profiles_table(by_profile: dict[str, Any]) -> str:
    """The headline figures for each latency profile (the service-level ones over the traces
    where both sides reach the level, with how many that is)."""
    rows = []
    for name, doc in by_profile.items():
        s = doc["summary"]
        blocks = summary_blocks(s, doc["traces"])
        slo = blocks["cost_reduction_at_matched_slo_pct"]
        robust = blocks["robustness"]
        rows.append(
            [
                name,
                doc["config"]["capacity"],
                slo["avg_vs_best_baseline"],
                f"{slo['traces_averaged']} of {len(slo['per_trace'])}",
                s["cost_reduction_at_matched_latency_pct"]["avg_vs_best_baseline"],
                s["latency_reduction_at_matched_cost_pct"]["avg_vs_best_baseline"],
                s["ablation_cost_increase_pct"]["no_migration"],
                s["ablation_cost_increase_pct"]["no_autoscale"],
                s.get("gap_to_boot_aware_floor_pct", {}).get("avg"),
                robust["max_cost_above_best_of_least_loaded_and_hpa_pct"],
                f"{robust['traces_compared']} of {len(robust['per_trace'])}",
            ]
        )
    return markdown_table(
        [
            "profile",
            "K",
            "cost red. @ 99% service %",
            "traces averaged",
            "cost red. @ matched p99 %",
            "p99 red. @ matched cost %",
            "no-migr. +%",
            "no-autosc. +%",
            "gap boot-floor %",
            "max above ll/hpa %",
            "traces compared",
        ],
        rows,
    )


def _bound_text(s: dict[str, Any]) -> str:
    """'yes' plus how many runs the trace floor was checked on: runs that left sessions
    waiting are held to their own served-slot bound only, and the count says so."""
    verdict = "yes" if s["oracle_is_lower_bound"] else "NO"
    n = s.get("lower_bound_runs")
    if not n:
        return verdict
    return (
        f"{verdict}: served-slot bound on {n['runs']} of {n['runs']} runs; floor on "
        f"{n['checked_against_floor']} ({n['excluded_from_floor_check']} runs left "
        f"sessions waiting and are not held to it)"
    )


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _per_trace_table(traces: dict[str, Any]) -> str:
    rows = []
    for name, t in traces.items():
        ts = t["turboserve"]
        bb = t["best_baseline"]
        o = t["oracle"]
        rows.append(
            [
                name,
                ts["cost_gpu_hours"],
                ts["latency_ms"]["p99"],
                100 * ts["deadline_attainment"],
                100 * ts["stall_adjusted_attainment"],
                bb["latency_reduction_at_matched_cost_pct"],
                bb["latency_best_baseline"],
                bb["cost_reduction_at_matched_latency_pct"],
                bb["cost_best_baseline"],
                t["ablation"]["no_migration"]["cost_increase_pct"],
                t["ablation"]["no_autoscale"]["cost_increase_pct"],
                _gap_or_outside(
                    o["gap_to_clairvoyant_matched_latency_pct"], o["clairvoyant_match_in_range"]
                ),
                o["gap_to_clairvoyant_same_rho_pct"],
                o["gap_to_floor_pct"],
                o["gap_to_floor_with_boot_pct"],
            ]
        )
    return markdown_table(
        [
            "trace",
            "cost GPU-h",
            "p99 ms",
            "attain %",
            "stall-adj. %",
            "lat. red. %",
            "vs",
            "cost red. %",
            "vs",
            "no-migr. +%",
            "no-autosc. +%",
            "gap clairv. %",
            "same-rho %",
            "gap floor %",
            "gap boot-floor %",
        ],
        rows,
    )


def _rivals_table(traces: dict[str, Any]) -> str:
    rows = []
    for name, t in traces.items():
        for rival in (*STATIC_BASELINES, *STRONG_RIVALS):
            v = t["vs"][rival]
            rows.append(
                [
                    name,
                    rival,
                    v["rival_latency_ms"],
                    v["latency_reduction_at_matched_cost_pct"],
                    v["latency_match_in_range"],
                    v["rival_cost_gpu_hours"],
                    v["cost_reduction_at_matched_latency_pct"],
                    v["cost_match_in_range"],
                ]
            )
    return markdown_table(
        [
            "trace",
            "rival",
            "rival p99 @ our cost",
            "lat. red. %",
            "in range",
            "rival cost @ our p99",
            "cost red. %",
            "in range",
        ],
        rows,
    )


def _predictive_table(traces: dict[str, Any]) -> str:
    rows = []
    for name, t in traces.items():
        p = t["predictive"]
        rows.append(
            [
                name,
                p["cost_gpu_hours"],
                t["turboserve"]["cost_gpu_hours"],
                p["p99_ms"],
                t["turboserve"]["latency_ms"]["p99"],
                100 * p["attainment"],
                100 * p["turboserve_attainment"],
                p["gap_to_floor_pct"],
                t["oracle"]["gap_to_floor_pct"],
                p["cost_vs_turboserve_matched_attainment_pct"],
                p["cost_vs_turboserve_matched_p99_pct"],
            ]
        )
    return markdown_table(
        [
            "trace",
            "pred. GPU-h",
            "ts GPU-h",
            "pred. p99",
            "ts p99",
            "pred. attain %",
            "ts attain %",
            "pred. floor gap %",
            "ts floor gap %",
            "cost vs ts @ attain. %",
            "cost vs ts @ p99 %",
        ],
        rows,
    )


def _sensitivity_tables(traces: dict[str, Any]) -> str:
    boot_rows, mig_rows = [], []
    for name, t in traces.items():
        for b, v in t["sensitivity"]["boot_delay_s"].items():
            boot_rows.append(
                [
                    name,
                    b,
                    v["turboserve_cost_gpu_hours"],
                    v["turboserve_p99_ms"],
                    100 * v["turboserve_attainment"],
                    v["clairvoyant_cost_gpu_hours"],
                    v["floor_with_boot_gpu_hours"],
                    _gap_or_outside(
                        v.get("gap_to_clairvoyant_matched_latency_pct"),
                        v.get("clairvoyant_match_in_range", True),
                    ),
                    v["gap_to_clairvoyant_same_rho_pct"],
                    v["gap_to_floor_with_boot_pct"],
                    v["latency_reduction_vs_best_baseline_pct"],
                    v["cost_reduction_vs_best_baseline_pct"],
                ]
            )
        for link, v in t["sensitivity"]["migration"].items():
            mig_rows.append(
                [
                    name,
                    link,
                    v["turboserve_cost_gpu_hours"],
                    v["turboserve_p99_ms"],
                    v["migrations"],
                    v["no_migration_cost_gpu_hours"],
                    v["no_migration_p99_ms"],
                    v["no_migration_cost_increase_pct"],
                ]
            )
    boot = markdown_table(
        [
            "trace",
            "boot s",
            "ts GPU-h",
            "ts p99",
            "ts attain %",
            "clairv. GPU-h",
            "boot-floor GPU-h",
            "gap clairv. (matched p99) %",
            "gap clairv. (same rho) %",
            "gap boot-floor %",
            "lat. red. vs best base %",
            "cost red. vs best base %",
        ],
        boot_rows,
    )
    mig = markdown_table(
        [
            "trace",
            "link",
            "ts GPU-h",
            "ts p99",
            "migrations",
            "no-migr. GPU-h",
            "no-migr. p99",
            "no-migr. cost +%",
        ],
        mig_rows,
    )
    return boot + "\n\n" + mig


def _by_boot_table(by_boot: dict[str, Any], total: int) -> str:
    rows = [
        [
            b,
            v["latency_reduction_vs_best_baseline_pct"],
            v["cost_reduction_vs_best_baseline_pct"],
            _matched_gap_cell(v, total),
            v["gap_to_clairvoyant_same_rho_pct"],
            v["gap_to_floor_with_boot_pct"],
        ]
        for b, v in by_boot.items()
    ]
    return markdown_table(
        [
            "boot delay s",
            "lat. red. at matched cost %",
            "cost red. at matched p99 %",
            "gap to clairvoyant (matched p99) %",
            "gap to clairvoyant (same rho) %",
            "gap to boot-aware floor %",
        ],
        rows,
    )


def _gap_or_outside(gap: float | None, in_range: bool) -> float | str | None:
    """A gap to the clairvoyant at matched p99, or why there is none: our p99 lies outside
    its sweep, where its cost is a clamp to an end of the sweep, not a cost."""
    return gap if in_range else "our p99 outside its sweep"


def _matched_gap_cell(v: dict[str, Any], total: int) -> float | str | None:
    """The gap to the clairvoyant at matched p99, averaged where its sweep reaches our p99."""
    gap = v.get("gap_to_clairvoyant_matched_latency_pct")
    n = v.get("gap_to_clairvoyant_matched_latency_traces")
    if n is None or n == total:
        return gap
    if gap is None:
        return f"not reached on any of {total} traces (our p99 outside its sweep)"
    return f"{gap:.1f} ({n} of {total} traces)"


def _missing_at_cap(traces: dict[str, Any]) -> str:
    missing = [
        f"{name}: {', '.join(t['sweep_extension']['not_reached_at_cap'])}"
        for name, t in traces.items()
        if t.get("sweep_extension", {}).get("not_reached_at_cap")
    ]
    return (
        ("not reached at the cap: " + "; ".join(missing)) if missing else "every sweep reached it"
    )


def markdown_report(document: dict[str, Any]) -> str:
    """The report of one evaluation document; every heading says the traces' scale. A
    document of several scales (``by_scale``) gets the gap to the clairvoyant at each scale
    after its summary, and each further scale's report at its end."""
    traces = document["traces"]
    at = f"scale {document.get('scale', 1)}"
    parts = [
        f"## Summary ({at}; {len(traces)} traces averaged; 'best baseline' = best of the "
        f"paper's three; profile {document['config']['profile']})",
        _summary_table(document["summary"], traces),
        f"### The headline against the best baseline at each GPU boot delay (averages; {at})",
        _by_boot_table(document["summary"]["by_boot_delay_s"], len(traces)),
        f"## Cost to serve 99% of chunk periods on time (stall-adjusted), per trace ({at})",
        _service_table(traces),
        f"## Per trace ({at})",
        _per_trace_table(traces),
        f"## Matched comparisons against every rival ({at})",
        _rivals_table(traces),
        f"## Predictive scaler against turboserve ({at})",
        _predictive_table(traces),
        f"## Sensitivity: GPU boot delay and migration cost ({at})",
        _sensitivity_tables(traces),
    ]
    if any(t.get("quality_budget") for t in traces.values()):
        parts += [
            f"## The quality budget: turboserve_q at 99% of chunk periods on time with at "
            f"most 1% / 5% of chunks at fewer steps ({at})",
            quality_table({"traces": traces}),
        ]
    if document.get("by_profile") and len(document["by_profile"]) > 1:
        parts[2:2] = [
            f"## Both latency profiles (what TurboServe gains when a GPU batches "
            f"well, and when it does not; {at})",
            _profiles_table(document["by_profile"]),
        ]
    by_scale = document.get("by_scale") or {}
    if len(by_scale) > 1:
        parts[2:2] = [
            "## Gap to the clairvoyant at 99% of chunk periods on time, by scale "
            "(our cost over its, minus 1)",
            _gap_by_scale_table(by_scale),
        ]
    cfg = document["config"]
    parts.append(
        f"_{cfg['runs']} simulator runs, {cfg['wall_s']} s, "
        f"{'quick' if cfg['quick'] else 'full'} sweep, scale {cfg.get('scale', 1)}, "
        f"profile {cfg['profile']}, "
        f"K = {cfg['capacity']}, boot delay {cfg['boot_delay_s']:g} s, "
        f"rho_hat table sha256 {cfg.get('rho_table_sha256') or 'none (fixed 0.7)'}._"
    )
    ext = cfg.get("sweep_extension")
    if ext:
        parts.append(
            f"_Sweeps that missed {100 * SLO_ATTAINMENT:g}% were extended ({ext['runs']} of the "
            f"runs): autoscalers' headroom knob down to {ext['headroom_cap']:g}, static pools "
            f"up to {ext['static_cap_factor']:g}x the GPUs the peak needs at K; "
            f"{_missing_at_cap(traces)}._"
        )
    for key, entry in by_scale.items():
        if key == str(document.get("scale", 1)):
            continue
        profiles = entry["by_profile"]
        first = next(iter(profiles.values()))
        parts.append(
            markdown_report({**first, "by_profile": profiles, "scale": entry["scale"]}).rstrip("\n")
        )
    return "\n\n".join(parts) + "\n"


def write_plots(evaluation: Any, folder: str | Path) -> list[Path]:
    """Cost-latency curves per trace; GPUs over time and latency CDF for the plot trace."""
    from lab.eval.plots import (
        plot_cost_latency,
        plot_gpus_over_time,
        plot_latency_cdf,
    )

    out_dir = Path(folder)
    written = []
    shown = (
        *STATIC_BASELINES,
        "hpa",
        "least_loaded_autoscale",
        "clairvoyant",
        "turboserve_predictive",
        "turboserve",
    )
    for name, runs in evaluation.runs.items():
        curves: dict[str, list[CurvePoint]] = {}
        ours = None
        for r in runs:
            if r.spec.curve in shown:
                curves.setdefault(r.spec.curve, []).append(CurvePoint(r.cost_gpu_h, r.p99_ms))
                if r.spec.curve == "turboserve" and r.spec.param("rho_hat") is None:
                    ours = CurvePoint(r.cost_gpu_h, r.p99_ms)
        floor_h = evaluation.floors[name].floor_h
        written.append(
            plot_cost_latency(
                curves,
                out_dir / f"cost_latency_{name}.png",
                title=f"{name}: cost vs p99 per-chunk latency",
                highlight={"turboserve (adaptive rho_hat)": ours} if ours else None,
                floor_cost=floor_h,
            )
        )
    name = evaluation.plot_trace
    if name is not None:
        runs = evaluation.runs[name]
        detailed = [r for r in runs if r.timeline is not None]
        series = {}
        for r in detailed:
            if r.spec.curve in ("turboserve", "clairvoyant", "hpa", "turboserve_predictive"):
                ts = [p[0] for p in r.timeline]
                series[r.spec.curve] = (ts, [p[1] for p in r.timeline])
        fl = evaluation.floors[name]
        demand = ([s.t for s in fl.steps], [-(-s.active // fl.capacity) for s in fl.steps])
        written.append(
            plot_gpus_over_time(
                series,
                demand,
                out_dir / f"gpus_over_time_{name}.png",
                title=f"{name}: GPUs held vs demand",
            )
        )
        # Autoscalers at their adaptive point; each static baseline at the GPU count whose
        # cost is closest to turboserve's (matched cost).
        ours_cost = next(
            (
                r.cost_gpu_h
                for r in detailed
                if r.spec.curve == "turboserve" and r.spec.param("rho_hat") is None
            ),
            None,
        )
        lat = {}
        for r in detailed:
            if r.spec.param("gpus") is None and r.latencies_ms:
                lat[r.spec.curve] = r.latencies_ms
        for base in STATIC_BASELINES:
            candidates = [r for r in detailed if r.spec.curve == base and r.latencies_ms]
            if candidates and ours_cost is not None:
                r = min(candidates, key=lambda r: abs(r.cost_gpu_h - ours_cost))
                lat[f"{base} ({r.spec.param('gpus')} GPUs, ~matched cost)"] = r.latencies_ms
        deadline = None
        if detailed:
            from shared.profile import load_profile

            deadline = load_profile(detailed[0].spec.profile).deadline_ms
        written.append(
            plot_latency_cdf(
                lat,
                out_dir / f"latency_cdf_{name}.png",
                title=f"{name}: per-chunk latency tail (1 - CDF)",
                deadline_ms=deadline,
            )
        )
    return written
