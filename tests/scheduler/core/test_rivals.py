"""The core's rivals (``hpa``, ``least_loaded_autoscale``, ``turboserve_predictive``): live
policies, doing what their docstrings say."""

from __future__ import annotations

import pytest

from services.scheduler.core.types import Drain, Event, EventKind, Migrate, Release, RequestGpus
from shared.profile import load_profile
from tests.scheduler.core.harness import build

PROFILE = load_profile()


def _requests(decisions):
    return [d for d in decisions if isinstance(d, RequestGpus)]


def test_hpa_scales_up_at_its_next_sync_and_down_only_after_the_stabilisation_window():
    policy = build("hpa", PROFILE, target=0.5, boot_delay_s=30.0)
    for i in range(30):
        policy.step(Event(0.0, EventKind.ARRIVE, session_id=f"s{i}"))  # synced at t=0: 1 GPU
    requested, when = [], None
    for t in range(1, 16):
        out = policy.step(Event(float(t), EventKind.TICK))
        if _requests(out):
            requested, when = [g for r in _requests(out) for g in r.gpu_ids], t
    assert when == 15 and len(requested) == 4  # 30 sessions at 0.5 of K = 12: 5 GPUs
    for gpu_id in requested:
        policy.step(Event(45.0, EventKind.GPU_READY, gpu_id=gpu_id))
    for i in range(30):
        policy.step(Event(50.0, EventKind.DEPART, session_id=f"s{i}"))
    shrink_at = None
    for t in range(51, 400):
        out = policy.step(Event(float(t), EventKind.TICK))
        if any(isinstance(d, Release | Drain) for d in out):
            shrink_at = t
            break
    # Syncs run every 15 s from the last one: 15, then 45 (the GPU_READY event, still 30
    # sessions: another 5-GPU recommendation), 60, 75, ...  That recommendation holds the pool
    # until it leaves the 300 s window, at the sync of t = 360.
    assert shrink_at == 360


def test_predictive_scales_up_before_turboserve_on_a_slow_ramp():
    def first_request(name):
        policy = build(
            name, PROFILE, rho_hat=0.6, delta=0.1, boot_delay_s=30.0, initial_gpus=4, min_gpus=4
        )
        for t in range(400):  # one arrival every 2 s, a tick every second
            out = policy.step(Event(float(t), EventKind.TICK))
            if t % 2 == 0:
                out += policy.step(Event(float(t), EventKind.ARRIVE, session_id=f"s{t}"))
            if _requests(out):
                return t
        return None

    predictive, reactive = first_request("turboserve_predictive"), first_request("turboserve")
    assert predictive is not None and reactive is not None
    assert predictive < reactive


def test_least_loaded_autoscale_never_migrates():
    policy = build("least_loaded_autoscale", PROFILE, rho_hat=0.5, boot_delay_s=0.0)
    assert policy.name == "least_loaded_autoscale" and policy.config.migrate is False
    assert (policy.high, policy.low) == (0.5, pytest.approx(0.2))


def test_least_loaded_autoscale_steps_out_at_once_and_in_one_gpu_after_a_cooldown():
    """A threshold rule, not TurboServe's: above 80% it adds what brings utilisation back to
    80% (then waits 30 s), below 50% for 120 s it removes one GPU (then waits 120 s)."""
    policy = build("least_loaded_autoscale", PROFILE, gpus=2, boot_delay_s=5.0, warmup_s=0.0)
    out = []
    for k in range(22):  # 22 sessions on 2 x 12 slots: u = 0.92 > 0.8 at the 20th
        out += policy.step(Event(float(k), EventKind.ARRIVE, session_id=f"s{k}"))
    asks = [d for d in out if isinstance(d, RequestGpus)]
    assert [len(d.gpu_ids) for d in asks] == [1]  # ceil(20 / 9.6) = 3 GPUs: one more
    for gpu_id in asks[0].gpu_ids:
        policy.step(Event(25.0, EventKind.GPU_READY, gpu_id=gpu_id))
    assert not [d for d in policy.step(Event(26.0, EventKind.TICK)) if isinstance(d, Migrate)]
    for k in range(18):  # 4 sessions left: u = 4 / 36 < 0.5
        policy.step(Event(30.0 + k / 10, EventKind.DEPART, session_id=f"s{k}"))
    released = []
    for t in range(32, 500):
        released += [
            (t, d)
            for d in policy.step(Event(float(t), EventKind.TICK))
            if isinstance(d, Drain | Release)
        ]
    drains = [t for t, d in released if isinstance(d, Drain)]
    # One GPU at a time, each after 120 s of low utilisation or since the last scale event.
    assert len(drains) == 2 and drains[0] >= 30 + 120 and drains[1] - drains[0] >= 120


def test_session_forecast_lies_between_the_active_and_the_live_sessions():
    policy = build(
        "turboserve_predictive", PROFILE, rho_hat=0.6, boot_delay_s=30.0, initial_gpus=4, min_gpus=4
    )
    for k in range(40):
        policy.step(Event(float(k), EventKind.ARRIVE, session_id=f"s{k}"))
    for k in range(0, 40, 2):  # half of them go idle
        policy.step(Event(40.0 + k / 10, EventKind.IDLE, session_id=f"s{k}"))
    for t in range(45, 120):
        policy.step(Event(float(t), EventKind.TICK))
    forecast = policy.forecast()
    assert policy.view.active_sessions == 20
    assert 20 <= forecast <= 40


def test_predictive_mode_is_checked():
    with pytest.raises(ValueError, match="mode"):
        build("turboserve_predictive", PROFILE, mode="crystal_ball")
