"""The quality budget in the controller: fewer denoising steps on a GPU over its budget, full
steps again once it has room, the floor's extra room used only when full steps have none, and
nothing of it when off (no socket, no simulator)."""

from __future__ import annotations

import pytest

from lab.sim.policies import POLICIES
from services.scheduler.core.config import ControllerConfig
from services.scheduler.core.loop import Controller
from services.scheduler.core.quality import steps_for
from services.scheduler.core.types import (
    Assign,
    Decision,
    Event,
    EventKind,
    GpuState,
    Migrate,
    RestoredGpu,
    RestoredSession,
    SetSteps,
)
from shared.profile import load_profile

H20 = load_profile("h20-longlive-1.3b-nvlink")  # K = 12; 16 at 3 or 2 of 4 steps
H200 = load_profile("h200-wan-1.3b-measured")  # K = 2; 3 at 3 steps, 4 at 2, 7 at 1


def _controller(min_steps: int | None, gpus: int = 1, profile=H20, **kw) -> Controller:
    config = ControllerConfig(
        initial_gpus=gpus, min_steps=min_steps, rho_hat=0.7, warmup_s=1e9, **kw
    )
    return Controller(profile, config)


def _arrive(c: Controller, n: int, t: float = 1.0, first: int = 0) -> list[Decision]:
    out: list[Decision] = []
    for i in range(first, first + n):
        out.extend(c.step(Event(t, EventKind.ARRIVE, session_id=f"s{i:03d}")))
    return out


def _steps(out: list[Decision]) -> list[SetSteps]:
    return [d for d in out if isinstance(d, SetSteps)]


def test_steps_for_takes_the_most_steps_that_serve_the_load():
    assert [steps_for(H20, n, 2) for n in (0, 12, 13, 16, 17, 30)] == [4, 4, 3, 3, 2, 2]
    assert [steps_for(H200, n, 1) for n in (2, 3, 4, 5, 7, 9)] == [4, 3, 2, 1, 1, 1]
    assert [steps_for(H200, n, 3) for n in (2, 3, 4)] == [4, 3, 3]  # never below the floor
    assert steps_for(H20, 30, None) == 4 and steps_for(H20, 30, 4) == 4  # off


def test_a_burst_beyond_full_steps_runs_at_fewer_steps_until_a_gpu_boots():
    c = _controller(min_steps=3)
    out = _arrive(c, 12)
    assert not _steps(out) and sum(isinstance(d, Assign) for d in out) == 12
    out = _arrive(c, 3, first=12)
    # No GPU has room at full steps: the three go onto the room 3 steps add, the GPU is told.
    assert [d.gpu_id for d in out if isinstance(d, Assign)] == ["h20-0000"] * 3
    assert _steps(out) == [SetSteps("h20-0000", 3)]
    assert GpuState.BOOTING in c.view.gpus.values()  # more GPUs are on their way
    assert c.view.load("h20-0000") == 15 and not c.view.pending
    # Told once: more steps without a change say nothing.
    assert not _steps(c.step(Event(2.0, EventKind.TICK)))
    booting = [g for g, s in c.view.gpus.items() if s is GpuState.BOOTING]
    out = c.step(Event(31.0, EventKind.GPU_READY, gpu_id=booting[0]))
    assert any(isinstance(d, Migrate) for d in out)
    assert c.view.load("h20-0000") <= 12
    assert _steps(out) == [SetSteps("h20-0000", 4)]  # back to full once it has room


def test_the_floor_room_is_used_only_when_no_gpu_has_room_at_full_steps():
    c = _controller(min_steps=2, gpus=2)
    out = _arrive(c, 24)
    assert not _steps(out) and max(c.view.active_counts.values()) == 12
    out = _arrive(c, 8, first=24)  # 32 sessions: 16 per GPU is the floor's room
    assert sorted(_steps(out), key=lambda d: d.gpu_id) == [
        SetSteps("h20-0000", 3),
        SetSteps("h20-0001", 3),
    ]
    assert not c.view.pending
    out = _arrive(c, 1, first=32)  # beyond the floor's room too: it waits
    assert c.view.pending == ("s032",) and not _steps(out)


def test_steps_step_down_one_at_a_time_to_the_floor_and_back_up():
    c = _controller(min_steps=1, profile=H200)  # K = 2
    seen = [_steps(_arrive(c, 1, first=i)) for i in range(6)]
    assert seen == [
        [],
        [],
        [SetSteps("h200-0000", 3)],
        [SetSteps("h200-0000", 2)],
        [SetSteps("h200-0000", 1)],
        [],
    ]
    assert c.view.load("h200-0000") == 6  # 1 step serves up to 7
    assert not _steps(c.step(Event(2.0, EventKind.DEPART, session_id="s000")))  # 5: still 1
    out = c.step(Event(2.0, EventKind.DEPART, session_id="s001"))
    assert _steps(out) == [SetSteps("h200-0000", 2)]


def test_off_the_controller_never_sets_steps():
    for min_steps in (None, 4):  # unset, or the model's full count
        c = _controller(min_steps=min_steps)
        assert c.step_budget is None
        out = _arrive(c, 20)
        assert not _steps(out) and len(c.view.pending) == 8  # sessions wait, as before


def test_turboserve_q_is_turboserve_with_a_floor_and_the_rivals_take_none():
    q = POLICIES.build("turboserve_q", H20, POLICIES.config("turboserve_q", {"gpus": 1}))
    assert isinstance(q, Controller) and q.config.min_steps == 3 and q.name == "turboserve_q"
    two = POLICIES.config("turboserve_q", {"min_steps": 2})
    assert isinstance(two, ControllerConfig) and two.min_steps == 2
    plain = POLICIES.build("turboserve", H20)
    assert isinstance(plain, Controller) and plain.step_budget is None
    for rival in ("round_robin", "least_loaded", "memory_aware", "no_autoscale"):
        with pytest.raises(TypeError, match="does not take min_steps"):
            POLICIES.config(rival, {"min_steps": 2})


@pytest.mark.parametrize(
    ("min_steps", "message"),
    [(0, "must be an integer >= 1"), (5, r"above the full step count .* \(4\)"), (2.5, ">= 1")],
)
def test_a_bad_floor_is_a_clear_error(min_steps, message):
    with pytest.raises(ValueError, match=message):
        Controller(H20, ControllerConfig(min_steps=min_steps))  # type: ignore[arg-type]


def test_after_a_restore_every_gpu_is_told_its_count():
    c = Controller(H20, ControllerConfig(initial_gpus=0, min_steps=3, rho_hat=0.7))
    gpus = [RestoredGpu("w-a", "H20", GpuState.READY), RestoredGpu("w-b", "H20", GpuState.READY)]
    sessions = [RestoredSession(f"s{i}", True, "w-a") for i in range(14)]
    c.restore(gpus, sessions, t=5.0)
    out = c.step(Event(5.0, EventKind.TICK))
    told = {d.gpu_id: d.steps for d in _steps(out)}
    # w-a was found above K: the rebalance moves two off, and each GPU hears its count once.
    assert told == {"w-a": 4, "w-b": 4}
    assert not _steps(c.step(Event(6.0, EventKind.TICK)))
