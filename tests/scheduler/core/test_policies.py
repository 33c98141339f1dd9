from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import replace

import pytest

from lab.sim.policies import POLICIES
from services.scheduler.core.config import ControllerConfig
from services.scheduler.core.policies import (
    LIVE_POLICIES,
    NoAutoscaleConfig,
    Policies,
    Policy,
    PolicySpec,
    StaticConfig,
)
from services.scheduler.core.types import (
    Assign,
    Drain,
    Event,
    EventKind,
    Migrate,
    Release,
    RequestGpus,
    Resume,
    SetSteps,
    Suspend,
)
from shared import policies as names
from shared.profile import load_profile
from shared.settings import SchedulerSettings, SettingsError

from .harness import Env, build

PROFILE = load_profile()

BUILT_INS = [
    "least_loaded",
    "memory_aware",
    "no_autoscale",
    "no_migration",
    "round_robin",
    "turboserve",
]


def test_registry_lists_built_ins_and_rejects_unknowns():
    assert set(BUILT_INS) <= set(LIVE_POLICIES)
    for name in BUILT_INS:
        policy = LIVE_POLICIES.build(name, PROFILE)
        assert isinstance(policy, Policy) and policy.name == name
    with pytest.raises(KeyError, match="unknown policy 'nope'; available: .*turboserve"):
        LIVE_POLICIES.build("nope", PROFILE)
    with pytest.raises(TypeError, match="'round_robin' does not take rho_hat; it takes .*gpus"):
        LIVE_POLICIES.config("round_robin", {"rho_hat": 0.5})
    with pytest.raises(TypeError, match="'turboserve' does not take placement"):
        LIVE_POLICIES.config("turboserve", {"placement": "round_robin"})  # the policy's own switch
    with pytest.raises(TypeError, match="not both"):
        LIVE_POLICIES.config("turboserve", {"gpus": 2, "initial_gpus": 3})
    with pytest.raises(ValueError, match="rho_hat must be in"):
        LIVE_POLICIES.config("turboserve", {"rho_hat": 1.5})


def test_each_policy_takes_its_own_frozen_config():
    config = LIVE_POLICIES.config("turboserve", {"gpus": 3, "rho_hat": 0.6})
    assert config == ControllerConfig(initial_gpus=3, rho_hat=0.6)
    assert LIVE_POLICIES.config("round_robin", {"gpus": 3}) == StaticConfig(gpus=3)
    assert LIVE_POLICIES.config("no_autoscale", {"eta": 0.2}) == NoAutoscaleConfig(eta=0.2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.rho_hat = 0.5  # type: ignore[misc]
    # The policy sets its switches on the config it is given.
    policy = LIVE_POLICIES.build("no_migration", PROFILE, ControllerConfig(rho_hat=0.6))
    assert policy.config.migrate is False and policy.config.name == "no_migration"
    assert LIVE_POLICIES.build("least_loaded", PROFILE, StaticConfig(gpus=2)).view.billed_gpus == 2
    # Another policy's config is refused, naming the one it takes.
    with pytest.raises(TypeError, match="'round_robin' takes a StaticConfig, got ControllerConfig"):
        LIVE_POLICIES.build("round_robin", PROFILE, ControllerConfig())
    with pytest.raises(TypeError, match="takes a StaticConfig, got NoAutoscaleConfig"):
        LIVE_POLICIES.build("least_loaded", PROFILE, NoAutoscaleConfig())


def test_every_policy_declares_whether_it_autoscales():
    future = [(0.0, "s0", "arrive")]
    for name in POLICIES:
        spec = POLICIES[name]
        params = {"future": future} if "future" in spec.params else {}
        policy = POLICIES.build(name, PROFILE, POLICIES.config(name, params))
        assert isinstance(policy, Policy)
        assert policy.autoscales is spec.autoscales, name
    assert {n for n in BUILT_INS if LIVE_POLICIES[n].autoscales} == {"turboserve", "no_migration"}


def test_the_live_policies_are_one_list_named_in_shared_and_the_lab_adds_the_offline_ones():
    # The settings check reads the names from shared/ (it cannot import the scheduler); the
    # core's list is built on them.
    assert tuple(LIVE_POLICIES) == names.LIVE_POLICIES
    assert set(POLICIES) - set(LIVE_POLICIES) == {"clairvoyant", "turboserve_q"}
    assert all(POLICIES[name] is LIVE_POLICIES[name] for name in LIVE_POLICIES)
    with pytest.raises(ValueError, match="'turboserve' is listed twice"):
        LIVE_POLICIES.extended(LIVE_POLICIES["turboserve"])


def test_settings_refuse_a_policy_the_live_scheduler_cannot_run():
    for name in ("clairvoyant", "nope"):
        with pytest.raises(
            SettingsError,
            match=f"TURBOSERVE_POLICY='{name}': not a policy the "
            "live scheduler runs; one of hpa, least_loaded",
        ):
            SchedulerSettings.from_env({"TURBOSERVE_POLICY": name})
    assert SchedulerSettings.from_env({"TURBOSERVE_POLICY": "hpa"}).policy == "hpa"


def test_a_list_extended_with_a_spec_builds_it():
    seen = {}

    def build_mine(profile, config):
        seen.update(gpus=config.gpus, profile=profile.name)
        return LIVE_POLICIES.build("least_loaded", profile, config)

    mine = LIVE_POLICIES.extended(PolicySpec("mine", StaticConfig, build_mine, autoscales=False))
    assert isinstance(mine, Policies)
    pcie = load_profile("h20-longlive-1.3b-pcie")
    assert mine.build("mine", pcie, mine.config("mine", {"gpus": 3})).view.billed_gpus == 3
    assert seen == {"gpus": 3, "profile": "h20-longlive-1.3b-pcie"}
    assert "mine" in mine and "mine" not in LIVE_POLICIES
    # The core reads no files: a profile's name or path is refused, with the way to load it.
    with pytest.raises(TypeError, match="shared.profile"):
        mine.build("mine", "h20-longlive-1.3b-pcie")


def test_static_policies_place_by_their_rule():
    events = [Event(float(i), EventKind.ARRIVE, f"s{i}") for i in range(5)]
    placements = {}
    for name in ("round_robin", "least_loaded", "memory_aware"):
        policy = build(name, PROFILE, gpus=3)
        placements[name] = [policy.step(e)[0].gpu_id for e in events]
    assert placements["round_robin"] == ["h20-0000", "h20-0001", "h20-0002", "h20-0000", "h20-0001"]
    assert placements["least_loaded"] == placements["round_robin"]  # ties in join order
    assert placements["memory_aware"] == ["h20-0000"] * 5  # best fit packs
    # Departures break the tie: least-loaded refills the emptiest GPU, round robin moves on.
    rr, ll = build("round_robin", PROFILE, gpus=3), build("least_loaded", PROFILE, gpus=3)
    for p in (rr, ll):
        for e in events:
            p.step(e)
        p.step(Event(9.0, EventKind.DEPART, "s2"))  # h20-0002 empties
    new = Event(10.0, EventKind.ARRIVE, "x")
    assert rr.step(new) == [Assign("x", "h20-0002")]
    assert ll.step(new) == [Assign("x", "h20-0002")]
    assert rr.step(Event(11.0, EventKind.ARRIVE, "y")) == [Assign("y", "h20-0000")]
    assert ll.step(Event(11.0, EventKind.ARRIVE, "y")) == [Assign("y", "h20-0002")]


def test_static_pool_queues_sessions_beyond_capacity():
    k = load_profile().capacity
    policy = build("least_loaded", PROFILE, gpus=1)
    env = Env(policy)
    for i in range(k + 2):
        env.send(Event(float(i), EventKind.ARRIVE, f"s{i}"))
    assert policy.view.pending == (f"s{k}", f"s{k + 1}")
    out = env.send(Event(50.0, EventKind.IDLE, "s0"))
    assert out == [Suspend("s0", "h20-0000"), Assign(f"s{k}", "h20-0000")]
    out = env.send(Event(51.0, EventKind.DEPART, "s1"))
    assert out == [Assign(f"s{k + 1}", "h20-0000")]
    env.check()


def test_idle_and_active_flip_suspends_and_resumes():
    policy = build("turboserve", PROFILE, rho_hat=0.7)
    assert policy.step(Event(0.0, EventKind.ARRIVE, "a")) == [Assign("a", "h20-0000")]
    assert policy.step(Event(1.0, EventKind.IDLE, "a")) == [Suspend("a", "h20-0000")]
    assert policy.view.placement == {} and policy.view.idle_sessions == ("a",)
    assert policy.step(Event(2.0, EventKind.ACTIVE, "a")) == [Resume("a", "h20-0000")]
    assert policy.step(Event(3.0, EventKind.DEPART, "a")) == []
    assert policy.view.placement == {} and policy.view.active_sessions == 0


def test_gpu_gone_displaces_sessions_and_they_are_reassigned():
    policy = build("no_autoscale", PROFILE, gpus=2)
    env = Env(policy)
    for i in range(4):
        env.send(Event(float(i), EventKind.ARRIVE, f"s{i}"))
    out = env.send(Event(5.0, EventKind.GPU_GONE, gpu_id="h20-0000"))
    assert sorted(d.session_id for d in out if isinstance(d, Assign)) == ["s0", "s2"]
    assert set(policy.view.placement.values()) == {"h20-0001"}
    env.check()


def test_no_migration_never_migrates_and_drains_before_release():
    policy = build("no_migration", PROFILE, rho_hat=0.5, delta=0.1, gpus=1)
    env = Env(policy)
    seen = []
    for i in range(24):
        seen += env.send(Event(float(i), EventKind.ARRIVE, f"s{i}"))
        seen += env.boot_one()
    for i in range(20):
        seen += env.send(Event(100.0 + i, EventKind.DEPART, f"s{i}"))
        env.check()
    assert not [d for d in seen if isinstance(d, Migrate)]
    assert [d for d in seen if isinstance(d, RequestGpus)]
    released = [d.gpu_id for d in seen if isinstance(d, Release)]
    drained = [d.gpu_id for d in seen if isinstance(d, Drain)]
    assert released and set(released) <= set(drained)


def test_turboserve_migrates_where_no_migration_cannot():
    """Scale-out then rebalance: the new GPUs take load off the old ones only with migration.
    With eta = 0 moves are free and the loads end balanced; at the default eta a move also pays
    its destination's chunk-boundary wait, so only moves onto (nearly) idle GPUs pay off."""
    loads = {}
    for name, eta in (("turboserve", 0.0), ("turboserve", 0.1), ("no_migration", 0.1)):
        policy = build(name, PROFILE, rho_hat=0.5, delta=0.1, gpus=2, eta=eta)
        env = Env(policy)
        for i in range(20):
            env.send(Event(float(i), EventKind.ARRIVE, f"s{i}"))
        while env.booting:
            env.boot_one()
        loads[name, eta] = sorted(policy.view.active_counts.values())
    assert max(loads["turboserve", 0.0]) - min(loads["turboserve", 0.0]) <= 1
    assert max(loads["turboserve", 0.1]) < max(loads["no_migration", 0.1])
    assert min(loads["turboserve", 0.1]) > 0  # every new GPU took sessions
    assert max(loads["no_migration", 0.1]) - min(loads["no_migration", 0.1]) > 1


def test_booting_gpus_are_billed_from_the_request_and_cancelled_first():
    policy = build("turboserve", PROFILE, rho_hat=0.7, delta=0.1, gpus=1)
    for i in range(11):
        policy.step(Event(float(i), EventKind.ARRIVE, f"s{i}"))
    assert policy.view.billed_gpus == 2 and "booting" in policy.view.gpus.values()
    out = []
    for i in range(11):
        out += policy.step(Event(20.0 + i, EventKind.DEPART, f"s{i}"))
    assert out[0] == Release("h20-0001")  # the booting one goes, no drain needed
    assert policy.view.billed_gpus == 1


def test_bench_cli_writes_the_agreed_json(tmp_path):
    from tools.bench import scheduler as bench

    out = tmp_path / "b.json"
    args = argparse.Namespace(gpus="4,8", steps=60, seed=1, profile=None, json_out=str(out))
    assert bench.run(args) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["gpus"], r["sessions"]) for r in results] == [(4, 32), (8, 64)]
    for r in results:
        assert 0 < r["decision_ms_p50"] <= r["decision_ms_p99"] <= r["decision_ms_max"]


def test_scale_in_delay_waits_for_the_load_to_stay_low():
    def releases_after(delay):
        policy = build(
            "turboserve",
            PROFILE,
            rho_hat=0.7,
            delta=0.1,
            gpus=3,
            scale_in_delay_s=delay,
            warmup_s=0.0,
        )
        policy.config = replace(policy.config, autoscale=False)
        for i in range(24):
            policy.step(Event(0.0, EventKind.ARRIVE, f"s{i}"))
        policy.config = replace(policy.config, autoscale=True)
        times = []
        for i in range(20):  # 4 sessions left from t = 10 on: far below the band
            if any(
                isinstance(d, Release) for d in policy.step(Event(10.0, EventKind.DEPART, f"s{i}"))
            ):
                times.append(10.0)
        for t in range(11, 120):
            if any(isinstance(d, Release) for d in policy.step(Event(float(t), EventKind.TICK))):
                times.append(float(t))
        return times

    assert releases_after(0.0)[0] == 10.0
    assert releases_after(60.0)[0] == 70.0


def test_scale_in_goes_to_the_highest_target_of_the_window_not_to_the_dip():
    """The stabilisation window: when the scale-in comes due during a short dip, the pool
    shrinks to what the window's load needed, not to the dip, so the load's return boots
    nothing."""

    def run(delay):
        policy = build(
            "turboserve",
            PROFILE,
            rho_hat=0.7,
            delta=0.1,
            gpus=6,
            scale_in_delay_s=delay,
            warmup_s=0.0,
        )
        policy.config = replace(policy.config, autoscale=False)
        for i in range(48):
            policy.step(Event(0.0, EventKind.ARRIVE, f"s{i}"))
        policy.config = replace(policy.config, autoscale=True)
        log = []

        def step(event):
            for d in policy.step(event):
                if isinstance(d, RequestGpus | Release):
                    log.append((event.t, type(d).__name__))

        for t in range(1, 120):
            if t == 10:  # 24 sessions stay: below the band of 6 GPUs, and of 4
                for i in range(24):
                    step(Event(10.0, EventKind.DEPART, f"s{i}"))
            elif t == 65:  # a dip to 4 ...
                for i in range(24, 44):
                    step(Event(65.0, EventKind.DEPART, f"s{i}"))
            elif t == 75:  # ... and back to 24
                for i in range(20):
                    step(Event(75.0, EventKind.ARRIVE, f"r{i}"))
            else:
                step(Event(float(t), EventKind.TICK))
        return log, len(policy.view.gpus)

    # Without a window the scale-in comes due at t = 70 in the dip: the pool drains to what 4
    # sessions need, and the return at t = 75 asks for GPUs again.
    log, _ = run(0.0)
    assert any(kind == "RequestGpus" for _, kind in log)
    # With a 60 s window it shrinks at t = 70 to the window's highest target, what 24 sessions
    # need at rho_hat 0.7 (ceil(24 / 8.4) = 3), and boots nothing afterwards.
    log, gpus = run(60.0)
    assert log and all(kind == "Release" for _, kind in log)
    assert min(t for t, _ in log) == 70.0
    assert gpus == 3


def test_warmup_keeps_the_starting_pool_then_scales_in():
    """A warm start: the pool the loop starts with survives the first arrivals of a warm
    system for warmup_s (default: the boot delay); scale-out is never delayed."""

    def first_release(**kw):
        policy = build(
            "turboserve", PROFILE, rho_hat=0.7, delta=0.1, gpus=6, boot_delay_s=30.0, **kw
        )
        for t in range(0, 120):
            out = policy.step(
                Event(
                    float(t),
                    EventKind.ARRIVE if t == 0 else EventKind.TICK,
                    "s0" if t == 0 else None,
                )
            )
            if any(isinstance(d, Release | Drain) for d in out):
                return float(t)
        return None

    assert first_release(warmup_s=0.0) == 0.0
    assert first_release() == 30.0
    assert first_release(warmup_s=75.0) == 75.0
    # Scale-out during the warm-up: 40 sessions at once on one GPU ask for more at once.
    policy = build("turboserve", PROFILE, rho_hat=0.7, delta=0.1, gpus=1)
    asked = [
        d
        for i in range(40)
        for d in policy.step(Event(0.0, EventKind.ARRIVE, f"s{i}"))
        if isinstance(d, RequestGpus)
    ]
    assert asked
    with pytest.raises(ValueError, match="warmup_s"):
        build("turboserve", PROFILE, warmup_s=-1.0)


def test_idle_reserve_sizes_the_pool_for_returning_sessions():
    """idle_reserve = 0.5 sizes the pool as if half the idle sessions were active."""

    def gpus_after(reserve):
        policy = build(
            "turboserve",
            PROFILE,
            rho_hat=0.5,
            delta=0.1,
            gpus=8,
            warmup_s=1.5,
            idle_reserve=reserve,
        )
        for i in range(48):  # 6 per GPU: inside the band
            policy.step(Event(0.0, EventKind.ARRIVE, f"s{i}"))
        assert len(policy.view.gpus) == 8
        for i in range(24):  # half go idle: 24 active, 24 idle
            policy.step(Event(1.0, EventKind.IDLE, f"s{i}"))
        for t in range(2, 60):
            policy.step(Event(float(t), EventKind.TICK))
        return len(policy.view.gpus)

    k = load_profile().capacity
    assert gpus_after(0.0) == -(-24 // (k * 0.5))  # ceil(24 / (K rho_hat))
    assert gpus_after(0.5) == -(-36 // (k * 0.5))  # 24 active + half of 24 idle
    with pytest.raises(ValueError, match="idle_reserve"):
        build("turboserve", PROFILE, idle_reserve=1.5)


def test_turboserve_places_a_new_session_where_its_first_chunk_comes_soonest():
    """With step reports (Controller.note_pass) a newly active session goes to the GPU whose
    step in flight ends soonest, unless a lighter GPU still delivers its first chunk earlier;
    without them it is the least loaded GPU. The least_loaded baseline ignores step reports."""
    profile = load_profile()
    policy = build("no_autoscale", PROFILE, gpus=2)  # turboserve's placement on a fixed pool
    env = Env(policy)
    for i in range(5):
        env.send(Event(0.0, EventKind.ARRIVE, f"s{i}"))
    assert sorted(policy.view.active_counts.values()) == [2, 3]  # least loaded, no reports
    busy, light = sorted(policy.view.active_counts, key=policy.view.load, reverse=True)
    policy.note_pass(light, 10.0 + profile.chunk_ms(2) / 1000)  # just started a step
    policy.note_pass(busy, 10.05)  # its step ends in 50 ms
    out = env.send(Event(10.0, EventKind.ARRIVE, "new"))
    # busy: 50 + chunk(4) = 683 ms; light: chunk(2) + chunk(3) = 1053 ms.
    assert Assign("new", busy) in out
    baseline = build("least_loaded", PROFILE, gpus=2)
    baseline.note_pass("h20-0000", 5.0)  # the hook exists on every Controller ...
    first = baseline.step(Event(0.0, EventKind.ARRIVE, "a"))
    assert first == [Assign("a", "h20-0000")]  # ... but only turboserve's chooser reads it


def test_the_live_service_gives_the_step_floor_to_a_policy_with_the_quality_budget_only():
    from services.scheduler.service import live_policy

    profiles = {PROFILE.gpu_kind: PROFILE}
    lowered: dict[str, list[SetSteps]] = {}
    for name in ("turboserve", "turboserve_staffing", "hpa"):
        settings = SchedulerSettings.from_env({}, policy=name, min_steps=2, boot_delay_s=2.0)
        policy = live_policy(settings, profiles, PROFILE.gpu_kind, None, 1, 5)
        out = policy.step(Event(0.0, EventKind.GPU_READY, gpu_id="w1"))
        for i in range(PROFILE.capacity + 2):  # more than full steps serve on one GPU
            out += policy.step(Event(1.0, EventKind.ARRIVE, f"s{i}"))
        lowered[name] = [d for d in out if isinstance(d, SetSteps)]
    assert lowered["turboserve"], "turboserve never lowered the steps of an overfull GPU"
    assert all(2 <= d.steps < PROFILE.full_steps for d in lowered["turboserve"])
    assert lowered["turboserve_staffing"], "the staffing policy ignored the quality budget"
    assert all(2 <= d.steps < PROFILE.full_steps for d in lowered["turboserve_staffing"])
    assert lowered["hpa"] == []  # a rival has no quality budget: the floor is ignored


def test_the_live_service_gives_an_autoscaler_the_pool_limits_and_a_static_policy_none():
    from services.scheduler.service import WORKER_START_S, live_policy

    profiles = {PROFILE.gpu_kind: PROFILE}
    for name in LIVE_POLICIES:
        settings = SchedulerSettings.from_env(
            {}, policy=name, boot_delay_s=2.0, gpu_id_prefix="run7"
        )
        policy = live_policy(settings, profiles, PROFILE.gpu_kind, None, 2, 5)
        assert policy.name == name and policy.view.billed_gpus == 0  # it finds the workers
        assert policy.boot_delay_s == 2.0 + WORKER_START_S
        assert policy.autoscales is LIVE_POLICIES[name].autoscales
        if policy.autoscales:
            assert (policy.config.min_gpus, policy.config.max_gpus) == (2, 5), name
        out = policy.step(Event(0.0, EventKind.GPU_READY, gpu_id="w1"))
        for i in range(2 * PROFILE.capacity):  # twice what the worker it found can hold
            out += policy.step(Event(1.0, EventKind.ARRIVE, f"s{i}"))
        out += policy.step(Event(60.0, EventKind.TICK))  # past the rivals' periods
        assert Assign("s0", "w1") in out, name
        asks = [d for d in out if isinstance(d, RequestGpus)]
        if policy.autoscales:  # it asks for more, named with the prefix
            assert asks and all(a.gpu_ids[0].startswith("run7-") for a in asks), name
        else:  # it keeps the pool it finds
            assert not asks and policy.view.gpus == {"w1": "ready"}, name
