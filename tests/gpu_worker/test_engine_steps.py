"""The quality budget in the engine: a chunk runs the step count in force when it starts, a
sub-schedule of the full one, and sessions at different counts share a pass."""

from __future__ import annotations

import pytest
import torch

from services.gpu_worker.engine import EngineConfig, MidChunk, StepFloorAboveFull, next_chunks
from services.gpu_worker.model.schedule import sub_schedule

from .conftest import make_engine
from .test_engine_batching import RecordingDecoder
from .test_engine_passes import _close_frames

FULL = (1000.0, 750.0, 500.0, 250.0)


def test_sub_schedule_keeps_the_first_and_last_levels_and_spreads_the_rest():
    assert sub_schedule(FULL, 4) == list(FULL)  # full steps: the schedule itself
    assert sub_schedule(FULL, 3) == [1000.0, 500.0, 250.0]
    assert sub_schedule(FULL, 2) == [1000.0, 250.0]
    assert sub_schedule(FULL, 1) == [1000.0]
    eight = [float(x) for x in range(8, 0, -1)]
    assert sub_schedule(eight, 4) == [8.0, 6.0, 3.0, 1.0]  # indices 0, 2.33, 4.67, 7
    for bad in (0, 5):
        with pytest.raises(ValueError, match="steps must be 1..4"):
            sub_schedule(FULL, bad)


def test_budget_is_clamped_to_the_floor_and_the_full_count():
    engine = make_engine(min_steps=2)
    assert (engine.full_steps, engine.min_steps, engine.steps) == (4, 2, 4)
    assert engine.set_step_budget(1) == 2 == engine.steps
    assert engine.set_step_budget(9) == 4 == engine.steps
    assert engine.set_step_budget(3) == 3 == engine.steps
    assert engine.telemetry()["steps"] == 3
    off = make_engine()  # no floor: the budget is off, pinned at the full count
    assert off.min_steps == off.full_steps == 4 and off.set_step_budget(2) == 4


def test_a_floor_out_of_range_is_refused():
    with pytest.raises(ValueError, match="min_steps must be >= 1"):
        EngineConfig(min_steps=0)
    with pytest.raises(StepFloorAboveFull, match="min_steps 5 is above .* 'tiny' \\(4\\)"):
        make_engine(min_steps=5)


def _chunks(engine, count: int) -> list[torch.Tensor]:
    return [next_chunks(engine)[0].frames for _ in range(count)]


def test_full_steps_are_bit_identical_to_a_budget_never_touched():
    """A floor configured and the budget moved and put back before a chunk starts change
    nothing: the same tensors as an engine that never heard of the budget."""
    plain = make_engine()
    plain.add_session("s", "a red fox", 7)
    expected = _chunks(plain, 3)
    budgeted = make_engine(min_steps=1)
    budgeted.add_session("s", "a red fox", 7)
    got = []
    for _ in range(3):
        budgeted.set_step_budget(2)
        budgeted.set_step_budget(4)
        (result,) = next_chunks(budgeted)
        assert result.steps == 4
        got.append(result.frames)
    for want, have in zip(expected, got, strict=True):
        assert torch.equal(want, have)


def test_fewer_steps_make_another_chunk_in_fewer_passes():
    chunks = {}
    for steps in (4, 3):
        engine = make_engine(min_steps=2)
        engine.set_step_budget(steps)
        engine.add_session("s", "a red fox", 7)
        passes = 0
        results: list = []
        while not results:
            results = engine.pass_step()
            passes += 1
        assert passes == steps + 1  # its denoising steps and the cache-write pass
        (result,) = results
        assert (result.seq, result.steps) == (0, steps)
        chunks[steps] = result.frames
    assert chunks[3].shape == chunks[4].shape
    assert not torch.equal(chunks[3], chunks[4])


def test_sessions_at_different_step_counts_share_passes():
    """One session's chunk started at 4 steps, another's at 3 (the budget changed between):
    they run in the same passes, each at its own timesteps, and each chunk equals the same
    session's chunk generated alone at its count."""
    engine = make_engine(min_steps=2)
    engine.decoder = RecordingDecoder(engine.decoder)
    engine.add_session("full", "a red fox", 1)
    engine.wait_for_prompts()
    assert engine.pass_step() == []  # "full" starts its chunk at 4 steps
    engine.set_step_budget(3)
    engine.add_session("cut", "rain on glass", 2)
    engine.wait_for_prompts()
    timesteps: list[list[float]] = []
    forward = engine.model.forward

    def record(latents, t, starts, caches):
        timesteps.append([float(v) for v in t])
        return forward(latents, t, starts, caches)

    engine.model.forward = record
    done = {}
    for _ in range(4):
        for result in engine.pass_step():
            done[result.session_id] = result
    # "full" ran 1 + 4 passes, "cut" 4: both done at the last; the rows' timesteps differed.
    assert sorted((r.session_id, r.seq, r.steps, r.batch) for r in done.values()) == [
        ("cut", 0, 3, 2),
        ("full", 0, 4, 2),
    ]
    assert any(len(set(row)) == 2 and min(row) > 0 for row in timesteps)
    assert engine.passes_to_boundary("full") == engine.passes_to_boundary("cut") == 0
    for sid, prompt, seed, steps in (("full", "a red fox", 1, 4), ("cut", "rain on glass", 2, 3)):
        alone = make_engine(min_steps=2)
        alone.set_step_budget(steps)
        alone.add_session(sid, prompt, seed)
        (result,) = next_chunks(alone)
        assert result.steps == steps
        _close_frames(done[sid].frames, result.frames)


def test_a_chunk_in_progress_keeps_its_step_count():
    engine = make_engine(min_steps=1)
    engine.add_session("s", "a red fox", 3)
    engine.wait_for_prompts()
    engine.pass_step()
    engine.set_step_budget(1)  # mid-chunk: from the next chunk on
    assert engine.passes_to_boundary("s") == 4
    with pytest.raises(MidChunk) as refused:
        engine.export_state("s")
    assert refused.value.passes_left == 4
    for _ in range(3):
        assert engine.pass_step() == []
    (result,) = engine.pass_step()
    assert result.steps == 4
    engine.pass_step()  # the next chunk: 1 step, then the cache-write pass
    assert engine.passes_to_boundary("s") == 1
    (result,) = engine.pass_step()
    assert (result.seq, result.steps) == (1, 1)


def test_seq_and_position_go_on_whatever_the_step_count():
    engine = make_engine(min_steps=1)
    engine.add_session("s", "a red fox", 3)
    seen = []
    for steps in (4, 3, 1, 2, 4):
        engine.set_step_budget(steps)
        (result,) = next_chunks(engine)
        seen.append((result.seq, result.steps, tuple(result.frames.shape)))
    shape = seen[0][2]
    assert seen == [(0, 4, shape), (1, 3, shape), (2, 1, shape), (3, 2, shape), (4, 4, shape)]
    assert engine.next_seq("s") == 5
    assert engine._sessions["s"].position == 5 * engine.model_config.chunk_frames


def test_a_state_leaves_at_a_boundary_and_takes_the_budget_where_it_lands():
    """Export (migration) and suspend happen only at chunk boundaries, so a state carries no
    step count: its next chunk runs the destination's budget, and continues it exactly."""
    source = make_engine(min_steps=2)
    source.set_step_budget(2)
    source.add_session("s", "a red fox", 5)
    (first,) = next_chunks(source)
    assert first.steps == 2
    state = source.export_state("s")
    target = make_engine(min_steps=2)
    target.set_step_budget(3)
    target.import_state(state)
    (moved,) = next_chunks(target)
    source.set_step_budget(3)
    (stayed,) = next_chunks(source)
    assert (moved.seq, moved.steps) == (stayed.seq, stayed.steps) == (1, 3)
    assert torch.equal(moved.frames, stayed.frames)
