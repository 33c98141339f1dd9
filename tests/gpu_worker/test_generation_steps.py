"""The quality budget in the generation loop: a STEPS command sets the step count of the chunks
that start after it, and an emulated GPU paces a chunk at ``s`` steps to ``s + 1`` passes."""

from __future__ import annotations

from shared.wire import WorkerCmdKind, WorkerCommand

from .conftest import make_engine
from .test_generation import RecordingSink, _assign, _loop, _run

FLOOR_MS = 30.0  # the emulated pass: far above the tiny model's real one on the CPU


def _steps(value: int | None) -> WorkerCommand:
    return WorkerCommand(kind=WorkerCmdKind.STEPS, worker_id="w", steps=value)


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
            loop.inbox.put(_steps(2))
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


def test_steps_are_clamped_and_a_steps_command_without_a_count_changes_nothing():
    loop = _loop(make_engine(min_steps=3))
    sink = RecordingSink(loop)
    loop.inbox.put(_assign("s", 1))
    loop.inbox.put(_steps(None))  # refused by the intake in the service; ignored here too
    loop.inbox.put(_steps(1))  # below the floor: the floor

    _run(loop, lambda: len(sink.chunks("s")) >= 2)
    assert loop.status().steps == 3
    assert [c.steps for c in sink.chunks("s")][:2] == [3, 3]
