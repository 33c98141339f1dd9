"""Pass-level admission: ``Engine.pass_step`` runs one batched pass, each session at its own
phase of its own chunk."""

from __future__ import annotations

import pytest
import torch

from services.gpu_worker.engine import EngineError, MidChunk, WrongSessionState, next_chunks

from .conftest import make_engine, run_chunks, solo
from .test_engine_batching import RecordingDecoder


def _close_frames(got: torch.Tensor, want: torch.Tensor) -> None:
    """The tolerance of the batched == per-session test: a rare off-by-one pixel."""
    diff = (got.int() - want.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3


def test_each_session_completes_one_chunk_in_passes_per_chunk_passes():
    engine = make_engine()
    assert engine.passes_per_chunk == 5 == len(engine.model_config.denoising_steps) + 1
    engine.add_session("a", "a red fox", 1)
    engine.add_session("b", "rain on glass", 2)
    out = []
    for k in range(engine.passes_per_chunk):  # in phase: both complete at the last pass
        out = engine.pass_step()
        assert (out == []) == (k < engine.passes_per_chunk - 1)
    assert [(r.session_id, r.seq, r.batch) for r in out] == [("a", 0, 2), ("b", 0, 2)]
    engine.pass_step(["a"])  # out of phase now: "a" is one pass ahead
    assert sorted((r.session_id, r.seq) for r in next_chunks(engine)) == [("a", 1), ("b", 1)]


def test_staggered_sessions_equal_each_session_alone():
    """Sessions join at different passes (one imported), one is suspended at its boundary and
    resumed, prompts change mid-chunk, one is removed mid-chunk: every chunk equals the same
    session generated alone."""
    engine = make_engine(max_sessions=4)
    engine.decoder = RecordingDecoder(engine.decoder)
    seeds = {"s0": ("a red fox", 1), "s1": ("a city at night", 2), "s2": ("a slow river", 3)}
    latents, frames = {}, {}
    done = {sid: 0 for sid in seeds}  # chunks delivered so far
    prompt_at: dict[str, dict[int, str]] = {sid: {} for sid in seeds}
    phases_seen = set()

    def change_prompt(sid: str, prompt: str) -> None:
        # Applies at the session's next chunk boundary: the chunk in progress keeps the old one.
        applies = done[sid] + (1 if engine.passes_to_boundary(sid) else 0)
        prompt_at[sid][applies] = prompt
        engine.set_prompt(sid, prompt)

    # s2 was made elsewhere: two chunks on another engine, then migrated in mid-way.
    source = make_engine()
    source.add_session("s2", *seeds["s2"])
    for seq, chunk in enumerate(run_chunks(source, "s2", 2)):
        frames[("s2", seq)] = chunk
    done["s2"] = 2
    state = source.export_state("s2")

    suspend_pending = False
    completed: list[list[str]] = []
    for p in range(52):
        if p == 0:
            engine.add_session("s0", *seeds["s0"])
        elif p == 1:
            engine.add_session("gone", "removed mid-chunk", 9)
        elif p == 2:
            engine.add_session("s1", *seeds["s1"])
        elif p == 3:
            change_prompt("s0", "a red fox at night")  # s0 is mid-chunk
        elif p == 5:
            # Mid-chunk: s1 (mid-chunk too) moves from the last slot into the hole.
            assert engine.passes_to_boundary("gone") and engine.passes_to_boundary("s1")
            engine.remove_session("gone")
        elif p == 9:
            engine.import_state(state)
        elif p == 15:
            assert engine.passes_to_boundary("s1") > 0
            with pytest.raises(MidChunk):
                engine.suspend("s1")
            assert engine.suspend("s1", wait=True) is False
            suspend_pending = True
        elif p == 25:
            assert engine.suspended_sessions() == ["s1"]
            engine.resume("s1")  # in phase with s0 (slot 0), now in slot 2, s2 between
            assert engine.active_sessions() == ["s0", "s2", "s1"]
        elif p == 30:
            change_prompt("s2", "a slow river in spring")
            change_prompt("s1", "a city at dawn")
        phases_seen.add(tuple(sorted(engine._sessions[s].phase for s in engine.active_sessions())))
        results = engine.pass_step()
        completed.append([r.session_id for r in results])
        recorded = engine.decoder.latents_for(results)
        for j, result in enumerate(results):
            if result.session_id == "gone":
                continue
            assert result.seq == done[result.session_id]
            latents[(result.session_id, result.seq)] = recorded[j]
            frames[(result.session_id, result.seq)] = result.frames
            done[result.session_id] += 1
            if suspend_pending and result.session_id == "s1":
                assert engine.suspended_sessions() == ["s1"]  # right after its chunk
                suspend_pending = False

    # The run really mixed phases: some pass had three sessions at three different phases.
    assert any(len(set(phases)) >= 3 for phases in phases_seen)
    # ... and some pass completed the chunks of two sessions with another one between their
    # slots (the decoder's context is gathered and scattered back).
    assert ["s0", "s1"] in completed
    assert done["s0"] >= 9 and done["s1"] >= 5 and done["s2"] >= 8
    for sid, (prompt, seed) in seeds.items():
        reference = make_engine()
        reference.decoder = RecordingDecoder(reference.decoder)
        reference.add_session(sid, prompt, seed)
        for seq in range(done[sid]):
            if seq in prompt_at[sid]:
                reference.set_prompt(sid, prompt_at[sid][seq])
            (result,) = next_chunks(reference)
            (expected,) = reference.decoder.latents_for([result])
            if (sid, seq) in latents:
                torch.testing.assert_close(latents[(sid, seq)], expected, rtol=1e-4, atol=1e-4)
            _close_frames(frames[(sid, seq)], result.frames)


def test_first_chunk_of_a_joining_session_comes_after_exactly_passes_per_chunk():
    engine = make_engine()
    engine.add_session("early", "a red fox", 1)
    for _ in range(2):
        engine.pass_step()
    engine.add_session("late", "rain on glass", 2)
    assert engine.passes_to_boundary("late") == 0
    passes = 0
    while True:
        passes += 1
        results = {r.session_id: r for r in engine.pass_step()}
        if "late" in results:
            break
        assert passes < 10
    assert passes == engine.passes_per_chunk and results["late"].seq == 0
    # The early session's chunks kept coming on their own schedule meanwhile.
    assert engine.passes_to_boundary("early") == engine.passes_per_chunk - 2
    # A resumed session also starts at the next pass: again exactly passes_per_chunk.
    engine.suspend("late")
    engine.pass_step()
    engine.resume("late")
    for passes in range(1, engine.passes_per_chunk + 1):
        late = [r for r in engine.pass_step() if r.session_id == "late"]
        assert bool(late) == (passes == engine.passes_per_chunk)
    assert late[0].seq == 1


def test_mid_chunk_suspend_and_export_are_refused():
    engine = make_engine()
    engine.add_session("a", "a slow river", 3)
    engine.pass_step()
    assert engine.passes_to_boundary("a") == engine.passes_per_chunk - 1
    with pytest.raises(MidChunk) as refused:
        engine.suspend("a")
    assert refused.value.passes_left == engine.passes_per_chunk - 1
    assert refused.value.retryable and isinstance(refused.value, EngineError)
    with pytest.raises(MidChunk):
        engine.export_state("a")
    with pytest.raises(WrongSessionState):
        engine.resume("a")  # not suspended, no pending suspend
    # wait=True: suspended right after the pass that completes the chunk; resume cancels it.
    assert engine.suspend("a", wait=True) is False
    engine.resume("a")
    for _ in range(engine.passes_per_chunk - 1):
        engine.pass_step()
    assert engine.active_sessions() == ["a"] and engine.passes_to_boundary("a") == 0
    assert engine.suspend("a", wait=True) is True  # at the boundary: suspended now
    engine.resume("a")
    engine.pass_step()
    assert engine.suspend("a", wait=True) is False
    results = []
    while not results:
        results = engine.pass_step()
    assert results[0].seq == 1 and engine.suspended_sessions() == ["a"]
    state = engine.export_state("a")
    assert state.seq == 2
    # The session continues bitwise (batch 1 throughout: the same ops as alone).
    engine.resume("a")
    more = []
    while len(more) < 2:
        more += engine.pass_step()
    reference = solo(("a slow river", 3), 4)
    assert torch.equal(results[0].frames, reference[1])
    assert all(torch.equal(r.frames, ref) for r, ref in zip(more, reference[2:], strict=True))
    # A suspend deferred into pass_step leaves host buffers that later suspends (outside
    # inference mode) recycle and write again.
    assert engine.suspend("a", wait=True) is True
    engine.resume("a")  # recycles those buffers
    engine.suspend("a")
    engine.resume("a")


def test_pass_mode_timing_and_telemetry():
    engine = make_engine()
    engine.add_session("a", "p", 1)
    engine.add_session("b", "q", 2)
    results = []
    for _ in range(engine.passes_per_chunk):
        results += engine.pass_step()
    passes = list(engine._pass_ms[2])
    assert len(passes) == engine.passes_per_chunk
    for result in results:
        assert result.batch == 2
        assert result.gen_ms == pytest.approx(sum(passes))
    engine.add_session("c", "r", 3)
    for _ in range(3):
        engine.pass_step()
    report = engine.telemetry()
    assert report["passes_per_chunk"] == 5
    assert set(report["pass_ms"]) == {2, 3} and report["pass_ms"][3] > 0
    assert report["chunk_ms"][2] == pytest.approx(sum(passes))  # a whole chunk at batch 2


def test_a_session_sitting_out_passes_makes_the_frames_it_makes_alone():
    """``pass_step(subset)``: sessions join passes at their own moments (pacing); slots are
    swapped so that the pass reads slices; each session's frames are those it makes alone."""
    engine = make_engine()
    engine.add_session("a", "a red fox", 1)
    engine.add_session("b", "rain on glass", 2)
    engine.add_session("c", "a lighthouse", 3)
    got: dict[str, list[torch.Tensor]] = {"a": [], "b": [], "c": []}
    schedule = [["c"], ["c"], ["b", "c"], ["a", "b", "c"], ["b"], ["a", "b"], ["a", "c"]]
    passes = 0
    while min(len(v) for v in got.values()) < 3:
        chosen = schedule[passes % len(schedule)]
        # a session mid-chunk must keep taking passes: add those the schedule left out
        chosen = sorted({*chosen, *(s for s in got if engine.passes_to_boundary(s))})
        for r in engine.pass_step(chosen):
            got[r.session_id].append(r.frames)
        passes += 1
        assert passes < 200
    for sid, prompt, seed in (
        ("a", "a red fox", 1),
        ("b", "rain on glass", 2),
        ("c", "a lighthouse", 3),
    ):
        for mine, alone in zip(got[sid][:3], solo((prompt, seed), 3), strict=True):
            _close_frames(mine, alone)
    with pytest.raises(EngineError):
        engine.pass_step(["nobody"])
    assert engine.pass_step([]) == []
