"""The offline rho_hat profiler: level edges, attribution, choice, and the written table."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from services.scheduler.core.autoscale import DEFAULT_TABLE_PATH, load_rho_table
from services.scheduler.core.policies import get_policy
from services.scheduler.sim import profiler, synth
from services.scheduler.sim.profiler import LevelStats, choose, level_edges, per_level_stats
from services.scheduler.sim.traceio import make_trace


def test_level_edges_are_the_deciles():
    edges = level_edges([float(x) for x in range(101)])  # 0..100: deciles at 10, 20, ... 90
    assert edges == tuple(float(10 * k) for k in range(1, 10))


def test_volatility_levels_follow_the_core_tracker():
    # 5 activations in bin 0, none after: std over complete bins is defined from bin 3 on.
    trace = make_trace("v", [(0.1 * i, f"s{i}", "arrive") for i in range(5)] + [(60.0, "s0", "idle")])
    values = profiler.volatility_levels(trace, window_s=300.0, bin_s=10.0)
    assert values[:3] == [None, None, None]
    # Bins 0..2 hold counts 5, 0, 0: mean 5/3, std sqrt(25/3 - 25/9) = 2.357.
    assert values[3] == pytest.approx((25 / 3 - 25 / 9) ** 0.5)


def test_per_level_stats_attributes_cost_and_chunks_to_bins():
    # Two bins of 10 s: level 0 then level 1. 2 GPUs for 15 s then 1 GPU for 5 s.
    result = SimpleNamespace(
        duration_s=20.0, timeline=[(0.0, 2, 0), (15.0, 1, 0)],
        chunk_times_s=[1.0, 2.0, 12.0, 13.0], latencies_ms=[100.0, 300.0, 100.0, 900.0],
        first_flags=[False, False, True, False])
    stats = per_level_stats(result, [0, 1], 10.0, deadline_ms=200.0, startup_ms=500.0)
    # Level 0: 2 GPUs x 10 s = 20 GPU-s; chunks 100 (on time) and 300 (late) -> 1 of 2.
    assert stats[0].gpu_seconds == pytest.approx(20.0)
    assert (stats[0].on_time, stats[0].chunks) == (1, 2)
    # Level 1: 2 x 5 + 1 x 5 = 15 GPU-s; a first chunk at 100 (<= 500) and a late 900.
    assert stats[1].gpu_seconds == pytest.approx(15.0)
    assert (stats[1].on_time, stats[1].chunks) == (1, 2)
    assert stats[2].chunks == 0


def _point(rho, share_ok, cost):
    levels = {0: LevelStats(cost, share_ok, 100, 0.0, 0.0)}
    return {"rho_hat": rho, "delta": 0.1, "levels": levels}


def test_choose_takes_the_cheapest_point_on_time():
    points = [_point(0.3, 100, 90.0), _point(0.5, 99, 60.0), _point(0.7, 95, 40.0)]
    rho, delta, ok, stats = choose(points, 0, target=0.99)
    assert (rho, delta, ok) == (0.5, 0.1, True)
    assert stats["gpu_seconds"] == 60.0


def test_choose_falls_back_to_the_most_punctual():
    points = [_point(0.3, 97, 90.0), _point(0.5, 95, 60.0)]
    rho, _, ok, _ = choose(points, 0, target=0.99)
    assert (rho, ok) == (0.3, False)


def test_build_table_end_to_end(tmp_path, monkeypatch):
    short = [synth.generate(synth.spec(name, seed=5000 + i, duration_s=420.0))
             for i, name in enumerate(("calm", "chaotic"))]
    monkeypatch.setattr(synth, "training_traces", lambda **kw: short)
    monkeypatch.setattr(profiler, "QUICK_GRID", {"rho_hat": (0.4, 0.8), "delta": (0.1,)})
    out = tmp_path / "rho.json"
    table = profiler.build_table(quick=True, out=out, json_out=tmp_path / "points.json",
                                 log=lambda line: None)
    loaded = load_rho_table(out)
    assert loaded == table
    assert set(loaded.rho_hat) <= {0.4, 0.8}
    assert "sim profile --quick" in loaded.source
    points = json.loads((tmp_path / "points.json").read_text())["points"]
    assert len(points) == 4  # 2 rho_hat x 1 delta x 2 traces
    # The core accepts it.
    policy = get_policy("turboserve", rho_table=out)
    assert policy.rho_table == table


def test_shipped_table_is_loadable_and_was_made_by_the_profiler():
    table = load_rho_table(DEFAULT_TABLE_PATH)
    assert table is not None
    assert "turboserve sim profile" in table.source
    assert all(0.25 <= r <= 0.9 for r in table.rho_hat)
