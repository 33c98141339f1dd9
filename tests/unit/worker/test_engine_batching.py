"""Coalesced batching: sessions at different positions and cache fills in one pass."""

from __future__ import annotations

import torch
from torch import nn

from .conftest import make_engine


class RecordingDecoder(nn.Module):
    """Wraps the engine's decoder and keeps the clean latents of every chunk."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.latents: list[torch.Tensor] = []

    def forward(self, latents: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        self.latents.append(latents.clone())
        return self.inner(latents, context)


def _recording_engine(**overrides):
    engine = make_engine(**overrides)
    engine.decoder = RecordingDecoder(engine.decoder)
    return engine


JOINS = {0: ("s0", "a red fox", 1), 1: ("s1", "a city at night", 2),
         3: ("s2", "rain on glass", 3), 4: ("s3", "a red fox", 4)}


def _batched_run(steps: int):
    engine = _recording_engine()
    latents, frames = {}, {}
    for step in range(steps):
        if step in JOINS:
            engine.add_session(*JOINS[step])
        results = engine.step()
        batch_latents = engine.decoder.latents[-1]
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
            (result,) = solo.step()
            assert result.seq == seq
            torch.testing.assert_close(
                latents[(session_id, seq)], solo.decoder.latents[-1][0], rtol=1e-4, atol=1e-4
            )
            diff = (frames[(session_id, seq)].int() - result.frames.int()).abs()
            assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3


def test_the_cache_is_read():
    """A chunk depends on the session's history: same seed and seq noise, different past."""
    a = _recording_engine()
    a.add_session("x", "a red fox", 1)
    a.step()
    a.step()
    b = _recording_engine()
    b.add_session("x", "a red fox", 1)
    b.step()
    b.pool.layers[0][0, : b.pool.self_numel].zero_()  # forget layer 0's cached keys/values
    b.step()
    assert not torch.allclose(a.decoder.latents[-1], b.decoder.latents[-1], atol=1e-3)


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
        engine.step()


def test_ring_slots_wrap_after_the_window():
    engine = make_engine()
    config = engine.model_config
    chunk, sink, window = config.chunk_frames, config.sink_frames, config.window_frames
    slots = [engine._frame_slot(p) for p in range(0, sink + 2 * window, chunk)]
    expected = list(range(0, sink, chunk))
    ring = [sink + (i * chunk) % window for i in range(len(slots) - len(expected))]
    assert slots == expected + ring
