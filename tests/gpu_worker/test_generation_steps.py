"""The quality budget in the generation loop: a STEPS command sets the step count of the chunks
that start after it, and an emulated GPU paces a chunk at ``s`` steps to ``s + 1`` passes."""

from __future__ import annotations

import pytest

from services.gpu_worker.generation import OwnedSession
from services.gpu_worker.inbox import Control
from services.gpu_worker.pacing import PlaybackClock

from .conftest import make_engine
from .test_generation import RecordingSink, _assign, _loop, _run

# The emulated pass: far above the tiny model's real one on the CPU (about 15 ms), and above
# what a loaded CI machine stretches it to (40 ms seen), so every pass is paced to the floor.
FLOOR_MS = 80.0


def _steps(loop, value: int, answered: list[tuple[int, int]] | None = None) -> Control[int]:
    """A STEPS command as the service hands it to the loop: a control, answered with the
    count applied; ``answered`` gets (that count, the budget the loop's status showed then)."""

    def resolve(applied: int) -> None:
        if answered is not None:
            answered.append((applied, loop.status().steps))

    return Control("steps", lambda: loop.set_steps(value), resolve, lambda exc: None)


def test_a_chunk_at_fewer_steps_is_paced_to_fewer_passes():
    """Emulation paces every pass to the profile's pass time, so a chunk at ``s`` steps takes
    ``s + 1`` paced passes: (s + 1) / (full + 1) of a chunk at full steps."""
    loop = _loop(make_engine(min_steps=1), pass_floor_ms=lambda batch: FLOOR_MS)
    sink = RecordingSink(loop)
    loop.inbox.put(_assign("s", 1))

    def at(steps: int, count: int) -> bool:
        return sum(1 for c in sink.chunks("s") if c.steps == steps) >= count

    sent = []

    def budget_after_full() -> bool:
        if at(4, 3) and not sent:
            loop.inbox.put(_steps(loop, 2))
            sent.append(True)
        return at(2, 3)

    _run(loop, budget_after_full)
    chunks = sink.chunks("s")
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert loop.status().steps == 2
    for chunk in chunks[1:]:  # the first pays the warm-up
        passes = chunk.steps + 1
        # Each pass is stretched to the floor: the chunk's passes, within one pass of slack.
        assert passes * FLOOR_MS <= chunk.gen_ms < (passes + 1) * FLOOR_MS, chunk
    # Once reduced, it stays: no chunk at 4 steps after the first at 2.
    first_cut = next(i for i, c in enumerate(chunks) if c.steps == 2)
    assert {c.steps for c in chunks[first_cut:]} == {2}
    # The heartbeat's chunk times are full-step chunks only (the latency model's full count).
    full = [c.gen_ms + c.encode_ms for c in chunks if c.steps == 4]
    assert loop.status().chunk_ms[1] >= min(full) - 1e-6


def test_steps_are_clamped_and_answered_once_the_status_shows_them():
    """The answer comes after the status (which heartbeats report) shows the budget."""
    loop = _loop(make_engine(min_steps=3))
    sink = RecordingSink(loop)
    answered: list[tuple[int, int]] = []
    loop.inbox.put(_assign("s", 1))
    loop.inbox.put(_steps(loop, 1, answered))  # below the floor: the floor

    raised: list[bool] = []

    def raise_after_two() -> bool:
        if len(sink.chunks("s")) >= 2 and answered and not raised:
            loop.inbox.put(_steps(loop, 9, answered))  # above the full count: the full count
            raised.append(True)
        return any(c.steps == 4 for c in sink.chunks("s"))

    _run(loop, raise_after_two)
    assert answered == [(3, 3), (4, 4)]
    steps = [c.steps for c in sink.chunks("s")]
    assert steps[:2] == [3, 3] and steps[-1] == 4


def test_pacing_estimates_a_chunk_at_the_budget_in_force():
    """A session ahead of playback starts its chunk an estimated chunk time before it is due:
    at fewer steps, fewer passes."""
    loop = _loop(make_engine(min_steps=2))
    loop.owned["s"] = OwnedSession(epoch=1, seq_base=0, clock=PlaybackClock(0.0))
    loop.pass_times.add(1, 10.0)
    assert loop._estimate() == pytest.approx(0.050)  # 5 passes of 10 ms
    loop.set_steps(2)
    assert loop._estimate() == pytest.approx(0.030)  # 3 passes


def test_the_status_shows_the_budget_before_the_first_pass():
    """A heartbeat taken before the loop has run (the worker's first) reports the budget in
    force, not 0 steps, which the scheduler would read as another count and answer with a
    STEPS command."""
    engine = make_engine(min_steps=1)
    loop = _loop(engine)
    assert loop.status().steps == engine.full_steps == 4
