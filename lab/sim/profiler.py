"""Offline profiler for the adaptive rho_hat table (``turboserve sim profile``).

The paper: measure the volatility of activations over a sliding window, quantise it into 10
levels, and for each level grid-search the parameters that cost least while meeting the
deadline. How we do it:

1. **Training traces** are :func:`synth.training_traces`: every shape on seeds disjoint from
   the six evaluation traces, with jittered session dynamics. The table never sees the
   evaluation traces.
2. **Levels.** The core's own :class:`VolatilityTracker` (same window and bin) is replayed over
   each training trace; the 9 level edges are the deciles of the pooled per-bin values, so each
   level holds a tenth of the training time.
3. **Grid.** ``turboserve`` runs every training trace with each fixed (rho_hat, delta, idle
   reserve, scale-in delay, peak cap); the reserve is the share of idle sessions sized for as
   if active (``ControllerConfig.idle_reserve``; ``FULL_RESERVES``, ``--idle-reserve 0`` for
   none), the delay the scale-in stabilisation window (``FULL_DELAYS``: the pool never shrinks
   below the highest target of that many seconds past), the cap the utilisation at which the
   last 300 s's peak bounds the pool outside a surge beyond it (``FULL_PEAK_RHOS``, 0: none;
   ``loop.Controller``). Each bin's GPU-seconds, its on-time chunks and its missed chunk
   periods (``sim/viewer.py``) are attributed to the bin's volatility level (attribution is
   approximate: a choice's effect lags by about a boot delay).
4. **Choice per level**: the cheapest (rho_hat, delta, reserve, delay, cap) whose chunk periods at
   that level, pooled over the training traces, are served on time at least ``target``
   (default 99%) of the time: the stall-adjusted attainment, where a viewer frozen for 60 s
   misses 48 periods, not one chunk (rule ``stall``; rule ``deadline`` counts chunks
   delivered instead). Where no grid point reaches the target at a level, the most
   punctual one is taken and the table's ``source`` says so.
5. The table is written where the callers load it from (``shipped/rho_table.json``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NotRequired, TypedDict

from lab.sim.traceio import Trace
from services.scheduler.core.autoscale import (
    DEFAULT_BIN_S,
    DEFAULT_SIGNAL,
    DEFAULT_WINDOW_S,
    LEVELS,
    RhoTable,
    VolatilityTracker,
)
from services.scheduler.shipped import save_rho_table
from shared.profile import LatencyProfile
from shared.quantiles import quantile, quantiles

FULL_GRID = {"rho_hat": (0.5, 0.6, 0.7, 0.8, 0.9, 0.95), "delta": (0.1,)}
QUICK_GRID = {"rho_hat": (0.6, 0.75, 0.9), "delta": (0.1,)}
# Share of idle sessions sized for as if active (``ControllerConfig.idle_reserve``), searched
# with (rho_hat, delta) at every level; ``--idle-reserve 0`` searches none.
FULL_RESERVES = (0.0, 0.25, 0.5)
QUICK_RESERVES = (0.0, 0.5)
# Scale-in stabilisation windows in seconds (``scale_in_delay_s``: the pool never shrinks below
# the highest target of the window).
FULL_DELAYS = (0.0, 60.0, 300.0)
QUICK_DELAYS = (0.0, 60.0)
# Peak caps (``peak_rho``: outside a surge beyond it, the pool never holds more than the last
# 300 s's peak active count needs at that utilisation; 0: no cap).
FULL_PEAK_RHOS = (0.0, 0.85, 1.0)
QUICK_PEAK_RHOS = (0.0, 1.0)
DEFAULT_TARGET = 0.99


@dataclass(frozen=True, slots=True)
class LevelStats:
    """One grid point's outcome restricted to the bins of one volatility level."""

    gpu_seconds: float
    on_time: int  # chunks on time (``sim/viewer.py``: first chunks by their startup)
    chunks: int
    missed: int  # chunk periods missed: by late chunks, and by spells that ended overdue
    stream_p99_ms: float
    first_p99_ms: float


class GridPoint(TypedDict):
    """One training run at one fixed grid point (``_run_point``); ``--json`` writes it
    without ``levels``. A point without a reserve, delay or cap counts as 0 for it."""

    rho_hat: float
    delta: float
    idle_reserve: NotRequired[float]
    scale_in_delay_s: NotRequired[float]
    peak_rho: NotRequired[float]
    trace: str
    levels: dict[int, LevelStats]
    cost_gpu_seconds: float
    stall_adjusted_attainment: float
    p99_ms: float


class CheckRow(TypedDict):
    """One trace's line of :func:`check_table`: ``margin_pct`` is ``turboserve``'s p99 over
    each static baseline's at matched cost, in percent above it."""

    trace: str
    mean_gpus: float
    p99_ms: float
    margin_pct: dict[str, float]


# (trace, rho_hat, delta, idle reserve, scale-in delay, peak cap, each bin's level, bin
# seconds, boot delay, profile): the arguments of one grid run.
PointArgs = tuple[
    Trace, float, float, float, float, float, list[int | None], float, float, LatencyProfile
]


def volatility_levels(
    trace: Trace,
    window_s: float = DEFAULT_WINDOW_S,
    bin_s: float = DEFAULT_BIN_S,
    signal: str = DEFAULT_SIGNAL,
) -> list[float | None]:
    """The core tracker's ``signal`` at the start of every bin of ``trace`` (None while
    warming up)."""
    tracker = VolatilityTracker(window_s, bin_s, signal)
    tracker.observe(0.0)
    n_bins = int(math.ceil(trace.duration / bin_s))
    out: list[float | None] = []
    events = trace.events
    i = 0
    for b in range(n_bins):
        t = b * bin_s
        while i < len(events) and events[i].t < t:
            if events[i].event in ("arrive", "active"):
                tracker.record(events[i].t)
            i += 1
        out.append(tracker.value(t))
    return out


def level_edges(samples: list[float]) -> tuple[float, ...]:
    """Deciles of the pooled volatility samples: 9 ascending edges between 10 levels."""
    ordered = sorted(samples)
    if not ordered:
        raise ValueError("no volatility samples: training traces too short for the window")
    return tuple(
        round(edge, 4) for edge in quantiles(ordered, [k / LEVELS for k in range(1, LEVELS)])
    )


def per_level_stats(
    result: Any, bin_levels: list[int | None], bin_s: float
) -> dict[int, LevelStats]:
    """Attribute a run's GPU-seconds, chunks and missed periods to the volatility level of
    their bin (the run needs ``keep_chunk_times``)."""
    n_bins = len(bin_levels)
    gpu_s = [0.0] * n_bins
    timeline = result.timeline + [(result.duration_s, 0, 0)]
    for (t0, held, _), (t1, _, _) in zip(timeline, timeline[1:], strict=False):
        # Spread each constant stretch of `held` GPUs over the bins it covers.
        t = t0
        while t < t1:
            b = min(int(t // bin_s), n_bins - 1)
            stop = min(t1, (b + 1) * bin_s)
            gpu_s[b] += held * (stop - t)
            t = stop if stop > t else t1

    def level_at(t: float) -> int | None:
        return bin_levels[min(int(t // bin_s), n_bins - 1)]

    stream: dict[int, list[float]] = {}
    first: dict[int, list[float]] = {}
    on_time: dict[int, int] = {}
    missed: dict[int, int] = {}
    for t, lat, is_first, miss in zip(
        result.chunk_times_s,
        result.latencies_ms,
        result.first_flags,
        result.chunk_missed,
        strict=True,
    ):
        level = level_at(t)
        if level is None:
            continue
        (first if is_first else stream).setdefault(level, []).append(lat)
        if miss:
            missed[level] = missed.get(level, 0) + miss
        else:
            on_time[level] = on_time.get(level, 0) + 1
    for t, miss in result.missed_at:
        level = level_at(t)
        if level is not None:
            missed[level] = missed.get(level, 0) + miss
    out: dict[int, LevelStats] = {}
    for level in range(LEVELS):
        cost = sum(g for g, lv in zip(gpu_s, bin_levels, strict=True) if lv == level)
        s, f = stream.get(level, []), first.get(level, [])
        out[level] = LevelStats(
            cost,
            on_time.get(level, 0),
            len(s) + len(f),
            missed.get(level, 0),
            quantile(s, 0.99),
            quantile(f, 0.99),
        )
    return out


def _run_point(args: PointArgs) -> GridPoint:
    from lab.sim.simulator import simulate

    trace, rho, delta, reserve, delay, peak, bin_levels, bin_s, boot_delay_s, profile = args
    result = simulate(
        trace,
        "turboserve",
        profile,
        boot_delay_s=boot_delay_s,
        rho_hat=rho,
        delta=delta,
        idle_reserve=reserve,
        scale_in_delay_s=delay,
        peak_rho=peak,
        keep_chunk_times=True,
    )
    return {
        "rho_hat": rho,
        "delta": delta,
        "idle_reserve": reserve,
        "scale_in_delay_s": delay,
        "peak_rho": peak,
        "trace": trace.name,
        "levels": per_level_stats(result, bin_levels, bin_s),
        "cost_gpu_seconds": result.cost_gpu_seconds,
        "stall_adjusted_attainment": result.stall_adjusted_attainment,
        "p99_ms": result.latency()["p99"],
    }


RULES = ("stall", "deadline")
DEFAULT_RULE = "stall"
DEFAULT_POOL = 1


def choose(
    points: list[GridPoint],
    level: int,
    target: float,
    rule: str = DEFAULT_RULE,
    pool: int = 0,
    max_rho: float | None = None,
) -> tuple[float, float, bool, dict[str, float]]:
    """The cheapest (rho_hat, delta, idle reserve, scale-in delay, peak cap) at ``level``
    whose pooled service share reaches ``target``; else the most punctual one. Ties go to the
    higher rho_hat, then the smaller reserve, then the shorter delay, then no cap. The chosen
    reserve, delay and cap are ``stats["idle_reserve"]``, ``stats["scale_in_delay_s"]`` and
    ``stats["peak_rho"]`` (0 for points without).

    ``rule`` says what is counted: ``"stall"``, chunk periods served on time (on-time chunks
    over on-time chunks plus missed periods: the stall-adjusted attainment); ``"deadline"``,
    chunks delivered on time. ``pool`` also counts the chunks and cost of the ``pool``
    neighbouring levels on each side (smoothing the per-bin attribution noise); ``max_rho``
    leaves out points above it (the monotone pass of :func:`choose_table`)."""
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r} (known: {', '.join(RULES)})")
    window = [lv for lv in range(level - pool, level + pool + 1) if 0 <= lv < LEVELS]
    by_config: dict[tuple[float, float, float, float, float], list[LevelStats]] = {}
    for p in points:
        if max_rho is not None and p["rho_hat"] > max_rho + 1e-9:
            continue
        key = (
            p["rho_hat"],
            p["delta"],
            p.get("idle_reserve", 0.0),
            p.get("scale_in_delay_s", 0.0),
            p.get("peak_rho", 0.0),
        )
        by_config.setdefault(key, []).extend(p["levels"][lv] for lv in window if lv in p["levels"])
    if not by_config:
        raise ValueError(f"no grid point at or below rho_hat {max_rho}")
    scored = []
    for (rho, delta, reserve, delay, peak), stats in sorted(by_config.items()):
        good = sum(s.on_time for s in stats)
        total = (
            good + sum(s.missed for s in stats) if rule == "stall" else sum(s.chunks for s in stats)
        )
        share = good / total if total else 1.0
        cost = sum(s.gpu_seconds for s in stats)
        scored.append((share, cost, rho, delta, reserve, delay, total, peak))
    feasible = [s for s in scored if s[0] >= target]
    if feasible:
        # On a tie, no cap (0) before any cap.
        best = min(feasible, key=lambda s: (s[1], -s[2], s[4], s[5], s[7] > 0))
    else:
        best = max(scored, key=lambda s: (s[0], -s[1]))
    share, cost, rho, delta, reserve, delay, total, peak = best
    return (
        rho,
        delta,
        bool(feasible),
        {
            "on_time": round(share, 5),
            "gpu_seconds": round(cost, 1),
            "periods": total,
            "idle_reserve": reserve,
            "scale_in_delay_s": delay,
            "peak_rho": peak,
        },
    )


def choose_table(
    points: list[GridPoint],
    target: float,
    rule: str = DEFAULT_RULE,
    pool: int = DEFAULT_POOL,
    monotone: bool = True,
) -> list[tuple[float, float, bool, dict[str, float]]]:
    """:func:`choose` at every level, calmest first. With ``monotone`` a level never gets a
    higher rho_hat than the calmer level below it: where its own choice is higher, it is chosen
    again among the points at or below that rho_hat. Since a lower rho_hat (more GPUs) hardly
    ever makes chunks later, this is the cheapest non-increasing table that meets the target
    wherever the per-level choices do."""
    out: list[tuple[float, float, bool, dict[str, float]]] = []
    for level in range(LEVELS):
        pick = choose(points, level, target, rule, pool)
        if monotone and out and pick[0] > out[-1][0] + 1e-9:
            pick = choose(points, level, target, rule, pool, max_rho=out[-1][0])
        out.append(pick)
    return out


def build_table(
    *,
    quick: bool = False,
    out: Path | None = None,
    boot_delay_s: float = 30.0,
    profile_name: str | None = None,
    jobs: int = 1,
    json_out: Path | None = None,
    target: float = DEFAULT_TARGET,
    rule: str = DEFAULT_RULE,
    pool: int = DEFAULT_POOL,
    monotone: bool = True,
    signal: str = DEFAULT_SIGNAL,
    idle_reserves: tuple[float, ...] | None = None,
    scale_in_delays: tuple[float, ...] | None = None,
    peak_rhos: tuple[float, ...] | None = None,
    rho_hats: tuple[float, ...] | None = None,
    log: Callable[[str], None] = print,
) -> RhoTable:
    from lab.sim import synth
    from shared.profile import load_profile

    started = time.perf_counter()
    profile = load_profile() if profile_name is None else load_profile(profile_name)
    grid = dict(QUICK_GRID if quick else FULL_GRID)
    if rho_hats is not None:
        if not rho_hats or any(not 0 < x <= 1 for x in rho_hats):
            raise ValueError(f"rho_hat values must be in (0, 1], got {list(rho_hats)}")
        grid["rho_hat"] = tuple(sorted(set(rho_hats)))
    traces = synth.training_traces(
        duration_s=900.0 if quick else 1200.0, variants=1 if quick else 2
    )
    window_s, bin_s = DEFAULT_WINDOW_S, DEFAULT_BIN_S
    raw_levels = {tr.name: volatility_levels(tr, window_s, bin_s, signal) for tr in traces}
    edges = level_edges([v for vals in raw_levels.values() for v in vals if v is not None])
    probe = RhoTable(edges, (0.5,) * LEVELS, (0.1,) * LEVELS, signal=signal)
    bin_levels = {
        name: [None if v is None else probe.level(v) for v in vals]
        for name, vals in raw_levels.items()
    }
    if idle_reserves is None:
        idle_reserves = QUICK_RESERVES if quick else FULL_RESERVES
    reserves = tuple(sorted(set(idle_reserves))) or (0.0,)
    if any(not 0 <= x <= 1 for x in reserves):
        raise ValueError(f"idle reserves must be in [0, 1], got {list(reserves)}")
    if scale_in_delays is None:
        scale_in_delays = QUICK_DELAYS if quick else FULL_DELAYS
    delays = tuple(sorted(set(scale_in_delays))) or (0.0,)
    if any(not (math.isfinite(x) and x >= 0) for x in delays):
        raise ValueError(f"scale-in delays must be >= 0, got {list(delays)}")
    if peak_rhos is None:
        peak_rhos = QUICK_PEAK_RHOS if quick else FULL_PEAK_RHOS
    peaks = tuple(sorted(set(peak_rhos))) or (0.0,)
    if any(not 0 <= x <= 1 for x in peaks):
        raise ValueError(f"peak caps must be in [0, 1] (0: no cap), got {list(peaks)}")
    log(
        f"profiler: {len(traces)} training traces, grid {len(grid['rho_hat'])} rho_hat x "
        f"{len(grid['delta'])} delta x {len(reserves)} idle reserve x {len(delays)} scale-in "
        f"delay x {len(peaks)} peak cap, {signal} level edges {list(edges)}"
    )
    tasks = [
        (tr, rho, delta, reserve, delay, peak, bin_levels[tr.name], bin_s, boot_delay_s, profile)
        for rho in grid["rho_hat"]
        for delta in grid["delta"]
        if delta < rho
        for reserve in reserves
        for delay in delays
        for peak in peaks
        for tr in traces
    ]
    points = _map(tasks, jobs, log)
    rhos, deltas, picked_reserves, picked_delays, picked_peaks, notes, chosen = (
        [],
        [],
        [],
        [],
        [],
        [],
        [],
    )
    picks = choose_table(points, target, rule, pool, monotone)
    for level, (rho, delta, ok, stats) in enumerate(picks):
        rhos.append(rho)
        deltas.append(delta)
        picked_reserves.append(stats["idle_reserve"])
        picked_delays.append(stats["scale_in_delay_s"])
        picked_peaks.append(stats["peak_rho"])
        chosen.append({"level": level, "rho_hat": rho, "delta": delta, "feasible": ok, **stats})
        if not ok:
            notes.append(str(level))
        log(
            f"  level {level}: rho_hat {rho:.2f} delta {delta:.2f} "
            f"idle reserve {stats['idle_reserve']:.2f} "
            f"scale-in delay {stats['scale_in_delay_s']:g} s "
            f"peak cap {stats['peak_rho'] or 'none'} "
            f"{'meets' if ok else 'MOST PUNCTUAL (none meets the target)'} {stats}"
        )
    what = "chunk periods served on time (stall-adjusted)" if rule == "stall" else "chunks on time"
    source = (
        f"turboserve sim profile{' --quick' if quick else ''}: {len(traces)} training "
        f"traces (seeds 1000+), boot delay {boot_delay_s:g} s, profile {profile.name}, "
        f"paced chunks, signal {signal}, constraint: >= {target:.1%} of {what}, "
        f"levels pooled +-{pool}{', rho_hat non-increasing' if monotone else ''}"
        + (f", idle reserve grid {list(reserves)}" if reserves != (0.0,) else "")
        + (f", scale-in delay grid {list(delays)}" if delays != (0.0,) else "")
        + (f", peak cap grid {list(peaks)}" if peaks != (0.0,) else "")
    )
    if notes:
        source += f"; no grid point met it at levels {', '.join(notes)} (most punctual taken)"
    table = RhoTable(
        edges,
        tuple(rhos),
        tuple(deltas),
        window_s,
        bin_s,
        source,
        signal,
        tuple(picked_reserves) if reserves != (0.0,) else (),
        tuple(picked_delays) if delays != (0.0,) else (),
        tuple(picked_peaks) if peaks != (0.0,) else (),
    )
    path = save_rho_table(table, out)
    log(f"wrote {path} in {time.perf_counter() - started:.0f} s")
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(
            json.dumps(
                {
                    "table": table.to_dict(),
                    "chosen": chosen,
                    "points": [{k: v for k, v in p.items() if k != "levels"} for p in points],
                },
                indent=2,
            )
            + "\n"
        )
    return table


def _map(tasks: list[PointArgs], jobs: int, log: Callable[[str], None]) -> list[GridPoint]:
    """Run the grid in order (serially, or in ``jobs`` forked workers), logging every 10%."""
    step = max(1, len(tasks) // 10)
    results: Iterator[GridPoint]
    if jobs <= 1:
        results = map(_run_point, tasks)
        pool = None
    else:
        import multiprocessing

        pool = multiprocessing.get_context("fork").Pool(jobs)
        results = pool.imap(_run_point, tasks)
    out: list[GridPoint] = []
    try:
        for i, point in enumerate(results, start=1):
            out.append(point)
            if i % step == 0 or i == len(tasks):
                log(f"  {i}/{len(tasks)} runs")
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    return out


STATIC_BASELINES = ("round_robin", "least_loaded", "memory_aware")


def static_p99_at_cost(
    trace: Trace,
    policy: str,
    cost_gpu_seconds: float,
    profile: Any = None,
    boot_delay_s: float = 30.0,
) -> float:
    """A static baseline's p99, linearly interpolated between the GPU counts around the mean
    GPU count that ``cost_gpu_seconds`` buys (the rule of the matched-cost test)."""
    from lab.sim.simulator import simulate

    g = cost_gpu_seconds / trace.duration
    lo, hi = max(1, math.floor(g)), max(1, math.ceil(g))
    p_lo = simulate(trace, policy, profile, boot_delay_s=boot_delay_s, gpus=lo).latency()["p99"]
    if hi == lo:
        return p_lo
    p_hi = simulate(trace, policy, profile, boot_delay_s=boot_delay_s, gpus=hi).latency()["p99"]
    return p_lo + (p_hi - p_lo) * (g - lo)


def check_table(
    table: Path | None = None,
    *,
    which: str = "both",
    boot_delay_s: float = 30.0,
    profile_name: str | None = None,
    log: Callable[[str], None] = print,
) -> list[CheckRow]:
    """``turboserve sim profile --check``: with the table at ``table`` (default: the shipped
    one), ``turboserve``'s p99 against each static baseline at matched cost, on the six
    built-in traces (``eval``), the training traces at 30 minutes (``train``) or both. A
    report only: nothing here feeds the table."""
    from lab.sim import synth
    from lab.sim.catalog import load_trace
    from lab.sim.simulator import simulate
    from services.scheduler.shipped import DEFAULT_TABLE_PATH, load_rho_table
    from shared.profile import load_profile

    profile = load_profile() if profile_name is None else load_profile(profile_name)
    path = Path(table) if table is not None else DEFAULT_TABLE_PATH
    rho_table = load_rho_table(path)
    if rho_table is None:  # only the default path may be absent, and ``path`` is explicit
        raise FileNotFoundError(f"rho table {path}: no such file")
    traces: list[Trace] = []
    if which in ("eval", "both"):
        traces += [load_trace(name) for name in synth.BUILTIN_NAMES]
    if which in ("train", "both"):
        traces += synth.training_traces(duration_s=1800.0, variants=2)
    log(f"table {path} (signal {rho_table.signal}, rho_hat {list(rho_table.rho_hat)})")
    log(
        "| trace | turboserve mean GPUs | p99 ms | "
        + " | ".join(f"vs {p}" for p in STATIC_BASELINES)
        + " |"
    )
    log("|---|---|---|" + "---|" * len(STATIC_BASELINES))
    rows: list[CheckRow] = []
    for trace in traces:
        ours = simulate(
            trace, "turboserve", profile, boot_delay_s=boot_delay_s, rho_table=rho_table
        )
        p99 = ours.latency()["p99"]
        margins = {
            p: 100.0
            * (
                p99 / static_p99_at_cost(trace, p, ours.cost_gpu_seconds, profile, boot_delay_s)
                - 1.0
            )
            for p in STATIC_BASELINES
        }
        row: CheckRow = {
            "trace": trace.name,
            "mean_gpus": ours.cost_gpu_seconds / trace.duration,
            "p99_ms": p99,
            "margin_pct": margins,
        }
        rows.append(row)
        log(
            f"| {trace.name} | {row['mean_gpus']:.2f} | {p99:.0f} | "
            + " | ".join(f"{margins[p]:+.1f}%" for p in STATIC_BASELINES)
            + " |"
        )
    worst = max(rows, key=lambda r: max(r["margin_pct"].values()))
    policy = max(worst["margin_pct"], key=worst["margin_pct"].__getitem__)
    log(f"least margin: {worst['margin_pct'][policy]:+.1f}% ({worst['trace']} vs {policy})")
    return rows
