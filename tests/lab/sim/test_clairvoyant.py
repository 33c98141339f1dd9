"""The clairvoyant, the rival that runs only offline: in the simulator's list and not the live
one, told the future, and doing what its docstring says."""

from __future__ import annotations

import pytest

from lab.sim.policies import POLICIES
from services.scheduler.core.policies import LIVE_POLICIES
from services.scheduler.core.types import Event, EventKind, Release, RequestGpus
from shared.profile import load_profile
from tests.scheduler.core.harness import build

PROFILE = load_profile()


def _requests(decisions):
    return [d for d in decisions if isinstance(d, RequestGpus)]


def test_rivals_are_listed_and_the_clairvoyant_only_offline():
    assert {"hpa", "turboserve_predictive", "least_loaded_autoscale"} <= set(LIVE_POLICIES)
    assert "clairvoyant" in POLICIES and "clairvoyant" not in LIVE_POLICIES


def test_clairvoyant_needs_the_future():
    with pytest.raises(TypeError, match="future"):
        build("clairvoyant", PROFILE)


def test_clairvoyant_takes_no_idle_reserve_from_the_table_and_the_others_do():
    from services.scheduler.core.autoscale import RhoTable

    table = RhoTable(
        tuple(float(i) for i in range(1, 10)),
        (0.8,) * 10,
        (0.1,) * 10,
        signal="dispersion",
        idle_reserve=(0.5,) * 10,
    )
    oracle = build("clairvoyant", PROFILE, future=[], rho_table=table)
    assert oracle.current_idle_reserve(0.0) == 0.0
    assert (
        build(
            "clairvoyant", PROFILE, future=[], rho_table=table, idle_reserve=0.25
        ).current_idle_reserve(0.0)
        == 0.25
    )
    for name in ("turboserve", "no_migration", "turboserve_predictive"):
        assert build(name, PROFILE, rho_table=table).current_idle_reserve(0.0) == 0.5, name
    # The rivals keep their own rules: no table, no reserve.
    for name in ("hpa", "least_loaded_autoscale"):
        rival = build(name, PROFILE, rho_table=table)
        assert rival.current_idle_reserve(0.0) == 0.0 and rival.rho_table is None, name


def test_clairvoyant_asks_one_boot_delay_ahead_and_releases_when_demand_ends():
    future = [(100.0, f"s{i}", "arrive") for i in range(30)]
    future += [(200.0, f"s{i}", "depart") for i in range(30)]
    policy = build(
        "clairvoyant",
        PROFILE,
        future=future,
        rho_hat=0.5,
        delta=0.1,
        boot_delay_s=30.0,
        lookahead_slack_s=1.0,
    )
    first_request = None
    for t in range(0, 100):
        out = policy.step(Event(float(t), EventKind.TICK))
        if _requests(out) and first_request is None:
            first_request = (t, _requests(out)[0])
    assert first_request is not None
    t, request = first_request
    assert t == 69  # 100 - 30 s boot - 1 s tick slack
    assert len(request.gpu_ids) == 4  # 30 sessions at rho_hat 0.5 of K = 12: 5 GPUs in all
    for gpu_id in request.gpu_ids:
        policy.step(Event(99.0, EventKind.GPU_READY, gpu_id=gpu_id))
    for i in range(30):
        policy.step(Event(100.0, EventKind.ARRIVE, session_id=f"s{i}"))
    assert not policy.view.pending
    released = []
    for i in range(30):
        out = policy.step(Event(200.0, EventKind.DEPART, session_id=f"s{i}"))
        released += [d for d in out if isinstance(d, Release)]
    assert len(released) == 4 and policy.view.billed_gpus == 1
