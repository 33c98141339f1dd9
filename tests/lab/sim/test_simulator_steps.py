"""The quality budget in the simulator, worked out by hand: a chunk that starts on a GPU at
``s`` denoising steps runs ``s + 1`` passes (each costing ``pass_ms(batch)`` as at full steps),
``SetSteps`` applies to chunks that start after it, and each chunk is counted on time at full
steps, on time at fewer, or late."""

from __future__ import annotations

import pytest

from lab.sim.report import quality_lines
from lab.sim.simulator import SimulationError, simulate
from lab.sim.traceio import make_trace
from services.scheduler.core.types import Assign, EventKind, SetSteps
from shared.profile import profile_from_dict

from .test_simulator_passes import PROFILE, RAW, ScriptedPolicy, _sorted


def test_a_chunk_at_fewer_steps_runs_fewer_passes_from_the_next_chunk_on():
    # One session alone on g0, back to back: passes of 20 ms, 100 ms chunks at 4 steps.
    # At 0.15 (mid-chunk) the GPU is set to 2 steps: the chunk in flight (0.10-0.20) keeps its
    # 5 passes; the chunks after run 3 passes, 60 ms: done at 0.26, 0.32, 0.38 (0.44 is after
    # the departure at 0.40).
    trace = make_trace(
        "fewer", [(0.0, "a", "arrive"), (0.15, "x", "arrive"), (0.40, "a", "depart")]
    )
    policy = ScriptedPolicy(
        {
            (EventKind.ARRIVE, "a"): [Assign("a", "g0")],
            (EventKind.ARRIVE, "x"): [SetSteps("g0", 2)],
        }
    )
    r = simulate(trace, policy, PROFILE, tick_s=0, chunk_period_s=0)
    assert _sorted(r.latencies_ms) == [60.0, 60.0, 60.0, 100.0, 100.0]
    assert (r.on_time_full, r.on_time_reduced, r.late) == (2, 3, 0)
    assert r.reduced_pct == pytest.approx(60.0)
    doc = r.to_json()
    assert (doc["on_time_full"], doc["on_time_reduced"], doc["late"]) == (2, 3, 0)
    assert doc["reduced_pct"] == 60.0


def test_a_paced_gpu_over_its_deadline_is_on_time_at_fewer_steps():
    # Three sessions on one GPU, paced at the 180 ms deadline: at full steps a chunk takes
    # 200 ms (5 passes of 40 ms) and every chunk after the first is late. At 3 steps it takes
    # 4 x 40 = 160 ms: on time.
    events = [(0.0, s, "arrive") for s in "abc"] + [(2.0, s, "depart") for s in "abc"]
    script = {(EventKind.ARRIVE, s): [Assign(s, "g0")] for s in "abc"}
    full = simulate(make_trace("paced", events), ScriptedPolicy(script), PROFILE, tick_s=0)
    script[(EventKind.ARRIVE, "a")] = [Assign("a", "g0"), SetSteps("g0", 3)]
    fewer = simulate(make_trace("paced", events), ScriptedPolicy(script), PROFILE, tick_s=0)
    assert full.late > 0 and full.on_time_reduced == 0 and full.reduced_pct == 0.0
    assert full.on_time_full + full.late == full.chunks
    assert fewer.late == 0 and fewer.on_time_full == 0
    assert fewer.on_time_reduced == fewer.chunks and fewer.reduced_pct == 100.0
    assert fewer.stall_adjusted_attainment == 1.0 > full.stall_adjusted_attainment
    lines = quality_lines([{**full.to_json(), "policy": "a"}, {**fewer.to_json(), "policy": "b"}])
    assert lines[0].startswith("quality budget, b: 0 chunks on time at full steps")
    assert lines[0].endswith("100.00% at fewer steps")
    assert lines[1:] == ["quality budget: every chunk of a ran full steps"]
    assert quality_lines([full.to_json()]) == []  # nothing reduced: no footer


@pytest.mark.parametrize(
    ("steps", "raw", "reason"),
    [
        (0, RAW, r"steps must be in 1\.\.4"),
        (5, RAW, r"steps must be in 1\.\.4"),
        (2, {**RAW, "passes_per_chunk": 1, "steps": {"full": 4}}, "fewer steps cannot be timed"),
    ],
)
def test_a_step_count_the_simulator_cannot_time_is_an_error(steps, raw, reason):
    trace = make_trace("bad", [(0.0, "a", "arrive"), (0.3, "a", "depart")])
    policy = ScriptedPolicy({(EventKind.ARRIVE, "a"): [Assign("a", "g0"), SetSteps("g0", steps)]})
    with pytest.raises(SimulationError, match=reason):
        simulate(trace, policy, profile_from_dict(raw), tick_s=0, chunk_period_s=0)


def test_turboserve_q_trades_reduced_chunks_for_late_ones_at_the_same_cost():
    # The bursty built-in trace on the H20 profile: the same autoscaler with the budget on
    # serves more chunk periods on time, at the same pool, with some chunks at 3 of 4 steps;
    # without it nothing is reduced.
    plain = simulate("bursty", "turboserve", "h20-longlive-1.3b-nvlink")
    budget = simulate("bursty", "turboserve_q", "h20-longlive-1.3b-nvlink")
    assert plain.reduced_pct == 0.0 and plain.on_time_reduced == 0
    assert plain.on_time_full + plain.late == plain.chunks
    assert budget.on_time_full + budget.on_time_reduced + budget.late == budget.chunks
    assert 0.0 < budget.reduced_pct < 20.0
    assert budget.late < plain.late
    assert budget.stall_adjusted_attainment > plain.stall_adjusted_attainment
