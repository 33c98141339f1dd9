from __future__ import annotations

import json
import math

import pytest

from services.scheduler import shipped
from services.scheduler.core.autoscale import (
    FALLBACK_RHO_HAT,
    RhoTable,
    VolatilityTracker,
    gpus_for,
    scale,
)
from services.scheduler.core.config import ControllerConfig
from services.scheduler.core.types import Event, EventKind
from services.scheduler.shipped import load_rho_table, save_rho_table
from shared.profile import load_profile

from .harness import build

PROFILE = load_profile()

TABLE = RhoTable(
    level_edges=(0.5, 1, 1.5, 2, 3, 4, 5, 6.5, 8),
    rho_hat=(0.8, 0.75, 0.7, 0.65, 0.6, 0.5, 0.45, 0.4, 0.3, 0.25),
    delta=(0.1,) * 10,
    source="test",
)


def test_scale_uses_the_papers_formula():
    # 100 sessions, K = 12, rho_hat 0.7: M = ceil(100 / 8.4) = 12.
    assert scale(100, 0.95, budget=8, capacity=12, rho_hat=0.7, delta=0.1) == 12
    assert scale(100, 0.3, budget=30, capacity=12, rho_hat=0.7, delta=0.1) == 12
    assert scale(100, 0.7, budget=30, capacity=12, rho_hat=0.7, delta=0.1) == 30  # in band
    assert scale(0, 0.0, budget=3, capacity=12, rho_hat=0.7, delta=0.1, min_gpus=1) == 1
    assert scale(1000, 1.2, budget=3, capacity=12, rho_hat=0.7, delta=0.1, max_gpus=10) == 10


def test_gpus_for_guards_against_flapping():
    # K = 12, rho_hat 0.5, delta 0: ceil(13 / 6) = 3 GPUs, balanced load 5 -> no flap.
    assert gpus_for(13, 12, 0.5, 0.0) == 3
    # rho_hat 0.74, delta 0.01: 12 * 0.75 = 9 per GPU at most -> 19 sessions need 3, not 2.
    assert math.ceil(19 / (12 * 0.74)) == 3 and gpus_for(19, 12, 0.74, 0.01) == 3
    assert gpus_for(17, 12, 0.74, 0.01) == 2


def test_volatility_tracker():
    tr = VolatilityTracker(window_s=40, bin_s=10)
    assert tr.std(5.0) is None
    for t in (1, 2, 3, 4, 11, 21, 22, 23, 24, 25, 26):  # bins: 4, 1, 6
        tr.record(t)
    assert tr.std(25.0) is None  # only two complete bins
    assert tr.std(31.0) == pytest.approx(
        math.sqrt(((4 - 11 / 3) ** 2 + (1 - 11 / 3) ** 2 + (6 - 11 / 3) ** 2) / 3)
    )
    # Later, the first bin leaves the window and empty bins count as zeros.
    assert tr.std(61.0) == pytest.approx(math.sqrt((0 + 0 + 36 + 0) / 4 - (6 / 4) ** 2))
    steady = VolatilityTracker(window_s=50, bin_s=10)
    for t in range(0, 100):
        steady.record(t + 0.5)  # one per second: 10 per bin
    assert steady.std(100.0) == 0.0


def _poisson_tracker(rate_per_bin: float, seed: int, bins: int = 400) -> VolatilityTracker:
    """A tracker fed Poisson arrivals at ``rate_per_bin`` per 10 s bin for ``bins`` bins."""
    import numpy as np

    rng = np.random.default_rng(seed)
    tr = VolatilityTracker(window_s=10.0 * bins, bin_s=10.0)
    tr.observe(0.0)
    for b, count in enumerate(rng.poisson(rate_per_bin, size=bins)):
        for k in range(int(count)):
            tr.record(10.0 * b + 10.0 * (k + 0.5) / (count + 1))
    return tr


def test_dispersion_is_load_independent_and_sees_bursts():
    t_end = 4000.0
    quiet, busy = _poisson_tracker(3.0, seed=1), _poisson_tracker(30.0, seed=2)
    # Poisson: variance = mean, so the index of dispersion is ~1 at any rate ...
    assert quiet.dispersion(t_end) == pytest.approx(1.0, abs=0.2)
    assert busy.dispersion(t_end) == pytest.approx(1.0, abs=0.2)
    # ... while the paper's std grows as sqrt(rate): busy looks "volatile" without a burst.
    assert busy.std(t_end) > 2.5 * quiet.std(t_end)
    # The same mean (3 per bin) in storms of 30 every tenth bin is far more dispersed.
    bursty = VolatilityTracker(window_s=4000.0, bin_s=10.0)
    for b in range(0, 400, 10):
        for k in range(30):
            bursty.record(10.0 * b + 0.1 * k)
    assert bursty.dispersion(t_end) > 20 * quiet.dispersion(t_end)
    assert bursty.value(t_end) == bursty.dispersion(t_end)  # the default signal


def test_dispersion_by_hand():
    tr = VolatilityTracker(window_s=40, bin_s=10)
    assert tr.dispersion(5.0) is None
    for t in (1, 2, 3, 4, 11, 21, 22, 23, 24, 25, 26):  # bins: 4, 1, 6
        tr.record(t)
    assert tr.dispersion(25.0) is None
    mean = 11 / 3
    var = ((4 - mean) ** 2 + (1 - mean) ** 2 + (6 - mean) ** 2) / 3
    assert tr.dispersion(31.0) == pytest.approx(var / mean)
    empty = VolatilityTracker(window_s=40, bin_s=10)
    empty.observe(0.0)
    assert empty.dispersion(35.0) == 0.0  # no activations at all: calm
    assert VolatilityTracker(signal="std").value(0.0) is None
    with pytest.raises(ValueError, match="unknown volatility signal"):
        VolatilityTracker(signal="variance")


def _storms(policy, t: float, n: int) -> tuple[float, int]:
    """Three storms: 40 activations inside one bin, then a minute of silence; returns (t, n)."""
    for _burst in range(3):
        for _ in range(40):
            policy.step(Event(t, EventKind.ARRIVE, f"s{n}"))
            n += 1
        t += 60.0
        policy.step(Event(t, EventKind.TICK))
    return t, n


def test_rho_table_signal_round_trip_and_default(tmp_path):
    disp = RhoTable(TABLE.level_edges, TABLE.rho_hat, TABLE.delta, signal="dispersion")
    path = save_rho_table(disp, tmp_path / "d.json")
    assert json.loads(path.read_text())["signal"] == "dispersion"
    assert load_rho_table(path) == disp
    assert disp.tracker().signal == "dispersion"
    old = TABLE.to_dict()
    del old["signal"]  # tables written before the signal was named are std tables
    assert RhoTable.from_dict(old).signal == "std"
    with pytest.raises(ValueError, match="unknown signal"):
        RhoTable(TABLE.level_edges, TABLE.rho_hat, TABLE.delta, signal="cv")


def test_rho_table_levels_and_round_trip(tmp_path):
    assert TABLE.level(0.0) == 0 and TABLE.level(0.5) == 1 and TABLE.level(100.0) == 9
    assert TABLE.lookup(2.5) == (0.6, 0.1)
    path = save_rho_table(TABLE, tmp_path / "t.json")
    assert load_rho_table(path) == TABLE
    with pytest.raises(FileNotFoundError):
        load_rho_table(tmp_path / "absent.json")
    bad = TABLE.to_dict()
    bad["levels"] = bad["levels"][:9]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="need 10 levels"):
        load_rho_table(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="0 < rho_hat <= 1"):
        RhoTable(TABLE.level_edges, (1.5,) * 10, (0.1,) * 10)
    with pytest.raises(ValueError, match="ascend"):
        RhoTable(tuple(reversed(TABLE.level_edges)), TABLE.rho_hat, TABLE.delta)


def test_no_table_falls_back_to_fixed_rho(tmp_path, monkeypatch):
    """The core reads no file: without a table it uses the fixed rho_hat; the loader says None
    when the shipped table is absent."""
    monkeypatch.setattr(shipped, "DEFAULT_TABLE_PATH", tmp_path / "none.json")
    assert load_rho_table() is None
    policy = build("turboserve", PROFILE)
    assert policy.current_rho_hat(0.0) == (FALLBACK_RHO_HAT, 0.1)
    assert policy.current_idle_reserve(0.0) == 0.0


def test_config_refuses_a_table_that_is_not_loaded(tmp_path):
    with pytest.raises(TypeError, match="RhoTable"):
        ControllerConfig(rho_table=str(tmp_path / "t.json"))  # type: ignore[arg-type]


def test_adaptive_rho_follows_volatility():
    policy = build("turboserve", PROFILE, rho_table=TABLE)
    assert policy.current_rho_hat(0.0) == (TABLE.rho_hat[5], 0.1)  # window not filled yet
    t, n = 0.0, 0
    for _ in range(30):  # calm: one activation every 5 s for 150 s
        policy.step(Event(t, EventKind.ARRIVE, f"s{n}"))
        policy.step(Event(t + 1, EventKind.DEPART, f"s{n}"))
        t, n = t + 5.0, n + 1
    assert policy.current_rho_hat(t) == (0.8, 0.1)
    t, n = _storms(policy, t, n)
    assert policy.current_rho_hat(t)[0] <= 0.3


def test_adaptive_rho_follows_dispersion_not_load():
    table = RhoTable(TABLE.level_edges, TABLE.rho_hat, TABLE.delta, signal="dispersion")
    policy = build("turboserve", PROFILE, rho_table=table)
    t, n = 0.0, 0
    for _ in range(150):  # busy but even: 10 activations every 10 s (std 0, dispersion 0)
        for k in range(10):
            policy.step(Event(t + k, EventKind.ARRIVE, f"s{n}"))
            policy.step(Event(t + k + 0.5, EventKind.DEPART, f"s{n}"))
            n += 1
        t += 10.0
    assert policy.current_rho_hat(t) == (0.8, 0.1)
    t, n = _storms(policy, t, n)
    assert policy.current_rho_hat(t)[0] <= 0.3


@pytest.mark.parametrize(
    ("key", "lookup", "values", "at_0", "at_9", "bad", "rule"),
    [
        (
            "idle_reserve",
            RhoTable.reserve,
            (0.0,) * 5 + (0.25,) * 3 + (0.5,) * 2,
            0.0,
            0.5,
            2.0,
            "0 <= idle_reserve <= 1",
        ),
        (
            "peak_rho",
            RhoTable.peak_cap,
            (1.0,) * 5 + (0.85,) * 3 + (0.0,) * 2,
            1.0,
            0.0,
            1.5,
            "0 <= peak_rho <= 1",
        ),
    ],
)
def test_rho_table_per_level_column_round_trip_lookup_and_validation(
    tmp_path, key, lookup, values, at_0, at_9, bad, rule
):
    table = RhoTable(
        TABLE.level_edges, TABLE.rho_hat, TABLE.delta, signal="dispersion", **{key: values}
    )
    path = save_rho_table(table, tmp_path / "r.json")
    assert [lv[key] for lv in json.loads(path.read_text())["levels"]] == list(values)
    assert load_rho_table(path) == table
    assert lookup(table, 0) == at_0 and lookup(table, 9) == at_9
    # Tables without the key (every table before it) have the column's default at any level.
    assert key not in TABLE.to_dict()["levels"][0] and lookup(TABLE, 9) == 0.0
    assert getattr(RhoTable.from_dict(TABLE.to_dict()), key) == ()
    with pytest.raises(ValueError, match=f"need 10 {key}"):
        RhoTable(TABLE.level_edges, TABLE.rho_hat, TABLE.delta, **{key: (values[0],) * 9})
    with pytest.raises(ValueError, match=rule):
        RhoTable(TABLE.level_edges, TABLE.rho_hat, TABLE.delta, **{key: (bad,) * 10})


def test_controller_takes_the_idle_reserve_of_the_current_level():
    """The table's reserve at the current volatility level, unless one is given; none with a
    fixed rho_hat and no table."""
    reserve = (0.1,) * 5 + (0.2,) * 4 + (0.7,)
    table = RhoTable(
        TABLE.level_edges, TABLE.rho_hat, TABLE.delta, signal="dispersion", idle_reserve=reserve
    )
    policy = build("turboserve", PROFILE, rho_table=table)
    assert policy.current_idle_reserve(0.0) == 0.2  # window not filled: the middle level
    t, n = 0.0, 0
    t, n = _storms(policy, t, n)
    assert policy.current_idle_reserve(t) == 0.7
    assert (
        build("turboserve", PROFILE, rho_table=table, idle_reserve=0.0).current_idle_reserve(t)
        == 0.0
    )
    assert build("turboserve", PROFILE, rho_hat=0.7).current_idle_reserve(t) == 0.0


def _requested(decisions):
    return sum(len(d.gpu_ids) for d in decisions if type(d).__name__ == "RequestGpus")


def test_peak_cap_limits_headroom_to_the_recent_peak():
    """rho_hat 0.5 asks for ceil(24 / 6) = 4 GPUs for 24 sessions; with peak_rho 1 the pool
    holds only what the peak of the last 300 s needs at K = 12 per GPU: ceil(24 / 12) = 2.
    (``peak_surge_s`` 0: every count is "older", so no load is a surge; see the next tests.)"""
    K = PROFILE.capacity

    def pool(**kw):
        policy = build(
            "turboserve",
            PROFILE,
            rho_hat=0.5,
            delta=0.1,
            gpus=1,
            warmup_s=0.0,
            peak_surge_s=0.0,
            **kw,
        )
        asked = sum(
            _requested(policy.step(Event(0.0, EventKind.ARRIVE, f"s{i}"))) for i in range(2 * K)
        )
        return 1 + asked

    assert pool() == 4
    assert pool(peak_rho=1.0) == 2
    assert pool(peak_rho=0.0) == 4  # 0: no cap


def test_peak_cap_never_keeps_a_session_waiting_and_remembers_the_window():
    """The cap holds every active session of now at K per GPU, and it keeps the window's peak:
    after the load halves, the pool stays at what the peak needed until the peak is 300 s old."""
    K = PROFILE.capacity
    policy = build(
        "turboserve",
        PROFILE,
        rho_hat=0.5,
        delta=0.1,
        gpus=1,
        warmup_s=0.0,
        peak_rho=1.0,
        peak_window_s=300.0,
        peak_surge_s=0.0,
    )
    for i in range(4 * K):
        policy.step(Event(0.0, EventKind.ARRIVE, f"s{i}"))
    assert len(policy.view.gpus) == 4  # ceil(48 / 12): a slot for every session once booted
    for i in range(2 * K):  # half of them leave at t = 10: rho_hat 0.5 asks for 4, the cap 4
        policy.step(Event(10.0, EventKind.DEPART, f"s{i}"))
    released_at = []
    for t in range(11, 330):
        if any(type(d).__name__ == "Release" for d in policy.step(Event(float(t), EventKind.TICK))):
            released_at.append(t)
    # The peak of 48 was last seen at t = 10 (the departures' step): it leaves the window at
    # 310, and the cap becomes ceil(24 / 12) = 2.
    assert released_at == [310]
    assert len(policy.view.gpus) == 2


def test_a_surge_beyond_the_recent_peak_lifts_the_cap_until_it_is_the_past():
    """Load above every count older than ``peak_surge_s`` (60 s) is a surge: the pool grows for
    it with rho_hat's headroom. Once the surge's top is 60 s old, the cap holds the pool to
    what that top needs at peak_rho."""
    K = PROFILE.capacity
    policy = build(
        "turboserve",
        PROFILE,
        rho_hat=0.5,
        delta=0.1,
        gpus=1,
        warmup_s=0.0,
        peak_rho=1.0,
        peak_window_s=300.0,
        peak_surge_s=60.0,
    )

    def budget():
        return len(policy.view.gpus)

    for i in range(2 * K):  # 24 sessions, nothing seen before: a surge, no cap
        policy.step(Event(0.0, EventKind.ARRIVE, f"a{i}"))
    assert budget() == 4  # ceil(24 / (12 * 0.5))
    for t in range(1, 60):
        policy.step(Event(float(t), EventKind.TICK))
    assert budget() == 4  # still a surge: no count is 60 s old yet
    policy.step(Event(60.0, EventKind.TICK))
    assert budget() == 2  # the top (24) is the past now: the cap, ceil(24 / 12)
    for i in range(K):  # 36 > 24, the highest count older than 60 s: a surge again
        policy.step(Event(100.0, EventKind.ARRIVE, f"b{i}"))
    assert budget() == 6  # ceil(36 / 6)
    for t in range(101, 160):
        policy.step(Event(float(t), EventKind.TICK))
    assert budget() == 6
    policy.step(Event(160.0, EventKind.TICK))
    assert budget() == 3  # ceil(36 / 12)
    # A count back at a level the window has seen is no surge: the cap holds.
    for i in range(K):
        policy.step(Event(170.0, EventKind.DEPART, f"b{i}"))
    for i in range(K):
        policy.step(Event(180.0, EventKind.ARRIVE, f"c{i}"))
    assert budget() == 3


def test_controller_takes_the_peak_cap_of_the_current_level():
    peaks = (0.0,) * 5 + (0.85,) * 4 + (1.0,)
    table = RhoTable(
        TABLE.level_edges, TABLE.rho_hat, TABLE.delta, signal="dispersion", peak_rho=peaks
    )
    policy = build("turboserve", PROFILE, rho_table=table)
    assert policy.current_peak_rho(0.0) == 0.85  # window not filled: the middle level
    t, n = _storms(policy, 0.0, 0)
    assert policy.current_peak_rho(t) == 1.0
    assert build("turboserve", PROFILE, rho_table=table, peak_rho=0.0).current_peak_rho(t) == 0.0
    assert build("turboserve", PROFILE, rho_hat=0.7).current_peak_rho(t) == 0.0
    # The clairvoyant knows how high the load goes: no cap from the table.
    future = [(0.0, "s0", "arrive")]
    assert build("clairvoyant", PROFILE, rho_table=table, future=future).current_peak_rho(t) == 0.0
