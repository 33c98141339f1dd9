"""Properties of the simulator with the real core policies, over random small traces.

Besides the simulator's own invariants this checks the contract between core and environment:
every decision a built-in policy emits can be carried out (no SimulationError)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lab.sim.simulator import simulate
from lab.sim.traceio import make_trace
from shared.profile import load_profile

PROFILE = load_profile()


@st.composite
def traces(draw):
    events = []
    n = draw(st.integers(1, 40))
    for i in range(n):
        t = draw(st.floats(0, 100, allow_nan=False).map(lambda x: round(x, 3)))
        spells = draw(
            st.lists(st.floats(0.01, 30).map(lambda x: round(x, 3)), min_size=1, max_size=6)
        )
        sid = f"s{i}"
        events.append((t, sid, "arrive"))
        active = True
        for k, spell in enumerate(spells):
            t = round(t + spell, 3)
            if k < len(spells) - 1:
                active = not active
                events.append((t, sid, "active" if active else "idle"))
        if draw(st.booleans()):
            events.append((t, sid, "depart"))
    return make_trace("random", events)


def active_seconds(trace):
    """Integral of the active-session count over the trace (sessions stay until its end)."""
    points = trace.active_counts() + [(trace.duration, 0)]
    return sum(n * (t1 - t0) for (t0, n), (t1, _) in zip(points, points[1:], strict=False))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    trace=traces(),
    policy=st.sampled_from(
        ["turboserve", "no_migration", "round_robin", "memory_aware", "no_autoscale"]
    ),
    boot=st.sampled_from([0.0, 5.0, 30.0]),
)
def test_invariants(trace, policy, boot):
    active_time = active_seconds(trace)
    activations = sum(1 for e in trace.events if e.event in ("arrive", "active"))
    params = {"gpus": 2} if policy in ("round_robin", "memory_aware", "no_autoscale") else {}
    r = simulate(trace, policy, PROFILE, boot_delay_s=boot, **params)
    min_step = PROFILE.chunk_ms(1)
    period_s = PROFILE.deadline_ms / 1000.0
    # Latency is lateness against the worker's clock; a first chunk takes at least one chunk
    # at batch 1 after the worker started the session (its clock's origin).
    assert all(x >= 0.0 for x in r.latencies_ms)
    assert all(x >= min_step - 1e-6 for x in r.first_chunk_latencies_ms)
    # Pacing: per active spell, its first chunk, then at most one per period, one period ahead.
    assert r.chunks <= active_time / period_s + 2 * activations + 1
    # Cost is between zero and holding the peak pool for the whole trace.
    assert 0.0 <= r.cost_gpu_seconds <= r.peak_gpus * trace.duration + 1e-6
    assert 0.0 <= r.deadline_attainment <= 1.0
    # A late chunk misses at least one period: service per period is never better than per chunk.
    assert 0.0 <= r.stall_adjusted_attainment <= r.deadline_attainment + 1e-12
    assert r.on_time_chunks + r.missed_periods >= r.chunks
    assert len(r.first_chunk_latencies_ms) + len(r.stream_latencies_ms) == r.chunks
    assert r.late_chunks_after_migration <= r.chunks_after_migration
    if policy != "turboserve" and policy != "no_autoscale":
        assert r.migrations == 0
    again = simulate(trace, policy, PROFILE, boot_delay_s=boot, **params)
    assert again.latencies_ms == r.latencies_ms and again.cost_gpu_seconds == r.cost_gpu_seconds
    assert again.missed_periods == r.missed_periods
