"""Several GPU kinds in one pool, each placed by its own latency profile."""

from __future__ import annotations

from dataclasses import replace

from services.scheduler.core.config import ControllerConfig
from services.scheduler.core.loop import Controller
from services.scheduler.core.types import Event, EventKind, Migrate, RequestGpus
from shared.profile import load_profile, profile_from_measurements

from .harness import Env

H20 = load_profile()  # K = 12, 420 ms at batch 1
# A fast kind: 200 + 50 (b - 1) ms, K = 16 (the table's length; 950 ms at 16).
FAST = replace(profile_from_measurements({1: 200.0, 2: 250.0}, H20, name="fast"), gpu_kind="FAST")
# A slow kind: twice the H20's chunk time, K = 3 (1,124 ms at 3).
SLOW = replace(
    profile_from_measurements({1: 2 * H20.chunk_ms(1)}, H20, name="slow"), gpu_kind="SLOW"
)


def _pool(**config) -> Controller:
    base = dict(rho_hat=0.7, initial_gpus=1, gpu_kind="H20", autoscale=False)
    return Controller(
        {"H20": H20, "FAST": FAST, "SLOW": SLOW}, ControllerConfig(**{**base, **config})
    )


def test_each_gpu_is_placed_by_its_own_profile():
    assert (FAST.capacity, SLOW.capacity, H20.capacity) == (16, 3, 12)
    controller = _pool()
    env = Env(controller)
    env.send(Event(0.0, EventKind.GPU_READY, gpu_id="fast-a", gpu_kind="FAST"))
    env.send(Event(0.0, EventKind.GPU_READY, gpu_id="slow-a", gpu_kind="SLOW"))
    view = controller.view
    assert [view.kind_of(g) for g in ("h20-0000", "fast-a", "slow-a")] == ["H20", "FAST", "SLOW"]
    assert [view.capacity_of(g) for g in ("h20-0000", "fast-a", "slow-a")] == [12, 16, 3]
    active = set()
    for i in range(30):
        active.add(f"s{i}")
        env.send(Event(1.0 + i, EventKind.ARRIVE, f"s{i}"))
        env.check(active)
    loads = view.active_counts
    # Least latency growth across kinds: the fast GPU takes sessions until its next chunk
    # would be slower than an H20's, the slow one only when nothing else is faster.
    assert loads["fast-a"] > loads["h20-0000"] > loads["slow-a"]
    worst = max(
        kind.chunk_ms(loads[g])
        for g, kind in (("h20-0000", H20), ("fast-a", FAST), ("slow-a", SLOW))
    )
    assert worst == view.worst_latency_ms()
    assert loads["fast-a"] <= 16 and loads["slow-a"] <= 3


def test_rebalance_moves_off_the_slowest_gpu_by_its_own_profile():
    """Two GPUs with the same load: the slow one is the worst; a move to the fast one gains."""
    controller = _pool(initial_gpus=0, eta=0.0)
    env = Env(controller)
    env.send(Event(0.0, EventKind.GPU_READY, gpu_id="slow-a", gpu_kind="SLOW"))
    for i in range(3):
        env.send(Event(1.0 + i, EventKind.ARRIVE, f"s{i}"))
    assert controller.view.active_counts == {"slow-a": 3}
    out = env.send(Event(5.0, EventKind.GPU_READY, gpu_id="fast-a", gpu_kind="FAST"))
    moves = [d for d in out if isinstance(d, Migrate)]
    # 3 on SLOW (1,124 ms) -> 0 on SLOW, 3 on FAST (300 ms): each move lowers the worst.
    assert [(m.src, m.dst) for m in moves] == [("slow-a", "fast-a")] * 3
    env.check({"s0", "s1", "s2"})


def test_a_gpu_of_a_kind_without_a_profile_uses_the_default_until_given_one():
    controller = _pool()
    env = Env(controller)
    env.send(Event(0.0, EventKind.GPU_READY, gpu_id="odd-a", gpu_kind="ODD"))
    assert controller.view.capacity_of("odd-a") == H20.capacity
    controller.set_profile("ODD", replace(SLOW, gpu_kind="ODD"))
    assert controller.view.capacity_of("odd-a") == 3
    controller.set_profile("H20", replace(H20, name="h20-remeasured"))
    assert controller.view.profiles["ODD"].name == "slow"  # its own now, not the default's


def test_a_booting_gpu_that_comes_up_as_another_kind_takes_that_kind():
    controller = _pool(autoscale=True, rho_hat=0.5, delta=0.1)
    env = Env(controller)
    requested = []
    for i in range(12):
        out = env.send(Event(float(i), EventKind.ARRIVE, f"s{i}"))
        requested += [d for d in out if isinstance(d, RequestGpus)]
    assert requested and requested[0].kind == "H20"
    env.boot_one(kind="FAST")
    gpu_id = requested[0].gpu_ids[0]
    assert controller.view.kind_of(gpu_id) == "FAST" and controller.view.capacity_of(gpu_id) == 16
    env.check({f"s{i}" for i in range(12)})


def test_a_lower_k_moves_sessions_off_and_asks_for_room():
    """A remeasured profile with K = 4 on a GPU that holds 10: the excess moves to GPUs with
    room; what does not fit makes the autoscaler ask for more (rho_max above 1)."""
    config = ControllerConfig(rho_hat=0.7, delta=0.1, initial_gpus=2, warmup_s=0.0)
    controller = Controller(H20, replace(config, autoscale=False))
    for i in range(20):
        controller.step(Event(float(i), EventKind.ARRIVE, f"s{i}"))
    assert sorted(controller.view.active_counts.values()) == [10, 10]
    controller.config = config
    slow = profile_from_measurements({1: 300.0, 4: 1200.0}, H20)
    assert slow.capacity == 4
    controller.set_profile("H20", slow)
    assert controller.rho_max() == 10 / 4
    out = controller.step(Event(30.0, EventKind.TICK))
    request = [d for d in out if isinstance(d, RequestGpus)]
    assert request and sum(len(d.gpu_ids) for d in request) >= 3  # 20 sessions / 4 per GPU
    for gpu_id in [g for d in request for g in d.gpu_ids]:
        controller.step(Event(40.0, EventKind.GPU_READY, gpu_id=gpu_id))
    assert max(controller.view.active_counts.values()) <= 4


def test_the_autoscaler_counts_gpus_in_units_of_the_default_kind():
    """One FAST GPU (K = 16) in a pool whose default kind is H20 (K = 12) counts 16 / 12."""
    big = replace(
        FAST, chunk_ms_table=FAST.chunk_ms_table + (960.0,) * 8, name="big", gpu_memory_bytes=None
    )
    assert big.capacity == 24
    controller = Controller(
        {"H20": H20, "BIG": replace(big, gpu_kind="BIG")},
        ControllerConfig(rho_hat=0.5, delta=0.1, initial_gpus=0, gpu_kind="H20", warmup_s=0.0),
    )
    controller.step(Event(0.0, EventKind.GPU_READY, gpu_id="big-a", gpu_kind="BIG"))
    assert controller._cluster.budget_units() == 2  # 24 / 12
    out = []
    for i in range(20):
        out += controller.step(Event(1.0 + i, EventKind.ARRIVE, f"s{i}"))
    # 20 active at rho_hat 0.5 (band top 0.6: 7 per H20): ceil(20 / 6) = 4 H20 units; the big
    # GPU is worth 2, so 2 H20 GPUs are asked for, not 4.
    asked = [g for d in out if isinstance(d, RequestGpus) for g in d.gpu_ids]
    assert len(asked) == 2 and all(d.kind == "H20" for d in out if isinstance(d, RequestGpus))
