"""The live latency model: what the workers of a kind measure, over the shipped profile."""

from __future__ import annotations

import pytest

from services.scheduler.measured import differs, live_profile
from shared.profile import ProfileError, load_profile
from shared.wire import Heartbeat, WorkerStatus

H20 = load_profile()


def beat(wid: str = "w", kind: str = "H20", **kw) -> Heartbeat:
    fields = {"capacity": 12, "active": 0, "chunk_period_s": 1.25, "gpu_kind": kind, **kw}
    return Heartbeat(worker_id=wid, status=WorkerStatus.READY, **fields)


def test_an_unmeasured_emulated_kind_is_its_shipped_profile():
    profile = live_profile("H20", [beat()], H20)
    assert profile.capacity == H20.capacity == 12
    assert profile.chunk_ms(5) == H20.chunk_ms(5) and profile.deadline_ms == 1250.0


def test_measurements_replace_the_shipped_times_and_slots_bound_k():
    measured = beat(chunk_ms={1: 500.0, 4: 900.0}, capacity=6)
    other = beat("w2", chunk_ms={1: 520.0}, capacity=8)
    profile = live_profile("H20", [measured, other], H20)
    assert profile.chunk_ms(1) == pytest.approx(510.0)  # the median of the two workers
    assert profile.chunk_ms(4) == pytest.approx(900.0)
    assert profile.capacity <= 6  # the smallest worker's slots
    assert profile.name == "H20-measured"


def test_the_period_is_the_deadline_and_handoffs_give_the_migration_cost():
    b = beat(
        chunk_period_s=0.75,
        capacity=4,
        chunk_ms={1: 30.0},
        state_bytes=2 * 1024 * 1024,
        handoff_fixed_ms=3.0,
        handoff_ms_per_mib=0.5,
        gpu_kind="cpu",
    )
    profile = live_profile("cpu", [b], H20)
    assert profile.deadline_ms == 750.0
    assert profile.gpu_kind == "cpu" and profile.capacity == 4
    assert profile.migration_fixed_ms == 3.0
    assert profile.migration_per_session_ms == pytest.approx(3.0 + 0.5 * 2)
    assert profile.state_bytes_per_session == 2 * 1024 * 1024


def test_an_unknown_kind_without_measurements_keeps_pace_at_its_slots():
    profile = live_profile("cpu", [beat(kind="cpu", chunk_period_s=0.25, capacity=8)], H20)
    assert profile.capacity == 8 and profile.chunk_ms(8) <= 250.0


def test_an_unusable_measurement_is_an_error_the_caller_survives():
    with pytest.raises(ProfileError):
        live_profile("H20", [beat(chunk_ms={1: 5000.0})], H20)
    with pytest.raises(ProfileError):
        live_profile("H20", [beat(capacity=0)], H20)


def test_differs_ignores_noise_and_sees_change():
    a = live_profile("H20", [beat(chunk_ms={1: 500.0})], H20)
    b = live_profile("H20", [beat(chunk_ms={1: 510.0})], H20)
    c = live_profile("H20", [beat(chunk_ms={1: 800.0})], H20)
    assert not differs(a, b) and differs(a, c)


def test_k_leaves_room_for_the_prompt_switch_the_workers_measure():
    """The default profile's K = 12 meets the 1250 ms deadline with 49 ms to spare; a prompt
    switch (LongLive's KV re-cache) that adds 120 ms to its chunk would break it at 12."""
    plain = live_profile("H20", [beat()], H20)
    switching = live_profile(
        "H20", [beat(prompt_switch_ms=100.0), beat("w2", prompt_switch_ms=140.0)], H20
    )
    assert switching.prompt_switch_ms == pytest.approx(120.0)
    assert switching.capacity < plain.capacity == 12
    assert switching.chunk_ms(switching.capacity) + 120.0 <= switching.deadline_ms
    assert differs(plain, switching)


def test_six_steady_sessions_keep_one_emulated_gpu():
    """A live run on ``turboserve up`` (one CPU worker emulating an H20, six steady sessions):
    the worker timed whole chunks at batches 1 and 2 only (531 and 621-660 ms) and passes at
    every batch 1-6. From the chunk times alone K came out 6 to 8, and the loop asked for a
    second GPU for six sessions, spread three onto it and consolidated them back once the
    volatility level turned calm: 1 scale-out, 1 scale-in, 6 migrations for nothing. With the
    pass times K is 10 and the pool stays at one GPU for ten minutes."""
    from services.scheduler.core.config import ControllerConfig
    from services.scheduler.core.loop import Controller
    from services.scheduler.core.types import Drain, Event, EventKind, Migrate, RequestGpus
    from services.scheduler.shipped import load_rho_table

    passes = {b: H20.chunk_ms(b) / H20.passes_per_chunk for b in range(1, 7)}
    for batch_2_ms in (621.0, 640.0, 660.0):
        profile = live_profile(
            "H20", [beat(chunk_ms={1: 531.0, 2: batch_2_ms}, pass_ms=passes, active=6)], H20
        )
        config = ControllerConfig(
            rho_table=load_rho_table(),
            boot_delay_s=5.0,
            initial_gpus=0,
            min_gpus=1,
            max_gpus=4,
            gpu_kind="H20",
        )
        core = Controller({"H20": H20}, config)
        decisions = core.step(Event(0.0, EventKind.GPU_READY, gpu_id="w-1", gpu_kind="H20"))
        core.set_profile("H20", profile)
        for i in range(6):  # one arrival every 2 s, as `turboserve replay` played them
            decisions += core.step(Event(1.0 + 2 * i, EventKind.ARRIVE, session_id=f"s{i}"))
        for tick in range(24, 1200):  # ten minutes of ticks every 0.5 s
            decisions += core.step(Event(tick / 2, EventKind.TICK))
        churn = [d for d in decisions if isinstance(d, RequestGpus | Drain | Migrate)]
        assert churn == [], (batch_2_ms, profile.capacity, churn)
