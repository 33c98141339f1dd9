"""A sweep that misses the service level is extended, up to a stated cap."""

from __future__ import annotations

from lab.eval.extend import (
    HEADROOM_CAP,
    extension_report,
    next_runs,
    static_cap,
)
from lab.eval.runs import RunSpec, RunSummary
from lab.sim.simulator import make_policy
from shared.profile import load_profile


def _run(curve: str, stall: float, **params) -> RunSummary:
    params = {"initial_gpus": 4, **params} if curve != "least_loaded" else params
    return RunSummary(
        spec=RunSpec("t", curve, curve, tuple(params.items())),
        cost_gpu_h=1.0,
        cost_usd=0.0,
        p50_ms=0.0,
        p99_ms=1000.0,
        max_ms=1000.0,
        attainment=stall,
        migrations=0,
        scale_events=0,
        peak_gpus=1,
        decision_p99_ms=0.0,
        served_floor_gpu_h=0.0,
        unserved_session_s=0.0,
        wall_s=0.0,
        stall_adjusted_attainment=stall,
    )


def _static(attain: dict[int, float]) -> list[RunSummary]:
    return [_run("least_loaded", a, gpus=g) for g, a in attain.items()]


def test_the_static_cap_is_twice_the_peaks_need():
    assert static_cap(peak_active=158, capacity=2) == 158  # one session per GPU at K = 2
    assert static_cap(peak_active=120, capacity=12) == 20


def test_a_static_pool_that_misses_tries_the_cap_then_bisects_to_one_gpu():
    runs = _static({10: 0.95, 12: 0.97, 15: 0.98})  # planned: 10 to 15 GPUs
    [spec] = next_runs(runs, peak_active=20, capacity=2, planned_top=15)
    assert spec.param("gpus") == 20 and spec.curve == "least_loaded"
    runs.append(_run("least_loaded", 0.995, gpus=20))
    seen = []
    while specs := next_runs(runs, peak_active=20, capacity=2, planned_top=15):
        [spec] = specs
        gpus = spec.param("gpus")
        seen.append(gpus)
        runs.append(_run("least_loaded", 0.995 if gpus >= 18 else 0.985, gpus=gpus))
    assert seen == [17, 18]  # between 15 (missed) and 20 (reached): 17 misses, 18 reaches


def test_a_static_pool_that_misses_at_the_cap_is_not_reached():
    runs = _static({10: 0.95, 20: 0.97})
    assert next_runs(runs, peak_active=20, capacity=2, planned_top=15) == []
    report = extension_report(runs, {runs[0].spec}, peak_active=20, capacity=2)
    assert report == {
        "added": {"least_loaded": [20]},
        "static_cap_gpus": 20,
        "not_reached_at_cap": ["least_loaded"],
    }


def test_a_planned_sweep_that_reaches_the_level_gets_no_runs():
    runs = _static({10: 0.95, 12: 0.995}) + [_run("hpa", 0.99, target=0.5)]
    assert next_runs(runs, peak_active=20, capacity=2, planned_top=12) == []


def test_an_autoscaler_that_misses_gets_more_headroom_down_to_the_cap():
    runs = [
        _run("clairvoyant", 0.97, future=True),
        _run("clairvoyant", 0.96, rho_hat=0.35, future=True),
        _run("hpa", 0.95, target=0.5),
    ]
    rounds = []
    while specs := next_runs(runs, peak_active=20, capacity=2, planned_top=12):
        rounds.append(sorted((s.curve, s.param("rho_hat") or s.param("target")) for s in specs))
        runs += [_run(s.curve, 0.98, **dict(s.params)) for s in specs]
    assert rounds == [
        [("clairvoyant", 0.25), ("hpa", 0.45)],
        [("clairvoyant", 0.15), ("hpa", 0.35)],
        [("hpa", 0.25)],
        [("hpa", 0.15)],
    ]
    assert HEADROOM_CAP == 0.15
    # The clairvoyant keeps its future and its warm pool.
    extra = [r for r in runs if r.spec.curve == "clairvoyant" and r.spec.param("rho_hat") == 0.15]
    assert extra[0].spec.param("future") is True and extra[0].spec.param("initial_gpus") == 4


def test_the_threshold_autoscaler_never_gets_a_negative_scale_in_threshold():
    """least_loaded_autoscale scales in 0.3 below its threshold: below 0.3 that is 0 (it never
    shrinks), not a threshold the policy refuses."""
    runs = [_run("least_loaded_autoscale", 0.97, rho_hat=0.35)]
    [spec] = next_runs(runs, peak_active=20, capacity=2, planned_top=12)
    assert spec.param("rho_hat") == 0.25 and spec.param("low") == 0.0
    # The policy takes it (it refuses a negative one).
    policy = make_policy(spec.policy, load_profile(), boot_delay_s=30.0, **dict(spec.params))
    assert policy.name == "least_loaded_autoscale"
