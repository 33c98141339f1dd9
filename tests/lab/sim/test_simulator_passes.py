"""Pass-level timing (``passes_per_chunk`` > 1), worked out by hand.

Each chunk takes ``passes_per_chunk`` batched passes; every session on a GPU shares each pass
but is at its own phase of its chunk, and a session that becomes active, resumes or arrives by
migration joins at the next *pass* boundary. One pass of ``n`` sessions lasts
``chunk_ms(n) / passes_per_chunk``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lab.sim.simulator import simulate
from lab.sim.traceio import make_trace
from services.scheduler.core.types import Assign, EventKind, Migrate
from shared.profile import load_profile, profile_from_dict

# Chunk 100 / 150 / 200 ms at batch 1 / 2 / 3, 5 passes per chunk: passes of 20 / 30 / 40 ms.
# Deadline 180 ms; migration 10 ms; $3.60 per GPU-hour.
RAW = {
    "name": "tiny5",
    "gpu_kind": "T",
    "model": "m",
    "chunk_ms": [100.0, 150.0, 200.0],
    "passes_per_chunk": 5,
    "deadline_ms": 180.0,
    "state_bytes_per_session": 1,
    "migration": {"per_session_ms": 10.0, "fixed_ms": 0.0},
    "price_usd_per_gpu_hour": 3.6,
}
PROFILE = profile_from_dict(RAW)


class ScriptedPolicy:
    name = "scripted"

    def __init__(self, script, gpus=("g0",)):
        self.script = script
        self.view = SimpleNamespace(gpus={g: None for g in gpus})
        self.steps: list[tuple[str, float]] = []

    def step(self, event):
        if event.kind is EventKind.GPU_READY:
            self.view.gpus[event.gpu_id] = None  # it holds every GPU that comes up
        return list(self.script.get((event.kind, event.session_id or event.gpu_id), []))

    def note_pass(self, gpu_id, ends_at):
        self.steps.append((gpu_id, ends_at))


def _sorted(values):
    return sorted(round(x, 6) for x in values)


def test_session_joining_mid_step_waits_for_the_pass_not_the_chunk():
    trace = make_trace(
        "join",
        [(0.0, "a", "arrive"), (0.25, "b", "arrive"), (0.45, "a", "depart"), (0.45, "b", "depart")],
    )
    policy = ScriptedPolicy(
        {(EventKind.ARRIVE, "a"): [Assign("a", "g0")], (EventKind.ARRIVE, "b"): [Assign("b", "g0")]}
    )
    r = simulate(trace, policy, PROFILE, tick_s=0, chunk_period_s=0)
    # g0 runs [a] in 20 ms passes; a's chunks end 0.10, 0.20 (100 ms each). b arrives at 0.25,
    # inside the pass 0.24-0.26, and joins at 0.26: passes are 30 ms from then.
    # a's third chunk (due 0.20) ends after passes 0.20-0.22-0.24-0.26, 0.26-0.29-0.32: 120 ms.
    # b's first chunk: the rest of the pass in flight (10 ms) + 5 passes of 30 ms = 160 ms
    # (a chunk-level step would have made it wait for a's chunk: 0.30 + 0.15 - 0.25 = 200 ms).
    # a's fourth chunk would end at 0.47 and b's second at 0.56, after both depart at 0.45.
    assert _sorted(r.latencies_ms) == [100.0, 100.0, 120.0, 160.0]
    assert _sorted(r.first_chunk_latencies_ms) == [100.0, 160.0]
    assert r.cost_gpu_seconds == pytest.approx(0.45)
    # The controller hears every pass: its end is the next boundary a joiner can use.
    ends = [t for g, t in policy.steps if g == "g0"]
    assert ends[:3] == pytest.approx([0.02, 0.04, 0.06])
    assert 0.26 in [round(t, 9) for t in ends] and 0.29 in [round(t, 9) for t in ends]


def test_migration_finishes_the_chunk_copies_then_joins_at_the_next_pass():
    trace = make_trace(
        "move",
        [
            (0.0, "a", "arrive"),
            (0.0, "c", "arrive"),
            (0.05, "b", "arrive"),
            (0.33, "a", "depart"),
            (0.33, "b", "depart"),
            (0.33, "c", "depart"),
        ],
    )
    policy = ScriptedPolicy(
        {
            (EventKind.ARRIVE, "a"): [Assign("a", "g0")],
            (EventKind.ARRIVE, "c"): [Assign("c", "g1")],
            (EventKind.ARRIVE, "b"): [Assign("b", "g1"), Migrate("a", "g0", "g1")],
        },
        gpus=("g0", "g1"),
    )
    r = simulate(trace, policy, PROFILE, tick_s=0, chunk_period_s=0)
    # g0: a's chunk in flight ends at 0.10 (100 ms); its 10 ms copy ends at 0.11.
    # g1: [c] 20 ms passes; b (0.05) joins at 0.06; [c, b] 30 ms passes end 0.09, 0.12:
    #     c's first chunk at 0.12 (120 ms). a joins at 0.12: [c, b, a] 40 ms passes.
    #     b's chunk (passes from 0.06) ends at 0.12 + 3 x 0.04 = 0.24: 190 ms.
    #     a's chunk: copy 10 ms + wait for the boundary 10 ms + 5 x 40 ms, ends 0.32: 220 ms.
    #     c's second chunk (from 0.12) ends 0.32 too: 200 ms. b's second (from 0.24) would end
    #     0.36, after the departures at 0.33.
    assert _sorted(r.latencies_ms) == [100.0, 120.0, 190.0, 200.0, 220.0]
    assert (r.chunks_after_migration, r.late_chunks_after_migration) == (1, 1)
    assert r.migrations == 1
    assert r.cost_gpu_seconds == pytest.approx(0.66)


def test_idle_session_leaves_the_batch_at_the_next_pass():
    trace = make_trace(
        "idle",
        [
            (0.0, "a", "arrive"),
            (0.0, "b", "arrive"),
            (0.05, "b", "idle"),
            (0.3, "a", "depart"),
            (0.3, "b", "depart"),
        ],
    )
    policy = ScriptedPolicy(
        {(EventKind.ARRIVE, "a"): [Assign("a", "g0")], (EventKind.ARRIVE, "b"): [Assign("b", "g0")]}
    )
    r = simulate(trace, policy, PROFILE, tick_s=0, chunk_period_s=0)
    # [a, b] 30 ms passes until b goes idle inside 0.03-0.06; from 0.06 [a] runs 20 ms passes.
    # a's first chunk: 0.06 + 3 x 0.02 = 0.12 (120 ms); then 100 ms chunks at 0.22; b's void
    # chunk is never delivered.
    assert _sorted(r.latencies_ms) == [100.0, 120.0]


def test_one_pass_per_chunk_is_the_chunk_level_model():
    one = profile_from_dict({**RAW, "name": "tiny1", "passes_per_chunk": 1})
    legacy = profile_from_dict({k: v for k, v in RAW.items() if k != "passes_per_chunk"})
    assert legacy.passes_per_chunk == one.passes_per_chunk == 1
    assert "passes_per_chunk" not in legacy.to_dict()  # old and measured files round-trip
    trace = make_trace(
        "join",
        [(0.0, "a", "arrive"), (0.25, "b", "arrive"), (0.6, "a", "depart"), (0.6, "b", "depart")],
    )
    script = {
        (EventKind.ARRIVE, "a"): [Assign("a", "g0")],
        (EventKind.ARRIVE, "b"): [Assign("b", "g0")],
    }
    r = simulate(trace, ScriptedPolicy(script), legacy, tick_s=0, chunk_period_s=0)
    # Chunk-level: b waits for a's step 0.2-0.3, then [a, b] 0.30-0.45: 200 ms.
    assert _sorted(r.latencies_ms) == [100.0, 100.0, 100.0, 150.0, 200.0]


def test_shipped_profile_runs_five_passes_per_chunk_and_a_trace_stays_fast():
    p = load_profile()
    assert p.passes_per_chunk == 5 and p.sources["passes_per_chunk"]
    assert p.pass_ms(8) == pytest.approx(p.chunk_ms(8) / 5)
    r = simulate("bursty", "turboserve", p)
    assert r.chunks > 50_000
    assert r.wall_s < 10.0  # typically under 1 s; generous for shared machines
