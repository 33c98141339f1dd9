"""Property tests for what a live environment adds: random event sequences with failed
migrations and placements, operators' drains, GPUs of two kinds, profile updates and
scheduler restarts. After every step: no session lost (each active session is placed or
pending, never both), no GPU above its own kind's K, the policy's view equal to what the
environment did, and a drained GPU released only when empty (the harness refuses any other
release) and as soon as it is."""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.scheduler.core.types import (
    Event,
    EventKind,
    GpuState,
    RestoredGpu,
    RestoredSession,
)
from services.scheduler.shipped import load_rho_table
from shared.profile import load_profile, profile_from_measurements

from .harness import Env, build

H20 = load_profile()
FAST = replace(profile_from_measurements({1: 200.0, 2: 250.0}, H20, name="fast"), gpu_kind="FAST")
TABLE = load_rho_table()
PROFILES = {"H20": H20, "FAST": FAST}
REMEASURED = [
    profile_from_measurements({1: 300.0, 4: 1200.0}, H20),  # K = 4
    H20,
    profile_from_measurements({1: 300.0, 2: 330.0}, H20),
]  # K = 16

OPS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "arrive",
                "arrive",
                "active",
                "idle",
                "depart",
                "tick",
                "tick",
                "boot",
                "gone",
                "drain",
                "cordon",
                "uncordon",
                "ready_other",
                "remeasure",
                "restart",
            ]
        ),
        st.integers(min_value=0, max_value=10_000),
    ),
    min_size=1,
    max_size=100,
)
POLICIES = st.sampled_from(
    ["turboserve", "turboserve", "no_migration", "no_autoscale", "least_loaded"]
)


class Driver:
    """Plays sessions and pool events against an :class:`Env`, restarting the scheduler on
    demand from what the environment knows (as a live scheduler rebuilds from Redis)."""

    def __init__(self, policy_name: str, params: dict, fail_rate: float, seed: int) -> None:
        self.policy_name = policy_name
        self.params = params
        rng = random.Random(seed)
        self.fail = (lambda d: rng.random() < fail_rate) if fail_rate else None
        self.env = Env(self._policy(params), fail=self.fail)
        self.active: set[str] = set()
        self.idle: list[str] = []
        self.counter = 0
        self.extra = 0
        self.restarts = 0

    def _policy(self, params: dict):
        return build(self.policy_name, PROFILES, **params)

    def run(self, ops) -> None:
        env = self.env
        for what, which in ops:
            t = env.t + 1.0
            if what == "arrive" or (what == "active" and not self.idle):
                sid = f"s{self.counter}"
                self.counter += 1
                self.active.add(sid)
                env.send(Event(t, EventKind.ARRIVE, sid))
            elif what == "active":
                sid = self.idle.pop(which % len(self.idle))
                self.active.add(sid)
                env.send(Event(t, EventKind.ACTIVE, sid))
            elif what in ("idle", "depart") and self.active:
                sid = sorted(self.active)[which % len(self.active)]
                self.active.discard(sid)
                if what == "idle":
                    self.idle.append(sid)
                env.send(Event(t, EventKind.IDLE if what == "idle" else EventKind.DEPART, sid))
            elif what == "boot" and env.booting:
                env.boot_one(kind="FAST" if which % 3 == 0 else None)
            elif what == "gone" and which % 5 == 0 and env.gpus:
                gpu = sorted(env.gpus)[which % len(env.gpus)]
                env.send(Event(t, EventKind.GPU_GONE, gpu_id=gpu))
            elif what == "drain" and env.gpus:
                gpu = sorted(env.gpus)[which % len(env.gpus)]
                env.send(Event(t, EventKind.GPU_DRAIN, gpu_id=gpu))
            elif what in ("cordon", "uncordon") and env.gpus:
                gpu = sorted(env.gpus)[which % len(env.gpus)]
                kind = EventKind.GPU_CORDON if what == "cordon" else EventKind.GPU_UNCORDON
                env.send(Event(t, kind, gpu_id=gpu))
            elif what == "ready_other":
                self.extra += 1
                env.send(
                    Event(
                        t,
                        EventKind.GPU_READY,
                        gpu_id=f"x{self.extra}",
                        gpu_kind="FAST" if which % 2 else "H20",
                    )
                )
            elif what == "remeasure":
                env.policy.set_profile("H20", REMEASURED[which % len(REMEASURED)])
                env.send(Event(t, EventKind.TICK))
            elif what == "restart":
                self._restart(t)
            else:
                env.send(Event(t, EventKind.TICK))
            self._check()

    def _check(self) -> None:
        view = self.env.policy.view
        # Above K only after a profile update lowered K: the excess is moved as room
        # appears (never added to), so K is checked everywhere else.
        over = any(view.load(g) > view.capacity_of(g) for g in view.gpus)
        self.env.check(self.active, k_bound=not over)

    def _restart(self, t: float) -> None:
        """A new scheduler process: everything it knows comes from the environment."""
        env = self.env
        self.restarts += 1
        old = env.policy
        gpus = [
            RestoredGpu(g, env.kinds[g], state, cordoned=g in env.cordoned)
            for g, state in sorted(env.gpus.items())
        ]
        sessions = [RestoredSession(s, True, env.where.get(s)) for s in sorted(self.active)]
        sessions += [RestoredSession(s, False, None, in_host_ram=True) for s in self.idle]
        policy = self._policy({**self.params, "gpu_id_prefix": f"r{self.restarts}"})
        for kind, profile in old.view.profiles.items():
            if kind in PROFILES:
                policy.set_profile(kind, profile)
        policy.restore(gpus, sessions, t)
        env.policy = policy
        env.send(Event(t, EventKind.TICK))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=POLICIES,
    ops=OPS,
    gpus=st.integers(min_value=1, max_value=5),
    fail_rate=st.sampled_from([0.0, 0.2, 0.5]),
    seed=st.integers(0, 2**16),
    adaptive=st.booleans(),
)
def test_live_invariants_hold_after_every_step(policy, ops, gpus, fail_rate, seed, adaptive):
    params = {"gpus": gpus}
    if policy in ("turboserve", "no_migration"):
        params.update({"rho_table": TABLE} if adaptive else {"rho_hat": 0.6})
        params["warmup_s"] = 5.0
    if policy == "least_loaded":
        fail_rate = 0.0  # a static pool never migrates; placements may still fail below
    driver = Driver(policy, params, fail_rate, seed)
    driver.run(ops)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, seed=st.integers(0, 2**16))
def test_a_drained_gpu_is_released_once_empty_and_never_before(ops, seed):
    """Drain every GPU in turn while sessions come and go and migrations fail: each drained
    GPU is released exactly when it holds nothing (the harness refuses an earlier release;
    ``check`` refuses an empty drained GPU that is kept)."""
    driver = Driver("turboserve", {"gpus": 3, "rho_hat": 0.6, "warmup_s": 5.0}, 0.3, seed)
    drains = [("drain", k) for k in range(3)]
    driver.run(drains + list(ops) + drains)
    for gpu, state in driver.env.gpus.items():
        assert state is not GpuState.DRAINING or driver.env.on_gpu[gpu]
