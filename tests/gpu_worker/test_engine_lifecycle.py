from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from services.gpu_worker.engine import (
    EngineFull,
    IncompatibleState,
    SessionAlreadyResident,
    UnknownSession,
    WrongSessionState,
    next_chunks,
)

from .conftest import make_engine, run_chunks, solo


def test_chunk_shape_seq_and_batch():
    engine = make_engine()
    engine.add_session("a", "a red fox", 1)
    engine.add_session("b", "a blue bird", 2)
    first = next_chunks(engine)
    second = next_chunks(engine)
    config = engine.model_config
    assert [r.session_id for r in first] == ["a", "b"]
    assert [r.seq for r in first] == [0, 0] and [r.seq for r in second] == [1, 1]
    for result in first:
        assert result.frames.dtype == torch.uint8
        assert result.frames.device.type == "cpu"
        assert tuple(result.frames.shape) == (
            config.video_frames_per_chunk,
            config.height,
            config.width,
            3,
        )
        assert result.batch == 2 and result.gen_ms > 0
    assert not torch.equal(first[0].frames, first[1].frames)


def test_same_seed_and_prompt_history_gives_same_frames():
    a = solo(("a red fox", 7), 4, prompts={2: "a red fox at night"})
    b = solo(("a red fox", 7), 4, prompts={2: "a red fox at night"})
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    other_seed = solo(("a red fox", 8), 1)
    assert not torch.equal(a[0], other_seed[0])


def test_capacity_and_errors():
    engine = make_engine(max_sessions=2)
    engine.add_session("a", "p", 0)
    engine.add_session("b", "p", 0)
    with pytest.raises(EngineFull) as full:
        engine.add_session("c", "p", 0)
    assert full.value.capacity == 2 and full.value.retryable
    with pytest.raises(SessionAlreadyResident):
        engine.add_session("a", "p", 0)
    with pytest.raises(UnknownSession):
        engine.set_prompt("zzz", "p")
    with pytest.raises(WrongSessionState):
        engine.resume("a")
    engine.suspend("a")
    with pytest.raises(WrongSessionState):
        engine.suspend("a")
    engine.add_session("c", "p", 0)  # the suspended session freed its slot
    with pytest.raises(EngineFull):
        engine.resume("a")
    assert engine.active_sessions() == ["b", "c"] and engine.suspended_sessions() == ["a"]
    engine.remove_session("a")
    assert not engine.has_session("a")
    assert engine.capacity == 2


def test_a_pass_with_no_sessions_returns_nothing():
    assert make_engine().pass_step() == []


def test_suspend_resume_is_bitwise_identical():
    reference = solo(("a slow river", 3), 5)
    engine = make_engine()
    engine.add_session("a", "a slow river", 3)
    got = run_chunks(engine, "a", 2)
    engine.suspend("a")
    # Another session uses (and dirties) slot 0 while "a" is parked in host memory.
    engine.add_session("other", "a fast car", 9)
    run_chunks(engine, "other", 2)
    engine.remove_session("other")
    engine.resume("a")
    got += run_chunks(engine, "a", 3)
    assert all(torch.equal(x, y) for x, y in zip(got, reference, strict=True))


def test_removing_a_session_keeps_the_others_going():
    engine = make_engine()
    for name in ("a", "b", "c"):
        engine.add_session(name, f"prompt {name}", 5)
    next_chunks(engine)
    engine.remove_session("a")  # "c" moves into slot 0
    assert engine.active_sessions() == ["c", "b"]
    results = {r.session_id: r for r in next_chunks(engine)}
    assert set(results) == {"b", "c"} and results["c"].seq == 1
    reference = solo(("prompt c", 5), 2)
    diff = (results["c"].frames.int() - reference[1].int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3


def test_export_import_continues_bitwise():
    reference = solo(("waves on a beach", 11), 4, prompts={3: "storm"})
    source = make_engine()
    source.add_session("s", "waves on a beach", 11)
    got = run_chunks(source, "s", 2)
    state = source.export_state("s")
    assert state.seq == 2 and state.position == 2 * source.model_config.chunk_frames
    assert state.nbytes == source.state_bytes
    source.remove_session("s")
    target = make_engine()
    target.import_state(state)
    got += run_chunks(target, "s", 1)
    target.set_prompt("s", "storm")
    got += run_chunks(target, "s", 1)
    assert all(torch.equal(x, y) for x, y in zip(got, reference, strict=True))


def test_export_of_a_suspended_session_and_pending_prompt_travel():
    source = make_engine()
    source.add_session("s", "a cat", 1)
    run_chunks(source, "s", 1)
    source.set_prompt("s", "a dog")
    source.suspend("s")
    state = source.export_state("s")
    assert state.pending_prompt == "a dog" and state.prompt == "a cat"
    target = make_engine()
    target.import_state(state)
    (result,) = next_chunks(target)
    reference = solo(("a cat", 1), 2, prompts={1: "a dog"})
    assert result.seq == 1 and torch.equal(result.frames, reference[1])


def test_prompt_set_while_suspended_survives_export_and_import():
    # set_prompt on a SUSPENDED session only updates the session; export must not return the
    # state captured at suspend time (pending_prompt None there).
    source = make_engine()
    source.add_session("s", "a cat", 1)
    run_chunks(source, "s", 1)
    source.suspend("s")
    source.set_prompt("s", "a dog")
    state = source.export_state("s")
    assert state.pending_prompt == "a dog" and state.prompt == "a cat" and state.seq == 1
    assert source.export_state("s").pending_prompt == "a dog"  # export again: still live
    target = make_engine()
    target.import_state(state)
    (result,) = next_chunks(target)
    reference = solo(("a cat", 1), 2, prompts={1: "a dog"})
    assert result.seq == 1 and torch.equal(result.frames, reference[1])
    # ... and on the source too, once resumed.
    source.resume("s")
    (again,) = next_chunks(source)
    assert torch.equal(again.frames, reference[1])


def test_import_rejects_a_state_made_with_other_weights(tmp_path):
    from safetensors.torch import save_file

    engine = make_engine(seed=0)
    engine.add_session("s", "p", 0)
    state = engine.export_state("s")
    with pytest.raises(IncompatibleState) as err:
        make_engine(seed=1).import_state(state)
    assert err.value.field_name == "weights_seed"
    assert "'0'" in str(err.value) and "'1'" in str(err.value)
    make_engine(seed=0).import_state(state)  # same weights: accepted

    weights = {k: v.detach().float().contiguous() for k, v in engine.model.state_dict().items()}
    first, second = tmp_path / "first.safetensors", tmp_path / "second.safetensors"
    save_file(weights, str(first))
    save_file({k: v + 1.0 for k, v in weights.items()}, str(second))
    with_first = make_engine(checkpoint=str(first))
    with pytest.raises(IncompatibleState) as err:  # random weights -> checkpoint
        with_first.import_state(state)
    assert err.value.field_name == "checkpoint"
    assert err.value.got == "none" and "first.safetensors" in str(err.value)
    with_first.add_session("c", "p", 0)
    from_first = with_first.export_state("c")
    with pytest.raises(IncompatibleState) as err:  # another checkpoint, same size
        make_engine(checkpoint=str(second)).import_state(from_first)
    assert "first.safetensors" in str(err.value) and "second.safetensors" in str(err.value)
    with pytest.raises(IncompatibleState):  # checkpoint -> random weights
        make_engine().import_state(from_first)
    renamed = tmp_path / "renamed.safetensors"  # the same content under another name
    renamed.write_bytes(first.read_bytes())
    make_engine(checkpoint=str(renamed)).import_state(from_first)


def test_import_rejects_incompatible_state():
    engine = make_engine()
    engine.add_session("s", "p", 0)
    state = engine.export_state("s")
    state.preset = "small"
    with pytest.raises(IncompatibleState) as err:
        make_engine().import_state(state)
    assert err.value.field_name == "preset"
    state.preset = "tiny"
    state.layers = state.layers[:-1]
    with pytest.raises(IncompatibleState):
        make_engine().import_state(state)


def test_prompt_change_takes_effect_at_the_next_chunk():
    engine = make_engine()
    engine.add_session("s", "a quiet forest", 4)
    first = run_chunks(engine, "s", 1)
    engine.set_prompt("s", "a burning forest")
    second = run_chunks(engine, "s", 1)
    unchanged = solo(("a quiet forest", 4), 2)
    assert torch.equal(first[0], unchanged[0])
    assert not torch.equal(second[0], unchanged[1])
    # The new prompt conditions the chunk, but the cached frames of the old one still shape it.
    fresh = solo(("a burning forest", 4), 2)
    assert not torch.equal(second[0], fresh[1])


def test_telemetry_reports_cpu_mode_and_measured_chunk_times():
    engine = make_engine()
    engine.add_session("a", "p", 0)
    next_chunks(engine)
    engine.add_session("b", "p", 1)
    next_chunks(engine)
    report = engine.telemetry()
    assert report["mode"] == "cpu" and report["device"] == "cpu"
    assert report["mem_total_bytes"] > report["mem_free_bytes"] > 0
    assert set(report["chunk_ms"]) == {1, 2}
    assert all(ms > 0 for ms in report["chunk_ms"].values())
    assert report["active"] == 2 and report["state_bytes"] == engine.state_bytes


def test_suspend_buffers_are_reused_but_never_under_an_exported_state():
    engine = make_engine()
    engine.add_session("a", "p", 0)
    run_chunks(engine, "a", 1)
    engine.suspend("a")
    first = engine._sessions["a"].host.misc
    engine.resume("a")
    engine.suspend("a")
    assert engine._sessions["a"].host.misc.data_ptr() == first.data_ptr()  # recycled
    exported = engine.export_state("a")
    saved = exported.misc.clone()
    engine.resume("a")
    run_chunks(engine, "a", 1)
    engine.suspend("a")  # must not write into the exported state's tensors
    assert engine._sessions["a"].host.misc.data_ptr() != exported.misc.data_ptr()
    assert torch.equal(exported.misc, saved)


def test_kv_recache_with_the_same_prompt_reproduces_the_cache():
    """Before any frame is evicted, recomputing the cache under the same prompt rebuilds the
    same keys and values, so the stream goes on as if nothing happened."""
    reference = solo(("a lighthouse", 6), 4)
    switched = solo(("a lighthouse", 6), 4, prompts={3: "a lighthouse"})
    assert torch.equal(reference[3], switched[3])


def test_kv_recache_changes_more_than_the_cross_attention():
    prompts = {2: "a lighthouse in a storm"}
    kv = solo(("a lighthouse", 6), 4, prompts=prompts)
    cross = solo(("a lighthouse", 6), 4, prompts=prompts, prompt_recache="cross")
    unchanged = solo(("a lighthouse", 6), 4)
    assert torch.equal(kv[1], cross[1]) and torch.equal(kv[1], unchanged[1])
    assert not torch.equal(kv[2], cross[2]) and not torch.equal(kv[2], unchanged[2])


def test_kv_recache_after_frames_were_evicted():
    engine = make_engine()
    config = engine.model_config
    engine.add_session("s", "a road", 2)
    chunks = (config.sink_frames + 2 * config.window_frames) // config.chunk_frames
    run_chunks(engine, "s", chunks)
    history = engine.pool.latent_history(0, 1).clone()
    engine.set_prompt("s", "a road at dusk")
    (result,) = next_chunks(engine)
    assert result.seq == chunks and engine._sessions["s"].prompt == "a road at dusk"
    # The re-cache reads the kept latents and does not change them.
    frame = engine._frame_slot(chunks * config.chunk_frames)
    keep = [f for f in range(history.shape[2]) if not frame <= f < frame + config.chunk_frames]
    assert torch.equal(engine.pool.latent_history(0, 1)[:, :, keep], history[:, :, keep])


def test_export_on_device_is_a_clone_the_slots_never_change():
    # A handoff over NCCL or CUDA IPC freezes the session as a clone on the engine's device
    # (here the CPU): the pass and the slot moves after the freeze must not reach it.
    def two_chunks_beside_another():
        engine = make_engine()
        engine.add_session("s", "a lighthouse", 3)
        engine.add_session("other", "a field", 4)
        run_chunks(engine, "s", 2)
        return engine

    host_copy = two_chunks_beside_another().export_state("s")
    reference = make_engine()
    reference.import_state(host_copy)
    source = two_chunks_beside_another()
    frozen = source.export_state("s", on_device=True)
    assert frozen.misc.device == source.torch_device
    before = [t.clone() for t in (*frozen.layers, frozen.misc)]
    slot = source.active_sessions().index("s")
    for region in source.pool.regions(slot):  # the slot's rows, overwritten in place
        assert region.data_ptr() not in {t.data_ptr() for t in (*frozen.layers, frozen.misc)}
        region.fill_(7.0)
    source.remove_session("other")  # moves rows
    after = [*frozen.layers, frozen.misc]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    target = make_engine()
    target.import_state(frozen)
    assert torch.equal(run_chunks(target, "s", 1)[0], run_chunks(reference, "s", 1)[0])


def test_export_on_device_of_a_suspended_session_is_its_host_copy():
    engine = make_engine()
    engine.add_session("s", "a cat", 1)
    run_chunks(engine, "s", 1)
    engine.suspend("s")
    state = engine.export_state("s", on_device=True)
    assert state.misc.device.type == "cpu" and state.seq == 1


def test_a_state_received_into_its_reserved_slot_is_adopted_in_place():
    source = make_engine()
    source.add_session("s", "a lighthouse", 3)
    run_chunks(source, "s", 2)
    state = source.export_state("s")
    reference = make_engine()
    reference.import_state(state)
    expected = run_chunks(reference, "s", 1)[0]

    target = make_engine(max_sessions=3)
    target.add_session("a", "a field", 1)
    rows = target.reservations.reserve("s")
    assert rows is not None and rows[0].data_ptr() == target.pool.layers[0][2].data_ptr()
    for row, part in zip(rows, [*state.layers, state.misc], strict=True):
        row.copy_(part)  # what the transport does
    target.add_session("b", "a city", 2)  # slot 1: below the reserved one
    with pytest.raises(EngineFull):
        target.add_session("c", "a sea", 4)  # the reserved slot is not for the taking
    received = replace(state, layers=rows[:-1], misc=rows[-1])
    target.import_state(received)  # already in place (slot 2): nothing to copy
    assert target.active_sessions() == ["a", "b", "s"]
    assert target.reservations.held("s") is None
    results = {r.session_id: r for r in next_chunks(target)}
    diff = (results["s"].frames.int() - expected.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3  # batched with two others


def test_a_reserved_slot_above_the_next_one_moves_into_place_and_a_release_frees_it():
    source = make_engine()
    source.add_session("s", "a lighthouse", 3)
    run_chunks(source, "s", 1)
    state = source.export_state("s")
    target = make_engine(max_sessions=4)
    rows = target.reservations.reserve("s")
    assert rows is not None and target.reservations.held("s") == 3
    for row, part in zip(rows, [*state.layers, state.misc], strict=True):
        row.copy_(part)
    target.import_state(replace(state, layers=rows[:-1], misc=rows[-1]))
    assert target.active_sessions() == ["s"]
    assert torch.equal(target.pool.misc[0], state.misc)  # moved to slot 0
    other = target.reservations.reserve("t")
    assert other is not None
    target.reservations.release("t")  # an aborted handoff
    for sid in ("a", "b", "c"):
        target.add_session(sid, "p", 0)
    assert len(target.active_sessions()) == 4
