"""What a live environment adds: failed migrations and placements, an operator's drain, and a
restart that rebuilds the view from what it finds."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.scheduler.core.config import ControllerConfig
from services.scheduler.core.loop import Controller
from services.scheduler.core.types import (
    Assign,
    Drain,
    Event,
    EventKind,
    GpuState,
    Migrate,
    Release,
    RequestGpus,
    RestoredGpu,
    RestoredSession,
    Resume,
)
from shared.profile import load_profile

from .harness import Env, build

PROFILE = load_profile()  # K = 12
FIXED = ControllerConfig(rho_hat=0.7, delta=0.1, eta=0.0, autoscale=False, initial_gpus=2)


def _filled(config: ControllerConfig, loads: dict[str, int]) -> tuple[Controller, Env]:
    """A controller whose GPUs hold ``loads`` (by GPU), placed by hand through failures."""
    controller = Controller(PROFILE, replace(config, initial_gpus=0))
    gpus = [RestoredGpu(g, "H20", GpuState.READY) for g in loads]
    sessions = [RestoredSession(f"{g}-s{i}", True, g) for g, n in loads.items() for i in range(n)]
    controller.restore(gpus, sessions, 0.0)
    env = Env(controller)
    env.gpus = dict(controller.view.gpus)
    env.kinds = {g: "H20" for g in loads}
    env.on_gpu = {g: {s.session_id for s in sessions if s.gpu_id == g} for g in loads}
    env.where = {s.session_id: s.gpu_id for s in sessions if s.gpu_id is not None}
    return controller, env


def test_a_failed_migration_leaves_the_session_on_its_source_and_backs_off():
    controller, env = _filled(FIXED, {"a": 6, "b": 0})
    out = controller.step(Event(1.0, EventKind.TICK))
    moves = [d for d in out if isinstance(d, Migrate)]
    assert len(moves) == 3  # 6 / 0 -> 3 / 3 with free moves
    first = moves[0]
    assert controller.view.gpu_of(first.session_id) == "b"
    # The worker refused: the session is still on a, which holds 4 again against b's 2. The
    # rebalance moves another session at once: not the one in backoff.
    out = controller.step(Event(1.5, EventKind.MIGRATION_FAILED, first.session_id, "a"))
    assert controller.view.gpu_of(first.session_id) == "a"
    assert len(out) == 1 and out[0].session_id != first.session_id
    assert controller.view.active_counts == {"a": 3, "b": 3}
    # With every other session of a in backoff too, a stays above b until the backoff ends.
    for sid in [s for s, g in controller.view.placement.items() if g == "a"]:
        controller.step(Event(2.0, EventKind.MIGRATION_FAILED, sid, "a"))
    controller.step(Event(2.0, EventKind.MIGRATION_FAILED, out[0].session_id, "a"))
    assert controller.view.active_counts == {"a": 4, "b": 2}
    assert controller.step(Event(3.0, EventKind.TICK)) == []
    assert len(controller.step(Event(7.5, EventKind.TICK))) == 1  # all backoffs over
    # An unknown or idle session's failure changes nothing.
    assert controller.step(Event(3.0, EventKind.MIGRATION_FAILED, "nobody", "a")) == []


def test_a_failed_evacuation_takes_the_released_gpu_back_until_it_is_empty():
    """Scale-in drains a GPU, moves its session and releases it in one step; the move fails:
    the GPU comes back as DRAINING with the session, and is released again once empty."""
    config = ControllerConfig(
        rho_hat=0.7, delta=0.1, initial_gpus=0, warmup_s=0.0, retry_backoff_s=5.0
    )
    controller, _ = _filled(config, {"a": 2, "b": 1})
    out = controller.step(Event(1.0, EventKind.TICK))
    assert [type(d) for d in out] == [Drain, Migrate, Release]
    moved = out[1]
    assert (moved.src, out[2].gpu_id) == ("b", "b") and "b" not in controller.view.gpus
    controller.step(Event(1.5, EventKind.MIGRATION_FAILED, moved.session_id, "b"))
    assert controller.view.state_of("b") is GpuState.DRAINING
    assert controller.view.gpu_of(moved.session_id) == "b"
    assert controller.step(Event(3.0, EventKind.TICK)) == []  # backoff: no retry yet
    out = controller.step(Event(6.5, EventKind.TICK))  # backoff over: evacuate, release
    assert out == [Migrate(moved.session_id, "b", "a"), Release("b")]


def test_a_failed_migration_from_a_gpu_that_is_gone_loses_the_state():
    controller, _ = _filled(FIXED, {"a": 2, "b": 2})
    controller.step(Event(1.0, EventKind.GPU_GONE, gpu_id="b"))  # its sessions go to a
    sid = "b-s0"
    assert controller.view.gpu_of(sid) == "a"
    out = controller.step(Event(2.0, EventKind.MIGRATION_FAILED, sid, "b"))
    assert out == [Assign(sid, "a")]  # placed again from scratch


def test_a_failed_placement_is_placed_again_elsewhere_or_waits():
    controller = Controller(PROFILE, FIXED)
    out = controller.step(Event(0.0, EventKind.ARRIVE, "s0"))
    assert out == [Assign("s0", "h20-0000")]
    out = controller.step(Event(0.5, EventKind.PLACEMENT_FAILED, "s0", "h20-0000"))
    assert out == [Assign("s0", "h20-0001")]  # not back onto the GPU that failed
    out = controller.step(Event(1.0, EventKind.PLACEMENT_FAILED, "s0", "h20-0001"))
    # Only h20-0000 has room besides the one that failed just now: it is not in backoff for
    # this session any more? It is: each failure sets the session's failed GPU; the last
    # one (h20-0001) is avoided, h20-0000 is taken.
    assert out == [Assign("s0", "h20-0000")]
    single = Controller(PROFILE, replace(FIXED, initial_gpus=1))
    single.step(Event(0.0, EventKind.IDLE, "x"))  # ignored: unknown session
    single.step(Event(0.0, EventKind.ARRIVE, "s1"))
    single.step(Event(0.1, EventKind.IDLE, "s1"))
    out = single.step(Event(0.2, EventKind.ACTIVE, "s1"))
    assert out == [Resume("s1", "h20-0000")]
    assert single.step(Event(0.3, EventKind.PLACEMENT_FAILED, "s1", "h20-0000")) == []
    assert single.view.pending == ("s1",)  # waits: the only GPU failed just now
    assert single.step(Event(3.0, EventKind.TICK)) == []
    assert single.step(Event(5.4, EventKind.TICK)) == [Resume("s1", "h20-0000")]


def test_an_operator_drain_evacuates_and_releases_like_a_scale_in():
    controller, env = _filled(FIXED, {"a": 3, "b": 2, "c": 0})
    out = env.send(Event(1.0, EventKind.GPU_DRAIN, gpu_id="a"))
    assert out[0] == Drain("a") and out[-1] == Release("a")
    assert sum(isinstance(d, Migrate) for d in out) == 3
    assert "a" not in controller.view.gpus and env.released == ["a"]
    env.check({f"a-s{i}" for i in range(3)} | {"b-s0", "b-s1"})
    assert env.send(Event(2.0, EventKind.GPU_DRAIN, gpu_id="a")) == []  # gone: ignored
    assert env.send(Event(2.0, EventKind.GPU_DRAIN, gpu_id="zz")) == []  # unknown: ignored


def test_an_operator_drain_without_migration_waits_for_the_sessions_to_leave():
    policy = build("least_loaded", PROFILE, gpus=2)
    env = Env(policy)
    for i in range(4):
        env.send(Event(float(i), EventKind.ARRIVE, f"s{i}"))
    gpu = policy.view.gpu_of("s0")
    on_it = [s for s in ("s0", "s1", "s2", "s3") if policy.view.gpu_of(s) == gpu]
    assert env.send(Event(5.0, EventKind.GPU_DRAIN, gpu_id=gpu)) == [Drain(gpu)]
    out = env.send(Event(6.0, EventKind.ARRIVE, "s4"))
    assert out == [Assign("s4", next(g for g in policy.view.gpus if g != gpu))]
    for k, sid in enumerate(on_it):
        out = env.send(Event(7.0 + k, EventKind.DEPART, sid))
    assert out == [Release(gpu)]


def test_an_operator_drain_of_a_booting_gpu_cancels_it_and_the_load_asks_again():
    config = ControllerConfig(rho_hat=0.5, delta=0.1, initial_gpus=1)
    controller = Controller(PROFILE, config)
    env = Env(controller)
    requests = []
    for i in range(8):
        requests += [
            d
            for d in env.send(Event(float(i), EventKind.ARRIVE, f"s{i}"))
            if isinstance(d, RequestGpus)
        ]
    booting = requests[0].gpu_ids[0]
    out = env.send(Event(10.0, EventKind.GPU_DRAIN, gpu_id=booting))
    assert out[0] == Release(booting)
    assert any(isinstance(d, RequestGpus) for d in out)  # the load still needs it: replaced


def test_restore_rebuilds_the_view_from_what_a_restart_finds():
    controller = build("turboserve", PROFILE, rho_hat=0.7, delta=0.1, gpus=5)
    gpus = [
        RestoredGpu("h20-0003", "H20", GpuState.READY),
        RestoredGpu("h20-0007", "H20", GpuState.DRAINING),
        RestoredGpu("h20-0009", "H20", GpuState.BOOTING),
    ]
    sessions = [
        RestoredSession("on-ready", True, "h20-0003"),
        RestoredSession("on-draining", True, "h20-0007"),
        RestoredSession("on-booting", True, "h20-0009"),
        RestoredSession("on-unknown", True, "w-gone"),
        RestoredSession("waiting", True, None, in_host_ram=True),
        RestoredSession("idle", False, "h20-0003", in_host_ram=True),
    ]
    controller.restore(gpus, sessions, 100.0)
    view = controller.view
    assert view.gpus == {"h20-0003": "ready", "h20-0007": "draining", "h20-0009": "booting"}
    assert view.placement == {"on-ready": "h20-0003", "on-draining": "h20-0007"}
    assert view.pending == ("on-booting", "on-unknown", "waiting")
    assert view.idle_sessions == ("idle",)
    out = controller.step(Event(100.0, EventKind.TICK))
    assert Assign("on-booting", "h20-0003") in out and Resume("waiting", "h20-0003") in out
    assert Migrate("on-draining", "h20-0007", "h20-0003") in out and Release("h20-0007") in out
    # Warm-up from the restore: the almost empty pool is not scaled in for one boot delay...
    assert not [d for d in controller.step(Event(110.0, EventKind.TICK)) if isinstance(d, Release)]
    # ... and is afterwards (the booting GPU is cancelled first).
    assert Release("h20-0009") in controller.step(Event(131.0, EventKind.TICK))
    # New names continue after the highest one found.
    for i in range(40):
        out = controller.step(Event(140.0 + i, EventKind.ARRIVE, f"n{i}"))
        if any(isinstance(d, RequestGpus) for d in out):
            break
    request = next(d for d in out if isinstance(d, RequestGpus))
    assert request.gpu_ids[0] == "h20-0010"


def test_restore_refuses_what_cannot_be_right():
    controller = Controller(PROFILE, FIXED)
    with pytest.raises(ValueError, match="listed twice"):
        controller.restore([RestoredGpu("a", "H20", GpuState.READY)] * 2, [], 0.0)
    with pytest.raises(ValueError, match="state 'ready'"):
        controller.restore([RestoredGpu("a", "H20", "ready")], [], 0.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="session 's' listed twice"):
        controller.restore([], [RestoredSession("s", True)] * 2, 0.0)
    controller.step(Event(0.0, EventKind.TICK))
    with pytest.raises(RuntimeError, match="fresh controller"):
        controller.restore([], [], 1.0)


def test_restore_keeps_sessions_above_k_and_the_rebalance_fixes_it():
    """What the restart finds is fact, even a GPU above K (a profile with a lower K)."""
    controller = Controller(PROFILE, replace(FIXED, eta=0.1))
    gpus = [RestoredGpu("a", "H20", GpuState.READY), RestoredGpu("b", "H20", GpuState.READY)]
    sessions = [RestoredSession(f"s{i}", True, "a") for i in range(14)]
    controller.restore(gpus, sessions, 0.0)
    assert controller.view.active_counts == {"a": 14, "b": 0}
    controller.step(Event(0.0, EventKind.TICK))
    assert controller.view.active_counts == {"a": 7, "b": 7}


def test_a_session_moved_twice_in_one_step_gets_one_decision():
    """A scale-in may evacuate onto a GPU it drains next in the same step: the environment
    gets one move per session (to where it ends), and none for a move that comes back."""
    from services.scheduler.core.loop import _coalesce

    out = [
        Migrate("s", "a", "b"),
        Drain("b"),
        Migrate("s", "b", "c"),
        Release("b"),
        Assign("t", "b"),
        Migrate("t", "b", "c"),
        Migrate("u", "a", "b"),
        Migrate("u", "b", "a"),
        Resume("v", "c"),
    ]
    assert _coalesce(out) == [
        Migrate("s", "a", "c"),
        Drain("b"),
        Release("b"),
        Assign("t", "c"),
        Resume("v", "c"),
    ]


def test_a_cordoned_gpu_is_emptied_and_kept_until_uncordoned():
    controller, env = _filled(FIXED, {"a": 3, "b": 2, "c": 0})
    out = env.send(Event(1.0, EventKind.GPU_CORDON, gpu_id="a"))
    # The operator told the worker already: moves only, no Drain, and never a Release.
    assert out and all(isinstance(d, Migrate) and d.src == "a" for d in out)
    assert controller.view.state_of("a") is GpuState.DRAINING and controller.view.cordoned == ("a",)
    assert controller.view.load("a") == 0
    for t in range(2, 20):
        assert not any(isinstance(d, Release) for d in env.send(Event(float(t), EventKind.TICK)))
    assert "a" in controller.view.gpus
    env.send(Event(20.0, EventKind.ARRIVE, "new"))
    assert controller.view.gpu_of("new") != "a"  # out of placement
    env.send(Event(21.0, EventKind.GPU_UNCORDON, gpu_id="a"))
    assert controller.view.state_of("a") is GpuState.READY and controller.view.cordoned == ()
    for i in range(20):  # placeable again: the load reaches it
        env.send(Event(22.0 + i, EventKind.ARRIVE, f"after{i}"))
    assert controller.view.load("a") > 0
    env.check()


def test_a_drain_fills_no_gpu_past_its_slots():
    """The operator drains ``a`` (5 sessions) while ``b`` holds 8 of its 12 slots and ``c`` 11:
    four go to b, one to c, and b ends at 12, not 13. With ``c`` full too, the fifth stays on
    ``a`` (still draining) rather than overfill a GPU, and moves once a slot frees."""
    controller, env = _filled(FIXED, {"a": 5, "b": 8, "c": 11})
    out = env.send(Event(1.0, EventKind.GPU_CORDON, gpu_id="a"))
    moves = [d for d in out if isinstance(d, Migrate)]
    assert sorted(d.dst for d in moves) == ["b", "b", "b", "b", "c"]
    assert controller.view.active_counts == {"a": 0, "b": 12, "c": 12}
    env.check()

    controller, env = _filled(FIXED, {"a": 5, "b": 8, "c": 12})
    env.send(Event(1.0, EventKind.GPU_CORDON, gpu_id="a"))
    for t in range(2, 10):
        env.send(Event(float(t), EventKind.TICK))
        assert max(controller.view.load(g) for g in ("b", "c")) <= PROFILE.capacity
    assert controller.view.active_counts == {"a": 1, "b": 12, "c": 12}
    env.send(Event(10.0, EventKind.DEPART, "c-s0"))
    env.send(Event(11.0, EventKind.TICK))
    assert controller.view.active_counts == {"a": 0, "b": 12, "c": 12}
    env.check()


def test_a_cordoned_gpu_is_not_counted_nor_scaled_in_and_a_drain_gives_it_back():
    config = ControllerConfig(rho_hat=0.5, delta=0.1, initial_gpus=0, warmup_s=0.0)
    controller = Controller(PROFILE, config)
    controller.restore([RestoredGpu(g, "H20", GpuState.READY) for g in ("a", "b", "c")], [], 0.0)
    env = Env(controller)
    env.gpus = dict(controller.view.gpus)
    env.kinds = {g: "H20" for g in "abc"}
    env.on_gpu = {g: set() for g in "abc"}
    env.send(Event(1.0, EventKind.GPU_CORDON, gpu_id="a"))
    # An empty pool: the autoscaler gives back what it counts (b, c), never a.
    released = []
    for t in range(2, 200):
        released += [
            d.gpu_id for d in env.send(Event(float(t), EventKind.TICK)) if isinstance(d, Release)
        ]
    assert "a" not in released and "a" in controller.view.gpus
    out = env.send(Event(300.0, EventKind.GPU_DRAIN, gpu_id="a"))  # `ctl drain --stop`
    out += env.send(Event(301.0, EventKind.TICK))
    assert Release("a") in out and "a" not in controller.view.gpus


def test_restore_keeps_a_cordoned_gpu():
    controller = Controller(PROFILE, replace(FIXED, initial_gpus=0))
    controller.restore(
        [
            RestoredGpu("a", "H20", GpuState.DRAINING, cordoned=True),
            RestoredGpu("b", "H20", GpuState.DRAINING),
            RestoredGpu("c", "H20", GpuState.READY),
        ],
        [],
        0.0,
    )
    out = controller.step(Event(1.0, EventKind.TICK))
    assert out == [Release("b")] and controller.view.cordoned == ("a",)
