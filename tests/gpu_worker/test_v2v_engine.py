"""Video-to-video sessions in the engine: input chunks through the frame encoder, denoised at
the session's strength, in step with the output, with state that moves and recovers.

On the stand-in (fast) and on a tiny random Wan folder (the Wan VAE's encoder and decoder,
each with its causal cache carried per session)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.gpu_worker.engine import Engine, EngineConfig, next_chunks
from shared.wire import SessionInput
from tests.gpu_worker.conftest import make_engine
from tests.models import build_folder

VIDEO = SessionInput.VIDEO
PROMPT = "in the style of a woodcut"


def clip(seed: int, frames: int, height: int, width: int) -> list[np.ndarray]:
    """``frames`` camera-like frames: a moving colour gradient with a little seeded noise."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    out = []
    for t in range(frames):
        r = 128 + 100 * np.sin((xs + 6 * t) / 17.0)
        g = 128 + 100 * np.cos((ys - 4 * t) / 23.0)
        b = np.full_like(xs, 60.0 + 8 * t % 120)
        noise = rng.normal(0, 6, (height, width, 3))
        image = np.stack([r, g, b], axis=-1) + noise
        out.append(np.clip(image, 0, 255).astype(np.uint8))
    return out


class Camera:
    """Feeds a video session's input buffer from a clip, an input chunk at a time."""

    def __init__(self, engine: Engine, session_id: str, frames: list[np.ndarray]) -> None:
        self.engine, self.session_id, self.frames = engine, session_id, frames
        self.seq = 0

    def send_chunk(self) -> None:
        count = self.engine.input_frames(self.session_id)
        buffer = self.engine.input_buffer(self.session_id)
        assert buffer is not None
        for _ in range(count):
            assert buffer.put(self.seq, self.frames[self.seq], float(self.seq))
            self.seq += 1

    def move_to(self, engine: Engine) -> None:
        self.engine = engine


def one_chunk(engine: Engine, camera: Camera) -> torch.Tensor:
    camera.send_chunk()
    (result,) = [r for r in next_chunks(engine) if r.session_id == camera.session_id]
    assert result.input_seq == camera.seq - 1  # made from the input chunk just sent
    return result.frames


def clean_latents(engine: Engine, slot: int, position: int) -> torch.Tensor:
    """The clean latents of the chunk that started at ``position`` (the history keeps them)."""
    frames = engine.model_config.chunk_frames
    history = engine.pool.latent_history(slot, slot + 1)[0]
    return history[:, position : position + frames].clone()


def test_a_video_session_waits_for_its_input_chunk_and_makes_chunk_n_from_input_n():
    engine = make_engine()
    config = engine.model_config
    engine.add_session("v", PROMPT, 1, input=VIDEO, strength=0.5)
    engine.add_session("t", "a fox", 2)
    assert engine.video_sessions() == ["v"] and engine.input_buffer("t") is None
    assert not engine.input_ready("v") and engine.input_ready("t")
    # Without input the text session runs alone; the video session keeps its boundary.
    done = next_chunks(engine)
    assert [r.session_id for r in done] == ["t"] and engine.phases()["v"] == 0
    camera = Camera(engine, "v", clip(0, 64, config.height, config.width))
    assert engine.input_frames("v") == 4 * config.chunk_frames  # the stand-in: 4 per latent frame
    frames = one_chunk(engine, camera)
    assert frames.shape == (4 * config.chunk_frames, config.height, config.width, 3)
    assert engine.telemetry()["encode_ms"]


def test_at_strength_zero_the_output_latents_are_the_encoded_input():
    engine = make_engine()
    config = engine.model_config
    engine.add_session("v", PROMPT, 1, input=VIDEO, strength=0.0)
    frames = clip(1, 12, config.height, config.width)
    camera = Camera(engine, "v", frames)
    result = one_chunk(engine, camera)
    assert result.shape[0] == 12
    state = torch.zeros(1, engine.encoder.state_numel)
    expected = engine.encoder.encode(torch.as_tensor(np.stack(frames))[None], state, True)[0]
    assert torch.equal(clean_latents(engine, 0, 0), expected.to(engine.dtype))


def test_strength_picks_the_tail_of_the_schedule_and_the_budget_thins_it():
    engine = make_engine(min_steps=1)
    full = engine.full_steps
    engine.add_session("v", PROMPT, 1, input=VIDEO, strength=1.0)
    session = engine._sessions["v"]
    assert engine._chunk_levels(session) == engine._schedules[full]
    session.strength = 0.5
    assert len(engine._chunk_levels(session)) == full // 2
    assert engine._chunk_levels(session)[-1] == engine._schedules[full][-1]  # least noisy kept
    session.strength = None  # the default
    assert engine.strength_of("v") == 0.7 and len(engine._chunk_levels(session)) == int(full * 0.7)
    engine.set_step_budget(1)
    session.strength = 1.0
    assert len(engine._chunk_levels(session)) == 1


def test_the_same_input_gives_the_same_output_and_another_input_another():
    def run(negative: bool) -> list[torch.Tensor]:
        engine = make_engine()
        config = engine.model_config
        engine.add_session("v", PROMPT, 4, input=VIDEO, strength=0.5)
        frames = clip(0, 36, config.height, config.width)
        # another scene is the clip's negative: another noise seed alone could be averaged
        # away by the stand-in encoder's pooling
        if negative:
            frames = [255 - f for f in frames]
        camera = Camera(engine, "v", frames)
        return [one_chunk(engine, camera) for _ in range(3)]

    first, again, other = run(False), run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert all(not torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_a_strength_change_applies_from_the_next_chunk():
    engine = make_engine()
    config = engine.model_config
    engine.add_session("v", PROMPT, 4, input=VIDEO, strength=0.0)
    camera = Camera(engine, "v", clip(2, 36, config.height, config.width))
    one_chunk(engine, camera)
    engine.set_prompt("v", PROMPT, strength=1.0)  # the same prompt: the strength alone
    assert engine.strength_of("v") == 1.0 and engine.prompt_applied("v", PROMPT)
    camera.send_chunk()
    next_chunks(engine)
    assert engine._sessions["v"].steps == engine.full_steps


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_folder(tmp_path_factory.mktemp("wan") / "diffusers", "diffusers")


def _wan(folder) -> Engine:
    return Engine(
        EngineConfig(model=str(folder), resolution=(64, 64), device="cpu", max_sessions=2, seed=0)
    )


@pytest.mark.slow
def test_a_wan_session_migrated_mid_stream_encodes_and_decodes_as_one_that_never_moved(folder):
    frames = clip(3, 9 + 12 * 3, 64, 64)
    still = _wan(folder)
    still.add_session("s", PROMPT, 3, input=VIDEO, strength=0.5)
    camera = Camera(still, "s", frames)
    expected = [one_chunk(still, camera) for _ in range(4)]
    assert [f.shape[0] for f in expected] == [9, 12, 12, 12]

    source, destination = _wan(folder), _wan(folder)
    source.add_session("s", PROMPT, 3, input=VIDEO, strength=0.5)
    camera = Camera(source, "s", frames)
    got = [one_chunk(source, camera) for _ in range(2)]
    state = source.export_state("s")
    assert (state.input, state.strength) == (VIDEO, 0.5)
    # The encoder's feature cache travels with the session and is counted in its bytes.
    encoder_bytes = source.pool.encoder_numel * state.misc.element_size()
    assert encoder_bytes > 0 and state.nbytes >= encoder_bytes
    assert state.misc[-source.pool.encoder_numel :].abs().sum() > 0
    source.remove_session("s")
    assert source.input_buffer("s") is None
    destination.import_state(state)
    camera.move_to(destination)
    got += [one_chunk(destination, camera) for _ in range(2)]
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_a_recovered_wan_video_session_goes_on_from_a_zeroed_encoder_cache(folder):
    frames = clip(4, 9 + 12 * 3, 64, 64)
    engine = _wan(folder)
    engine.add_session("s", PROMPT, 5, input=VIDEO, strength=0.5)
    camera = Camera(engine, "s", frames)
    for _ in range(2):
        one_chunk(engine, camera)
    point = engine.recovery_point("s")
    rebuilt = _wan(folder)
    rebuilt.restore(point, input=VIDEO, strength=0.5)
    assert rebuilt.video_sessions() == ["s"]
    assert rebuilt.pool.encoder_state(0, 1).abs().sum() == 0  # not kept: starts from zeros
    camera.move_to(rebuilt)
    out = one_chunk(rebuilt, camera)
    assert out.shape == (12, 64, 64, 3)
    assert rebuilt.pool.encoder_state(0, 1).abs().sum() > 0
