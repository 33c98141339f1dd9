"""The simulator on a tiny trace whose cost and latencies were worked out by hand.

The policy is scripted (fixed decisions per event), so the arithmetic depends only on the
simulator's timing model, not on any controller.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lab.sim.simulator import SimulationError, simulate
from lab.sim.traceio import make_trace
from services.scheduler.core.types import (
    Assign,
    Drain,
    EventKind,
    GpuState,
    Migrate,
    Release,
    RequestGpus,
    Resume,
    Suspend,
)
from shared.profile import profile_from_dict

# Chunk time 100 ms at batch 1, 150 ms at batch 2, 200 ms at batch 3; deadline 180 ms (so K=2);
# migration 10 ms per session; $3.60 per GPU-hour = $0.001 per GPU-second.
PROFILE = profile_from_dict(
    {
        "name": "tiny",
        "gpu_kind": "T",
        "model": "m",
        "chunk_ms": [100.0, 150.0, 200.0],
        "deadline_ms": 180.0,
        "state_bytes_per_session": 1,
        "migration": {"per_session_ms": 10.0, "fixed_ms": 0.0},
        "price_usd_per_gpu_hour": 3.6,
    }
)

TRACE = make_trace(
    "tiny",
    [
        (0.0, "a", "arrive"),
        (0.25, "b", "arrive"),
        (1.5, "a", "idle"),
        (2.0, "b", "depart"),
        (2.5, "a", "depart"),
    ],
)


class ScriptedPolicy:
    """Answers each event with a fixed list of decisions; starts with GPU g0 ready."""

    name = "scripted"

    def __init__(self, script):
        self.script = script
        self.view = SimpleNamespace(gpus={"g0": None})
        self.seen: list[tuple] = []

    def step(self, event):
        if event.kind is EventKind.GPU_READY:
            self.view.gpus[event.gpu_id] = None  # it holds every GPU that comes up
        key = (event.kind, event.session_id or event.gpu_id)
        self.seen.append((event.t, *key))
        return list(self.script.get(key, []))

    def note_pass(self, gpu_id, ends_at):
        pass  # it places by script, not by pass phase


SCRIPT = {
    (EventKind.ARRIVE, "a"): [Assign("a", "g0")],
    (EventKind.ARRIVE, "b"): [RequestGpus(("g1",), "T"), Assign("b", "g0")],
    (EventKind.GPU_READY, "g1"): [Migrate("b", "g0", "g1")],
    (EventKind.IDLE, "a"): [Suspend("a", "g0"), Drain("g0"), Release("g0")],
    (EventKind.DEPART, "b"): [Release("g1")],
}


def test_hand_checked_tiny_trace():
    policy = ScriptedPolicy(SCRIPT)
    r = simulate(TRACE, policy, PROFILE, boot_delay_s=1.0, tick_s=0, chunk_period_s=0)
    # Timeline, worked by hand:
    # g0: [a] steps 0-0.1, 0.1-0.2, 0.2-0.3             -> 3 chunks of a at 100 ms.
    #     b arrives at 0.25 (due 0.25) and joins the step at the 0.3 boundary:
    #     [a,b] 0.30-0.45                                 -> a 150 ms, b 0.45-0.25 = 200 ms.
    #     [a,b] ends 0.60 0.75 0.90 1.05 1.20 1.35        -> 6 steps x 2 chunks of 150 ms.
    # g1 requested at 0.25, boots 1 s, ready at 1.25; b migrates then, but its chunk is in
    #     flight on g0 until 1.35; its 10 ms copy ends at 1.36 and the idle g1 starts [b]
    #     1.36-1.46 -> b 1.46 - 1.35 = 110 ms. g0 runs [a] 1.35-1.45 -> a 100 ms.
    # a goes idle at 1.5 inside g0's step 1.45-1.55: that chunk is not delivered to an active
    #     session and is not counted; g0 is released then and stops costing at 1.55.
    # g1: [b] steps end 1.56 1.66 1.76 1.86 1.96        -> 5 chunks of b at 100 ms; b departs
    #     at 2.0 inside the step 1.96-2.06 (not counted); g1 is released, stops costing at 2.06.
    # Chunks: 3 + 2 + 12 + 1 + 1 + 5 = 24: nine of 100, one of 110, thirteen of 150, one of 200.
    assert r.chunks == 24
    assert sorted(round(x, 6) for x in r.latencies_ms) == [100.0] * 9 + [110.0] + [150.0] * 13 + [
        200.0
    ]
    # p50: position 23 * 0.5 = 11.5 -> both neighbours are 150. p99: position 22.77 between
    # 150 and 200 -> 150 + 0.77 * 50 = 188.5. Max 200.
    lat = r.latency()
    assert lat["p50"] == pytest.approx(150.0)
    assert lat["p99"] == pytest.approx(188.5)
    assert lat["max"] == pytest.approx(200.0)
    # Deadline 180 ms: only b's first chunk (200 ms) misses -> 23/24.
    assert r.deadline_attainment == pytest.approx(23 / 24)
    # First chunks after becoming active: a at 100 ms, b at 200 ms.
    assert sorted(round(x, 6) for x in r.first_chunk_latencies_ms) == [100.0, 200.0]
    # Cost: g0 0 -> 1.55 = 1.55 s; g1 0.25 -> 2.06 = 1.81 s; total 3.36 GPU-s = $0.00336.
    assert r.cost_gpu_seconds == pytest.approx(3.36)
    assert r.cost_usd == pytest.approx(0.00336)
    assert r.migrations == 1
    # b's chunk delivered on g0 at 1.35 is not "after the migration"; the one on g1 (110 ms) is.
    assert (r.chunks_after_migration, r.late_chunks_after_migration) == (1, 0)
    # Scale events: the request at 0.25, drain+release at 1.5 (one event), release at 2.0.
    assert r.scale_events == 3
    assert r.peak_gpus == 2
    assert r.duration_s == 2.5
    # One timed decision per policy call.
    assert len(r.decision_times_ms) == len(policy.seen) == 6
    # The policy heard every trace event plus g1's GPU_READY at 1.25, in time order.
    assert [(round(t, 6), k) for t, k, _ in policy.seen] == [
        (0.0, EventKind.ARRIVE),
        (0.25, EventKind.ARRIVE),
        (1.25, EventKind.GPU_READY),
        (1.5, EventKind.IDLE),
        (2.0, EventKind.DEPART),
        (2.5, EventKind.DEPART),
    ]


def test_sessions_wait_for_a_booting_gpu():
    # One session, no GPU at start: the policy asks for one at arrival and assigns on READY.
    trace = make_trace("wait", [(0.0, "a", "arrive"), (3.05, "a", "depart")])

    class Boot(ScriptedPolicy):
        def __init__(self):
            super().__init__(
                {
                    (EventKind.ARRIVE, "a"): [RequestGpus(("g",), "T")],
                    (EventKind.GPU_READY, "g"): [Assign("a", "g")],
                }
            )
            self.view = SimpleNamespace(gpus={})

    r = simulate(trace, Boot(), PROFILE, boot_delay_s=2.0, tick_s=0, chunk_period_s=0)
    # Ready at 2.0, first chunk at 2.1: 100 ms by the worker's clock (it started the session
    # at 2.0), 2100 ms after the viewer asked: late by 2100 - 180 = 1920 ms, i.e.
    # ceil(1920 / 180) = 11 missed periods; then 2.2 ... 3.0 -> 9 more chunks of 100 ms; the
    # step 3.0-3.1 is cut by the depart at 3.05.
    assert r.first_chunk_latencies_ms == [pytest.approx(100.0)]
    assert r.chunks == 10 and r.on_time_chunks == 9 and r.missed_periods == 11
    assert r.deadline_attainment == pytest.approx(0.9)
    assert r.stall_adjusted_attainment == pytest.approx(9 / 20)
    # The GPU costs from its request at 0 to the end of the trace at 3.05.
    assert r.cost_gpu_seconds == pytest.approx(3.05)


def test_releasing_a_gpu_with_an_active_session_is_an_error():
    bad = dict(SCRIPT)
    bad[(EventKind.ARRIVE, "b")] = [Assign("b", "g0"), Release("g0")]
    with pytest.raises(SimulationError, match="still holds active sessions"):
        simulate(TRACE, ScriptedPolicy(bad), PROFILE, boot_delay_s=1.0, tick_s=0, chunk_period_s=0)


def test_unknown_gpu_is_an_error():
    bad = {(EventKind.ARRIVE, "a"): [Assign("a", "nope")]}
    with pytest.raises(SimulationError, match="unknown or released GPU nope"):
        simulate(TRACE, ScriptedPolicy(bad), PROFILE, tick_s=0, chunk_period_s=0)


def test_unserved_active_session_counts_as_late():
    # Nobody ever places b: at the end (2.5 s) its first chunk has waited 2.25 s, 2.07 s past
    # the deadline: ceil(2070 / 180) = 12 missed periods, though no chunk of it exists.
    script = {(EventKind.ARRIVE, "a"): [Assign("a", "g0")]}
    trace = make_trace("t", [(0.0, "a", "arrive"), (0.25, "b", "arrive"), (2.5, "a", "depart")])
    r = simulate(trace, ScriptedPolicy(script), PROFILE, tick_s=0, chunk_period_s=0)
    # a: one chunk per 100 ms (the one due at 2.5 s is cut by the departure: float sums).
    assert r.chunks == 24 and r.deadline_attainment == 1.0
    assert r.missed_periods == 12 and r.unserved_chunks == 1
    assert r.stall_adjusted_attainment == pytest.approx(24 / 36)


def test_drain_then_release_is_one_scale_event():
    trace = make_trace("d", [(0.0, "a", "arrive"), (1.0, "a", "idle"), (2.0, "a", "depart")])
    script = {
        (EventKind.ARRIVE, "a"): [Assign("a", "g0")],
        (EventKind.IDLE, "a"): [Suspend("a", "g0"), Drain("g0")],
        (EventKind.DEPART, "a"): [Release("g0")],
    }
    r = simulate(trace, ScriptedPolicy(script), PROFILE, tick_s=0, chunk_period_s=0)
    assert r.scale_events == 1
    # g0 is idle from a's last step (ending at about 1.0) and released at 2.0 with nothing in
    # flight, so it costs 0 -> 2.0 = 2.0 GPU-s.
    assert r.cost_gpu_seconds == pytest.approx(2.0)


def test_session_resumed_elsewhere_while_its_void_chunk_runs():
    # a goes idle at 0.25 inside g0's step 0.2-0.3 and comes back at 0.27 onto the idle g1.
    # g1 cannot start it before its void chunk ends on g0 at 0.3; then g1 runs 0.3-0.4 -> first
    # chunk 0.4 - 0.27 = 130 ms, then 0.5 ... 0.9 -> five of 100 ms; a departs at 0.95.
    # Chunks: 0.1 and 0.2 on g0 (100 ms each), the void one is not counted: 8 in all.
    trace = make_trace(
        "r",
        [(0.0, "a", "arrive"), (0.25, "a", "idle"), (0.27, "a", "active"), (0.95, "a", "depart")],
    )
    policy = ScriptedPolicy(
        {
            (EventKind.ARRIVE, "a"): [Assign("a", "g0")],
            (EventKind.IDLE, "a"): [Suspend("a", "g0")],
            (EventKind.ACTIVE, "a"): [Resume("a", "g1")],
        }
    )
    policy.view = SimpleNamespace(gpus={"g0": None, "g1": None})
    r = simulate(trace, policy, PROFILE, tick_s=0, chunk_period_s=0)
    assert sorted(round(x, 6) for x in r.latencies_ms) == [100.0] * 7 + [130.0]
    assert r.cost_gpu_seconds == pytest.approx(2 * 0.95)


def test_resume_from_host_ram_pays_its_copy():
    # a idles at 0.25 inside the step 0.2-0.3 (void), comes back at 0.5 onto the idle g0 with
    # a 50 ms host->GPU copy, done at 0.55: step 0.55-0.65 -> first chunk 150 ms. Departs at
    # 0.68, inside the step 0.65-0.75. Chunks: 0.1 and 0.2 (100 ms each) and the 150 ms one. Without the copy:
    # step 0.5-0.6 (100 ms), and the step 0.6-0.7 is cut by the depart.
    trace = make_trace(
        "h",
        [(0.0, "a", "arrive"), (0.25, "a", "idle"), (0.5, "a", "active"), (0.68, "a", "depart")],
    )
    script = {
        (EventKind.ARRIVE, "a"): [Assign("a", "g0")],
        (EventKind.IDLE, "a"): [Suspend("a", "g0")],
        (EventKind.ACTIVE, "a"): [Resume("a", "g0")],
    }
    r = simulate(
        trace,
        ScriptedPolicy(script),
        PROFILE,
        tick_s=0,
        chunk_period_s=0,
        resume_ms=50.0,
        keep_chunk_times=True,
    )
    # The worker's clock starts once the state is back (0.55): 100 ms by it, delivered at 0.65.
    assert sorted(round(x, 6) for x in r.latencies_ms) == [100.0, 100.0, 100.0]
    assert [round(t, 6) for t in r.chunk_times_s] == [0.1, 0.2, 0.65]
    free = simulate(
        trace, ScriptedPolicy(script), PROFILE, tick_s=0, chunk_period_s=0, keep_chunk_times=True
    )
    assert [round(t, 6) for t in free.chunk_times_s] == [0.1, 0.2, 0.6]


def test_a_copy_delays_only_the_moved_session():
    # g0: [a] 0-0.1, 0.1-0.2 (100 ms each); b arrives at 0.12 and joins [a,b] 0.2-0.35 -> b's
    #     first chunk 0.35 - 0.12 = 230 ms. a idles at 0.3 (its chunk at 0.35 is void) and b
    #     is moved to g1 then; its chunk in flight ends at 0.35, the 10 ms copy at 0.36.
    # g1: c arrives at 0.07: [c] 0.07-0.17, -0.27, -0.37 (100 ms each). b is ready at 0.36 but
    #     g1 is mid-step: [b,c] 0.37-0.52 -> b 0.52 - 0.35 = 170 ms, c 150 ms: c's step is
    #     not stretched by b's copy. Everyone departs at 0.6, inside the next step.
    trace = make_trace(
        "o",
        [
            (0.0, "a", "arrive"),
            (0.07, "c", "arrive"),
            (0.12, "b", "arrive"),
            (0.3, "a", "idle"),
            (0.6, "a", "depart"),
            (0.6, "b", "depart"),
            (0.6, "c", "depart"),
        ],
    )
    policy = ScriptedPolicy(
        {
            (EventKind.ARRIVE, "a"): [Assign("a", "g0")],
            (EventKind.ARRIVE, "c"): [Assign("c", "g1")],
            (EventKind.ARRIVE, "b"): [Assign("b", "g0")],
            (EventKind.IDLE, "a"): [Suspend("a", "g0"), Migrate("b", "g0", "g1")],
        }
    )
    policy.view = SimpleNamespace(gpus={"g0": None, "g1": None})
    r = simulate(trace, policy, PROFILE, tick_s=0, chunk_period_s=0)
    assert sorted(round(x, 6) for x in r.latencies_ms) == [100.0] * 5 + [150.0, 170.0, 230.0]
    assert (r.chunks_after_migration, r.late_chunks_after_migration) == (1, 0)


# ---- playback pacing (the live worker's model), worked by hand ---------------------------------
# The same tiny profile: chunk period P = the deadline, 180 ms; lead = P; one pass per chunk.


def test_one_paced_session_runs_at_most_one_period_ahead():
    # a is assigned at 0: due_0 = 0, its first chunk runs 0-0.1 (100 ms by the worker's clock,
    # startup 100 ms: on time). due_1 = max(0, 0.1) + 0.18 = 0.28; it may start at
    # 0.28 - max(lead 0.18, chunk 0.1) = 0.10: runs 0.1-0.2, 80 ms ahead of its due time.
    # due_2 = 0.46, start 0.28: the GPU sits idle 0.2-0.28; done 0.38; and so on every 0.18 s:
    # chunks at 0.1, 0.2, 0.38, 0.56, 0.74, 0.92; a departs at 1.0 (the chunk 0.92-1.02 is cut).
    trace = make_trace("p", [(0.0, "a", "arrive"), (1.0, "a", "depart")])
    policy = ScriptedPolicy({(EventKind.ARRIVE, "a"): [Assign("a", "g0")]})
    r = simulate(trace, policy, PROFILE, tick_s=0, keep_chunk_times=True)
    assert r.chunk_period_s == pytest.approx(0.18)
    assert [round(t, 6) for t in r.chunk_times_s] == [0.1, 0.2, 0.38, 0.56, 0.74, 0.92]
    assert [round(x, 6) for x in r.latencies_ms] == [100.0, 0, 0, 0, 0, 0]
    assert r.deadline_attainment == 1.0 and r.stall_adjusted_attainment == 1.0
    # With no lead the worker starts each chunk one chunk time before it is due: due_1 = 0.28,
    # start 0.18, done 0.28; then 0.46, 0.64, 0.82, 1.0 (a pass that ends as the session
    # leaves delivers first).
    lazy = simulate(
        trace,
        ScriptedPolicy({(EventKind.ARRIVE, "a"): [Assign("a", "g0")]}),
        PROFILE,
        tick_s=0,
        keep_chunk_times=True,
        lead_s=0.0,
    )
    assert [round(t, 6) for t in lazy.chunk_times_s] == [0.1, 0.28, 0.46, 0.64, 0.82, 1.0]
    assert lazy.deadline_attainment == 1.0


def test_an_overloaded_gpu_stalls_every_viewer_and_their_clocks_slip():
    # Three sessions assigned to one GPU at 0, one event after another: a starts alone,
    # [a] 0-0.1 (first chunk, 100 ms: on time). b and c join at the next pass boundary, and
    # so does a (due_1 = 0.28, start 0.28 - 0.18 = 0.1): [a, b, c] 0.1-0.3, 200 ms > P.
    # a is late by 20 ms; b and c's first chunks come 300 ms after they were assigned
    # (startup 300 > 180 ms). Every clock slips to 0.3 + 0.18 = 0.48, start 0.3, done 0.5:
    # late by 20 ms; then 0.7 and 0.9, where the chunks are delivered before the departures at
    # the same instant. 13 chunks, 1 on time; each late one froze its viewer for one period.
    trace = make_trace(
        "o", [(0.0, s, "arrive") for s in "abc"] + [(0.9, s, "depart") for s in "abc"]
    )
    policy = ScriptedPolicy({(EventKind.ARRIVE, s): [Assign(s, "g0")] for s in "abc"})
    r = simulate(trace, policy, PROFILE, tick_s=0, keep_chunk_times=True)
    assert [round(t, 6) for t in r.chunk_times_s] == [0.1] + [0.3] * 3 + [0.5] * 3 + [0.7] * 3 + [
        0.9
    ] * 3
    assert sorted(round(x, 6) for x in r.latencies_ms) == [20.0] * 10 + [100.0] + [300.0] * 2
    assert r.on_time_chunks == 1 and r.missed_periods == 12
    assert r.stall_adjusted_attainment == pytest.approx(1 / 13)


@pytest.mark.parametrize(("back_on", "migrations"), [("g1", 1), ("g2", 2)])
def test_a_released_gpus_parked_state_moves_where_the_core_parks_it(back_on, migrations):
    # As the live mesh runs (parked_on_gpu): a is suspended on g0, which is then given back;
    # its parked state moves first, to the ready GPU with the fewest parked sessions (a tie:
    # the smaller id, g1), a migration. Resumed there it is not moved again; elsewhere it is.
    trace = make_trace(
        "p",
        [(0.0, "a", "arrive"), (0.25, "a", "idle"), (0.5, "a", "active"), (0.9, "a", "depart")],
    )
    policy = ScriptedPolicy(
        {
            (EventKind.ARRIVE, "a"): [Assign("a", "g0")],
            (EventKind.IDLE, "a"): [Suspend("a", "g0"), Release("g0")],
            (EventKind.ACTIVE, "a"): [Resume("a", back_on)],
        }
    )
    policy.view = SimpleNamespace(gpus=dict.fromkeys(("g0", "g1", "g2"), GpuState.READY))
    r = simulate(trace, policy, PROFILE, tick_s=0, chunk_period_s=0, parked_on_gpu=True)
    assert r.migrations == migrations
