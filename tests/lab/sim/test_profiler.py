"""The offline rho_hat profiler: level edges, attribution, choice, and the written table."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from lab.sim import profiler, synth
from lab.sim.profiler import LevelStats, choose, level_edges, per_level_stats
from lab.sim.traceio import make_trace
from services.scheduler.shipped import DEFAULT_TABLE_PATH, load_rho_table
from shared.profile import load_profile
from tests.scheduler.core.harness import build

PROFILE = load_profile()


def test_level_edges_are_the_deciles():
    edges = level_edges([float(x) for x in range(101)])  # 0..100: deciles at 10, 20, ... 90
    assert edges == tuple(float(10 * k) for k in range(1, 10))


def test_volatility_levels_follow_the_core_tracker():
    # 5 activations in bin 0, none after: std over complete bins is defined from bin 3 on.
    trace = make_trace(
        "v", [(0.1 * i, f"s{i}", "arrive") for i in range(5)] + [(60.0, "s0", "idle")]
    )
    values = profiler.volatility_levels(trace, window_s=300.0, bin_s=10.0, signal="std")
    assert values[:3] == [None, None, None]
    # Bins 0..2 hold counts 5, 0, 0: mean 5/3, std sqrt(25/3 - 25/9) = 2.357.
    assert values[3] == pytest.approx((25 / 3 - 25 / 9) ** 0.5)
    # The default signal, the index of dispersion: variance / mean = (50/9) / (5/3) = 10/3.
    assert profiler.volatility_levels(trace, window_s=300.0, bin_s=10.0)[3] == pytest.approx(10 / 3)


def test_per_level_stats_attributes_cost_chunks_and_missed_periods_to_bins():
    # Two bins of 10 s: level 0 then level 1. 2 GPUs for 15 s then 1 GPU for 5 s.
    result = SimpleNamespace(
        duration_s=20.0,
        timeline=[(0.0, 2, 0), (15.0, 1, 0)],
        chunk_times_s=[1.0, 2.0, 12.0, 13.0],
        latencies_ms=[0.0, 30.0, 900.0, 0.0],
        first_flags=[False, False, True, False],
        chunk_missed=[0, 1, 0, 0],
        missed_at=[(14.0, 5)],
    )
    stats = per_level_stats(result, [0, 1], 10.0)
    # Level 0: 2 GPUs x 10 s = 20 GPU-s; one chunk on time, one late by one period.
    assert stats[0].gpu_seconds == pytest.approx(20.0)
    assert (stats[0].on_time, stats[0].chunks, stats[0].missed) == (1, 2, 1)
    # Level 1: 2 x 5 + 1 x 5 = 15 GPU-s; two on time, and a spell that ended 5 periods overdue.
    assert stats[1].gpu_seconds == pytest.approx(15.0)
    assert (stats[1].on_time, stats[1].chunks, stats[1].missed) == (2, 2, 5)
    assert stats[2].chunks == 0


def _point(rho, share_ok, cost, missed=None, delay=0.0):
    levels = {
        0: LevelStats(cost, share_ok, 100, 100 - share_ok if missed is None else missed, 0.0, 0.0)
    }
    return {"rho_hat": rho, "delta": 0.1, "scale_in_delay_s": delay, "levels": levels}


def _table_point(rho, within_by_level, cost_by_level):
    levels = {
        lv: LevelStats(
            cost_by_level[lv], within_by_level[lv], 100, 100 - within_by_level[lv], 0.0, 0.0
        )
        for lv in range(10)
    }
    return {"rho_hat": rho, "delta": 0.1, "levels": levels}


def test_choose_rule_stall_counts_every_period_a_late_chunk_froze():
    # 0.7 delivers 99 of 100 chunks on time, but the late one froze its viewer 48 periods:
    # 99 / (99 + 48) of the periods on time. Counting chunks it meets 99%; counting periods
    # only 0.5 (nothing late) does.
    points = [_point(0.5, 100, 60.0), _point(0.7, 99, 40.0, missed=48)]
    assert choose(points, 0, 0.99, rule="deadline")[0] == 0.7
    assert choose(points, 0, 0.99, rule="stall")[0] == 0.5
    with pytest.raises(ValueError, match="unknown rule"):
        choose(points, 0, 0.99, rule="p95")


def test_choose_searches_the_scale_in_delay_too():
    quick = _point(0.8, 90, 30.0)
    patient = _point(0.8, 100, 35.0, delay=60.0)
    rho, _, ok, stats = choose([quick, patient], 0, target=0.99)
    assert (rho, ok, stats["scale_in_delay_s"]) == (0.8, True, 60.0)


def test_choose_table_pools_neighbours_and_is_monotone():
    # rho 0.8 is on time everywhere but at level 3; rho 0.4 everywhere. Level 6 alone says
    # 0.4 (noise: 0.8 misses there too), level 7 says 0.8 again.
    miss = {3: 90, 6: 98}
    within_08 = [miss.get(lv, 100) for lv in range(10)]
    points = [_table_point(0.8, within_08, [10.0] * 10), _table_point(0.4, [100] * 10, [20.0] * 10)]
    unpooled = profiler.choose_table(points, 0.99, pool=0, monotone=False)
    assert [p[0] for p in unpooled] == [0.8, 0.8, 0.8, 0.4, 0.8, 0.8, 0.4, 0.8, 0.8, 0.8]
    # Monotone: once a level needs 0.4, no burstier level gets more.
    mono = profiler.choose_table(points, 0.99, pool=0, monotone=True)
    assert [p[0] for p in mono] == [0.8] * 3 + [0.4] * 7
    # Pooled +-1: level 6 with 5 and 7 is 298/300 on time at 0.8, but 2..4 still miss.
    pooled = profiler.choose_table(points, 0.99, pool=1, monotone=False)
    assert [p[0] for p in pooled] == [0.8, 0.8, 0.4, 0.4, 0.4, 0.8, 0.8, 0.8, 0.8, 0.8]


def test_choose_takes_the_cheapest_point_on_time():
    points = [_point(0.3, 100, 90.0), _point(0.5, 99, 60.0), _point(0.7, 95, 40.0)]
    rho, delta, ok, stats = choose(points, 0, target=0.99)
    assert (rho, delta, ok) == (0.5, 0.1, True)
    assert stats["gpu_seconds"] == 60.0


def test_choose_falls_back_to_the_most_punctual():
    points = [_point(0.3, 97, 90.0), _point(0.5, 95, 60.0)]
    rho, _, ok, _ = choose(points, 0, target=0.99)
    assert (rho, ok) == (0.3, False)


@pytest.mark.slow
def test_build_table_end_to_end(tmp_path, monkeypatch):
    short = [
        synth.generate(synth.spec(name, seed=5000 + i, duration_s=420.0))
        for i, name in enumerate(("calm", "chaotic"))
    ]
    monkeypatch.setattr(synth, "training_traces", lambda **kw: short)
    monkeypatch.setattr(profiler, "QUICK_GRID", {"rho_hat": (0.4, 0.8), "delta": (0.1,)})
    monkeypatch.setattr(profiler, "QUICK_RESERVES", (0.0, 0.5))
    monkeypatch.setattr(profiler, "QUICK_DELAYS", (0.0, 60.0))
    monkeypatch.setattr(profiler, "QUICK_PEAK_RHOS", (0.0,))
    out = tmp_path / "rho.json"
    table = profiler.build_table(
        quick=True, out=out, json_out=tmp_path / "points.json", log=lambda line: None
    )
    loaded = load_rho_table(out)
    assert loaded == table
    assert set(loaded.rho_hat) <= {0.4, 0.8}
    assert "sim profile --quick" in loaded.source
    points = json.loads((tmp_path / "points.json").read_text())["points"]
    assert len(points) == 16  # 2 rho_hat x 1 delta x 2 idle reserves x 2 delays x 2 traces
    assert {p["idle_reserve"] for p in points} == {0.0, 0.5}
    assert {p["scale_in_delay_s"] for p in points} == {0.0, 60.0}
    assert len(loaded.idle_reserve) == 10 and set(loaded.idle_reserve) <= {0.0, 0.5}
    assert len(loaded.scale_in_delay_s) == 10 and set(loaded.scale_in_delay_s) <= {0.0, 60.0}
    # The core accepts it.
    policy = build("turboserve", PROFILE, rho_table=load_rho_table(out))
    assert policy.rho_table == table


def test_shipped_table_is_loadable_and_was_made_by_the_profiler():
    table = load_rho_table(DEFAULT_TABLE_PATH)
    assert table is not None
    assert "turboserve sim profile" in table.source
    assert all(0.25 <= r <= 0.95 for r in table.rho_hat)
    assert table.signal == "dispersion"
    # Burstier levels never get a higher target utilisation than calmer ones.
    assert all(a >= b for a, b in zip(table.rho_hat, table.rho_hat[1:], strict=False))


def test_choose_searches_the_peak_cap_too():
    """A cap is one more knob: the cheapest on-time point wins, and on a tie of cost the point
    without a cap does (it is the paper's rule)."""
    uncapped = _point(0.6, 100, 60.0)
    capped = {**_point(0.6, 99, 45.0), "peak_rho": 0.85}
    too_tight = {**_point(0.6, 90, 35.0), "peak_rho": 1.0}
    rho, _, ok, stats = choose([uncapped, capped, too_tight], 0, target=0.99)
    assert (rho, ok, stats["peak_rho"]) == (0.6, True, 0.85)
    tie = {**_point(0.6, 100, 60.0), "peak_rho": 1.0}
    assert choose([tie, uncapped], 0, target=0.99)[3]["peak_rho"] == 0.0


def test_choose_searches_the_idle_reserve_too():
    """A reserve is one more knob of a grid point: the cheapest on-time point wins whatever
    its reserve, and the pick reports it; points without one count as reserve 0."""
    no_reserve = _point(0.5, 99, 60.0)
    with_reserve = {**_point(0.7, 99, 50.0), "idle_reserve": 0.25}
    late_reserve = {**_point(0.8, 95, 40.0), "idle_reserve": 0.5}
    rho, delta, ok, stats = choose([no_reserve, with_reserve, late_reserve], 0, target=0.99)
    assert (rho, ok, stats["idle_reserve"]) == (0.7, True, 0.25)
    assert choose([no_reserve], 0, target=0.99)[3]["idle_reserve"] == 0.0
