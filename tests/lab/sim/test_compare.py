"""The simulator beside a live replay: the same trace and settings, the replay's keys."""

from __future__ import annotations

import pytest

from lab.sim.compare import COMPARED, compress, error_pct, simulate_replay
from lab.sim.synth import generate, spec
from lab.sim.traceio import make_trace
from services.scheduler.shipped import load_rho_table
from shared.profile import load_profile

PROFILE = load_profile()
KEYS = {
    "sessions",
    "chunks",
    "chunks_lost",
    "seq_repeats",
    "latency_ms",
    "deadline_attainment",
    "stall_adjusted_attainment",
    "missed_periods",
    "missed_periods_at_start",
    "startup_ms",
    "cost_gpu_seconds",
    "migrations",
    "scale_out_events",
    "scale_in_events",
    "peak_gpus",
}


def test_compress_divides_every_time():
    trace = make_trace("t", [(0.0, "a", "arrive"), (10.0, "a", "idle"), (30.0, "a", "depart")])
    fast = compress(trace, 10.0)
    assert [e.t for e in fast.events] == [0.0, 1.0, 3.0] and fast.duration == 3.0
    assert compress(trace, 1.0) is trace
    with pytest.raises(ValueError, match="speed"):
        compress(trace, 0.0)


def test_simulate_replay_returns_the_replays_keys_and_respects_the_pool_limits():
    trace = generate(spec("bursty", seed=7, duration_s=600.0), name="b")
    doc = simulate_replay(
        trace,
        PROFILE,
        speed=4.0,
        boot_delay_s=10.0,
        min_gpus=1,
        max_gpus=3,
        initial_gpus=1,
        rho_table=load_rho_table(),
    )
    assert set(doc) == KEYS and set(doc["latency_ms"]) == {"p50", "p99", "max"}
    assert doc["chunks_lost"] == 0 and doc["seq_repeats"] == 0
    assert 0 <= doc["missed_periods_at_start"] <= doc["missed_periods"]
    assert 1 <= doc["peak_gpus"] <= 3
    assert doc["cost_gpu_seconds"] <= 3 * 600.0 / 4.0 + 1e-6  # at most 3 GPUs for 150 s
    assert 0.0 <= doc["stall_adjusted_attainment"] <= doc["deadline_attainment"] <= 1.0
    # Time compression is what the replay does: more load per second, the same pool limits.
    slow = simulate_replay(
        trace,
        PROFILE,
        speed=1.0,
        boot_delay_s=10.0,
        min_gpus=1,
        max_gpus=3,
        initial_gpus=1,
        rho_table=load_rho_table(),
    )
    assert slow["cost_gpu_seconds"] > doc["cost_gpu_seconds"]
    # A run cut short (the replay played only part of the trace).
    cut = simulate_replay(trace, PROFILE, speed=4.0, duration_s=60.0, max_gpus=3)
    assert cut["cost_gpu_seconds"] <= 3 * 60.0 + 1e-6


def test_error_pct_per_key():
    live = {
        "cost_gpu_seconds": 100.0,
        "latency_ms": {"p50": 0.0, "p99": 1000.0, "max": 2.0},
        "migrations": 0,
        "peak_gpus": 4,
        "deadline_attainment": 0.99,
    }
    sim = {
        "cost_gpu_seconds": 110.0,
        "latency_ms": {"p50": 0.0, "p99": 800.0, "max": 3.0},
        "migrations": 5,
        "peak_gpus": 4,
    }
    err = error_pct(live, sim)
    assert set(err) == set(COMPARED)
    assert err["cost_gpu_seconds"] == 10.0 and err["latency_ms.p99"] == -20.0
    assert err["latency_ms.p50"] == 0.0  # both 0
    assert err["migrations"] is None  # live 0, sim 5: no relative error
    assert err["peak_gpus"] == 0.0
    assert err["deadline_attainment"] is None  # missing on one side


def test_a_resume_away_from_the_parked_state_is_a_migration_when_state_stays_on_its_worker():
    """The live mesh parks an idle session's state on the worker it was suspended on: a resume
    elsewhere moves it first. The simulator counts those moves only when told so."""
    trace = generate(spec("bursty", seed=7, duration_s=600.0), name="b")
    kw = dict(
        speed=4.0,
        boot_delay_s=10.0,
        min_gpus=1,
        max_gpus=3,
        initial_gpus=1,
        rho_table=load_rho_table(),
    )
    shared = simulate_replay(trace, PROFILE, parked_on_gpu=False, **kw)
    parked = simulate_replay(trace, PROFILE, **kw)  # the default: as the live mesh
    assert parked["migrations"] > shared["migrations"]
    assert parked["sessions"] == shared["sessions"]
