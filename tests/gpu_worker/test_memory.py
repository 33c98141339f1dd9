"""The memory budget: what fits, bounded decodes, and a pass that runs out of memory.

A CPU has no out-of-memory error of its own; the decoder below raises torch's own
``OutOfMemoryError`` (what a CUDA allocation raises) from inside a real pass, where a decode's
peak would."""

from __future__ import annotations

import threading

import pytest
import torch

from services.gpu_worker.engine import MemoryBudgetExceeded, PassOutOfMemory, next_chunks
from services.gpu_worker.engine.memory import MARGIN, MemoryBudget, host_available_bytes, plan
from services.gpu_worker.generation import GenerationLoop
from services.gpu_worker.inbox import CommandInbox
from tests.eventually import eventually_sync

from .conftest import make_engine, run_chunks
from .test_generation import RecordingSink, _assign

GIB = 1 << 30


def _budget(available: int, slot: int, peak: int, max_decodes: int | None = None) -> MemoryBudget:
    return MemoryBudget("cuda:0", available, slot, peak, True, max_decodes)


def test_the_budget_counts_slots_decodes_a_handoff_clone_and_a_margin():
    # 80 GiB free, 5 GiB a slot, 10 GiB a decode: n*5 + n*10 + 5 + 8 <= 80 -> 4 sessions.
    assert plan(_budget(80 * GIB, 5 * GIB, 10 * GIB), None, 8).sessions == 4
    # Two decodes a pass at most: n*5 + 2*10 + 5 + 8 <= 80 -> 9, capped at the default 8.
    assert plan(_budget(80 * GIB, 5 * GIB, 10 * GIB, max_decodes=2), None, 8).sessions == 8
    assert plan(_budget(80 * GIB, 5 * GIB, 10 * GIB, max_decodes=2), None, 16).sessions == 9
    budget = _budget(80 * GIB, 5 * GIB, 10 * GIB)
    assert budget.needed(4) == 4 * 5 * GIB + 4 * 10 * GIB + 5 * GIB + int(MARGIN * 80 * GIB)


def test_a_count_that_does_not_fit_is_refused_naming_the_numbers():
    with pytest.raises(MemoryBudgetExceeded) as refused:
        plan(_budget(80 * GIB, 5 * GIB, 10 * GIB), 8, 8)
    text = str(refused.value)
    assert "8 session(s) need 133.00 GiB" in text and "80.00 GiB is available" in text
    assert "5.00 GiB a slot" in text and "8 decode(s) of 10.00 GiB" in text
    with pytest.raises(MemoryBudgetExceeded, match="1 session"):
        plan(_budget(10 * GIB, 5 * GIB, 10 * GIB), None, 8)  # not even one


def test_available_host_memory_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  1000 kB\nMemFree:  10 kB\nMemAvailable:  400 kB\n")
    assert host_available_bytes(meminfo) == 400 * 1024
    assert host_available_bytes() > 0  # this machine's


def test_the_engine_sizes_its_slots_from_free_memory_and_refuses_what_cannot_fit():
    engine = make_engine(max_sessions=None)
    assert 1 <= engine.capacity <= 8 and engine.pool.layers[0].shape[0] == engine.capacity
    assert engine.memory.slot_bytes > engine.state_bytes  # and the chunk in progress
    with pytest.raises(MemoryBudgetExceeded, match="is available on cpu"):
        make_engine(max_sessions=10**9)  # refused before a slot is allocated


def test_decodes_per_pass_are_bounded_and_the_rest_decode_next_pass():
    engine = make_engine(max_decodes_per_pass=1)
    for sid in ("a", "b", "c"):
        engine.add_session(sid, f"prompt {sid}", 1)
    engine.wait_for_prompts()
    completed: list[list[str]] = []
    for _ in range(3 * engine.passes_per_chunk):
        completed.append([r.session_id for r in engine.pass_step()])
    assert max(len(done) for done in completed) == 1
    assert {sid for done in completed for sid in done} == {"a", "b", "c"}
    # The whole-chunk helper waits for the put-off decodes.
    assert sorted(r.session_id for r in next_chunks(engine)) == ["a", "b", "c"]


class OutOfMemoryOnDecode:
    """The engine's decoder, raising torch's out-of-memory error while ``armed``."""

    def __init__(self, decoder) -> None:
        self.decoder = decoder
        self.armed = False

    def __getattr__(self, name):
        return getattr(self.decoder, name)

    def decode(self, latents, state, fresh):
        self._maybe_fail()
        return self.decoder.decode(latents, state, fresh)

    def rebuild(self, latents, state):
        self._maybe_fail()
        return self.decoder.rebuild(latents, state)

    def _maybe_fail(self) -> None:
        if self.armed:
            torch.empty(1)  # an allocation, as where a real one fails
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")


def test_a_pass_out_of_memory_lets_its_sessions_go_and_lowers_the_capacity():
    engine = make_engine(max_sessions=4)
    decoder = OutOfMemoryOnDecode(engine.decoder)
    engine.decoder = decoder
    for sid in ("a", "b", "c"):
        engine.add_session(sid, f"prompt {sid}", 1)
    run_chunks(engine, "a", 1)
    decoder.armed = True
    with pytest.raises(PassOutOfMemory) as failed:
        next_chunks(engine)  # all three take the pass that fails
    assert sorted(failed.value.sessions) == ["a", "b", "c"]
    assert failed.value.capacity == 2 and engine.capacity == 2
    assert engine.active_sessions() == [] and not engine.has_session("a")
    decoder.armed = False
    engine.add_session("d", "prompt d", 2)
    engine.add_session("e", "prompt e", 3)
    assert len(next_chunks(engine)) == 2  # the engine goes on, at its lower capacity


def test_sessions_out_of_a_failed_pass_keep_their_state():
    engine = make_engine(max_sessions=4)
    decoder = OutOfMemoryOnDecode(engine.decoder)
    engine.decoder = decoder
    engine.add_session("kept", "a field", 5)
    engine.add_session("lost", "a city", 6)
    run_chunks(engine, "kept", 1)
    before = engine.export_state("kept")
    decoder.armed = True
    passes = engine.passes_per_chunk
    with pytest.raises(PassOutOfMemory):
        for _ in range(passes):
            engine.pass_step(["lost"])
    assert engine.active_sessions() == ["kept"]
    after = engine.export_state("kept")
    assert all(
        torch.equal(x, y)
        for x, y in zip([*before.layers, before.misc], [*after.layers, after.misc], strict=True)
    )


def test_the_worker_hands_back_the_sessions_of_a_pass_out_of_memory_and_goes_on():
    engine = make_engine(max_sessions=4)
    decoder = OutOfMemoryOnDecode(engine.decoder)
    engine.decoder = decoder
    loop = GenerationLoop(engine, CommandInbox(), worker_id="w", period_s=0.0, lead_s=0.0)
    sink = RecordingSink(loop)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        loop.inbox.put(_assign("a", 3))
        loop.inbox.put(_assign("b", 4))
        eventually_sync(lambda: sink.chunks("a") and sink.chunks("b"), 30, "first chunks")
        decoder.armed = True
        eventually_sync(lambda: len(sink.handed_back) == 2, 30, "both handed back")
        assert sorted(sink.handed_back) == [("a", 3), ("b", 4)]
        assert {"a", "b"} <= set(sink.forgotten)
        eventually_sync(lambda: loop.status().capacity == 1, 30, "the lower capacity published")
        decoder.armed = False
        loop.inbox.put(_assign("c", 1))
        eventually_sync(lambda: sink.chunks("c"), 30, "a chunk after the failure")
    finally:
        loop.inbox.close()
        thread.join(10)
    assert not thread.is_alive()


def test_a_restore_out_of_memory_lets_that_session_go_and_keeps_the_others():
    source = make_engine()
    source.add_session("s", "a harbour", 4)
    run_chunks(source, "s", 2)
    point = source.recovery_point("s")
    engine = make_engine(max_sessions=4)
    decoder = OutOfMemoryOnDecode(engine.decoder)
    engine.decoder = decoder
    engine.add_session("kept", "a field", 5)
    decoder.armed = True
    with pytest.raises(PassOutOfMemory) as failed:
        engine.restore(point)
    assert failed.value.sessions == ["s"] and engine.capacity == 1
    assert engine.active_sessions() == ["kept"] and not engine.has_session("s")
    decoder.armed = False
    assert [r.session_id for r in next_chunks(engine)] == ["kept"]


def test_the_worker_hands_back_a_session_whose_restore_ran_out_of_memory():
    source = make_engine()
    source.add_session("s", "a fox", 1)
    run_chunks(source, "s", 1)
    engine = make_engine(max_sessions=4)
    decoder = OutOfMemoryOnDecode(engine.decoder)
    engine.decoder = decoder
    decoder.armed = True
    loop = GenerationLoop(engine, CommandInbox(), worker_id="w", period_s=0.0, lead_s=0.0)
    sink = RecordingSink(loop)
    loop.offer_recovery("s", 5, source.recovery_point("s"))
    loop.inbox.put(_assign("s", 5, seq=1))
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        eventually_sync(lambda: sink.handed_back == [("s", 5)], 30, "the session handed back")
        assert "s" not in loop.owned and not engine.has_session("s")
    finally:
        loop.inbox.close()
        thread.join(10)
    assert not thread.is_alive()


def test_a_freeze_with_no_room_for_a_clone_gives_the_host_copy(monkeypatch):
    engine = make_engine()
    engine.add_session("s", "a cat", 1)
    run_chunks(engine, "s", 1)
    expected = engine.export_state("s")

    def no_room(slot):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 5.06 GiB")

    monkeypatch.setattr(engine.pool, "clone", no_room)
    state = engine.export_state("s", on_device=True)
    assert all(
        torch.equal(x, y)
        for x, y in zip([*state.layers, state.misc], [*expected.layers, expected.misc], strict=True)
    )
