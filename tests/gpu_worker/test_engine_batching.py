"""Coalesced batching: sessions at different positions and cache fills in one pass."""

from __future__ import annotations

import torch
from torch import nn

from services.gpu_worker.engine import next_chunks
from services.gpu_worker.model.load import FrameDecoder

from .conftest import make_engine


class RecordingDecoder(nn.Module):
    """Wraps the engine's decoder and keeps the clean latents of every chunk it decodes.

    A pass decodes a stream's first chunks (seq 0, ``fresh``) apart from the others;
    ``latents_for(results)`` gives the latents of a pass's results in their order."""

    def __init__(self, inner: FrameDecoder) -> None:
        super().__init__()
        self.inner = inner
        self.kind = inner.kind
        self.state_numel = inner.state_numel
        self.calls: list[tuple[torch.Tensor, bool]] = []

    def decode(self, latents: torch.Tensor, state: torch.Tensor, fresh: bool) -> torch.Tensor:
        self.calls.append((latents.clone(), fresh))
        return self.inner.decode(latents, state, fresh)

    def latents_for(self, results) -> list[torch.Tensor]:
        calls, self.calls = self.calls, []
        queues = {
            fresh: [row for c, f in calls if f is fresh for row in c] for fresh in (True, False)
        }
        return [queues[r.seq == 0].pop(0) for r in results]


def _recording_engine(**overrides):
    engine = make_engine(**overrides)
    engine.decoder = RecordingDecoder(engine.decoder)
    return engine


JOINS = {
    0: ("s0", "a red fox", 1),
    1: ("s1", "a city at night", 2),
    3: ("s2", "rain on glass", 3),
    4: ("s3", "a red fox", 4),
}


def _batched_run(steps: int):
    engine = _recording_engine()
    latents, frames = {}, {}
    for step in range(steps):
        if step in JOINS:
            engine.add_session(*JOINS[step])
        results = next_chunks(engine)
        batch_latents = engine.decoder.latents_for(results)
        for i, result in enumerate(results):
            latents[(result.session_id, result.seq)] = batch_latents[i]
            frames[(result.session_id, result.seq)] = result.frames
    return latents, frames


def test_batched_step_equals_per_session_steps():
    steps = 7  # s0 runs past a full window (sink 1 chunk + ring 2 chunks) and wraps the ring
    latents, frames = _batched_run(steps)
    for session_id, prompt, seed in JOINS.values():
        solo = _recording_engine()
        solo.add_session(session_id, prompt, seed)
        count = 1 + max(seq for sid, seq in latents if sid == session_id)
        for seq in range(count):
            (result,) = next_chunks(solo)
            assert result.seq == seq
            torch.testing.assert_close(
                latents[(session_id, seq)],
                solo.decoder.latents_for([result])[0],
                rtol=1e-4,
                atol=1e-4,
            )
            diff = (frames[(session_id, seq)].int() - result.frames.int()).abs()
            assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3


def test_the_cache_is_read():
    """A chunk depends on the session's history: same seed and seq noise, different past."""
    a = _recording_engine()
    a.add_session("x", "a red fox", 1)
    next_chunks(a)
    (last_a,) = a.decoder.latents_for(next_chunks(a))
    b = _recording_engine()
    b.add_session("x", "a red fox", 1)
    next_chunks(b)
    b.pool.layers[0][0, : b.pool.self_numel].zero_()  # forget layer 0's cached keys/values
    (last_b,) = b.decoder.latents_for(next_chunks(b))
    assert not torch.allclose(last_a, last_b, atol=1e-3)


def test_key_mask_tracks_sink_and_ring_fill():
    engine = make_engine()
    config = engine.model_config
    chunk, sink, window = config.chunk_frames, config.sink_frames, config.window_frames
    engine.add_session("s", "p", 0)
    session = engine._sessions["s"]
    tpf = config.tokens_per_frame
    for chunks_done in range(1 + (sink + window) // chunk + 1):
        mask = engine._key_mask([session])
        written = chunks_done * chunk
        expected_sink = min(written, sink)
        expected_ring = min(max(written - sink, 0), window)
        if mask is None:
            assert expected_sink == sink and expected_ring == window
        else:
            frames = mask[0, 0, 0].view(config.cache_frames, tpf)[:, 0]
            assert frames[:sink].sum() == expected_sink
            assert frames[sink : sink + window].sum() == expected_ring
            assert frames[sink + window :].all()  # the current chunk's scratch
        next_chunks(engine)


def test_ring_slots_wrap_after_the_window():
    engine = make_engine()
    config = engine.model_config
    chunk, sink, window = config.chunk_frames, config.sink_frames, config.window_frames
    slots = [engine._frame_slot(p) for p in range(0, sink + 2 * window, chunk)]
    expected = list(range(0, sink, chunk))
    ring = [sink + (i * chunk) % window for i in range(len(slots) - len(expected))]
    assert slots == expected + ring
