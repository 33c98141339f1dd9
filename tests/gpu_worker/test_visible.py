"""The untrained default model is visibly alive: colour, contrast, motion that continues across
chunks, and pictures that follow the prompt and the seed (``model/visible.py``).

To look at it: ``turboserve frames /tmp/alive.png`` saves a strip of frames as a PNG
(``services/gpu_worker/frames.py``).
"""

from __future__ import annotations

import pytest
import torch

from services.gpu_worker.engine import next_chunks
from services.gpu_worker.frames import save_strip

from .conftest import make_engine

FOX = "a red fox running through snow"
WHALE = "a blue whale in the deep ocean"
FRAMES = 12  # video frames per chunk


def clip(prompt: str, seed: int, chunks: int, preset: str = "tiny") -> torch.Tensor:
    """``[chunks * 12, H, W, 3]`` float frames of one session alone on a fresh engine."""
    engine = make_engine(preset=preset)
    engine.add_session("s", prompt, seed)
    return torch.cat([next_chunks(engine)[0].frames for _ in range(chunks)]).float()


def spatial_std(frames: torch.Tensor) -> torch.Tensor:
    """Per frame: the pixel standard deviation over the picture, averaged over R, G, B."""
    return frames.std(dim=(1, 2)).mean(dim=1)


def second_colour_share(frames: torch.Tensor) -> float:
    """The share of the colour variance off the main colour axis: 0 for a single hue (every
    pixel a shade of one colour, grey included), up to 2/3 for colours spread evenly."""
    pixels = frames.reshape(-1, 3).double()
    eigenvalues = torch.linalg.eigvalsh(torch.cov(pixels.T))
    return float(eigenvalues[:2].sum() / eigenvalues.sum())


def neighbour_correlation(frames: torch.Tensor) -> float:
    """Correlation of horizontally adjacent pixels (about 0 for white noise)."""
    x = frames - frames.mean(dim=(1, 2), keepdim=True)
    left, right = x[:, :, :-1], x[:, :, 1:]
    return float((left * right).sum() / (left.pow(2).sum() * right.pow(2).sum()).sqrt())


def frame_steps(frames: torch.Tensor, skip_chunks: int = 1) -> tuple[float, float]:
    """Mean absolute change between consecutive frames (levels of 255): (within a chunk,
    across a chunk boundary). The first ``skip_chunks`` chunks (the fade-in) are left out."""
    frames = frames[skip_chunks * FRAMES :]
    steps = (frames[1:] - frames[:-1]).abs().mean(dim=(1, 2, 3))
    boundary = torch.arange(1, len(frames)) % FRAMES == 0
    return float(steps[~boundary].mean()), float(steps[boundary].mean())


@pytest.fixture(scope="module")
def fox() -> torch.Tensor:
    return clip(FOX, 1, 8)


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_frames_have_colour_and_contrast(preset, fox):
    """Random weights gave flat grey (a spatial std of about 2-5 levels)."""
    frames = fox if preset == "tiny" else clip(FOX, 1, 4, preset="small")
    contrast = spatial_std(frames[FRAMES:])  # after the first chunk's fade-in from grey
    assert float(contrast.median()) > 25.0 and float(contrast.min()) > 15.0
    assert second_colour_share(frames[FRAMES:]) > 0.05  # not a single hue


def test_consecutive_frames_move_smoothly(fox):
    within, boundary = frame_steps(fox)
    assert within > 2.0  # visible motion inside a chunk...
    assert 1 / 3 < boundary / within < 3  # ...and no hard cut where chunks meet
    assert neighbour_correlation(fox) > 0.9  # a smooth picture, not noise
    # Over a chunk the picture changes clearly, not only by a shimmer.
    chunk_ends = (fox[2 * FRAMES - 1] - fox[FRAMES]).abs().mean()
    assert float(chunk_ends) > 8.0


def test_frames_follow_the_prompt_and_the_seed(fox):
    whale = clip(WHALE, 1, 8)  # same seed, other prompt
    colour = (fox.mean(dim=(0, 1, 2)) - whale.mean(dim=(0, 1, 2))).abs()
    assert float(colour.max()) > 30.0  # the mean colour differs
    other_seed = clip(FOX, 2, 8)
    assert float((fox - other_seed).abs().mean()) > 15.0
    assert torch.equal(fox, clip(FOX, 1, 8))  # the same (prompt, seed): bitwise the same


def test_a_prompt_change_moves_the_colour_towards_the_new_prompt():
    """The mean colour wanders from chunk to chunk, so this compares averages: over three
    seeds, its distance to the new prompt's own colour (that prompt from the start) shrinks."""
    before, after = [], []
    for seed in (1, 2, 3):
        engine = make_engine()
        engine.add_session("s", FOX, seed)
        colours = []
        for chunk in range(18):
            if chunk == 8:
                engine.set_prompt("s", WHALE)
            colours.append(next_chunks(engine)[0].frames.float().mean(dim=(0, 1, 2)))
        target = clip(WHALE, seed, 18)[6 * FRAMES :].mean(dim=(0, 1, 2))
        distance = [float((colour - target).abs().sum()) for colour in colours]
        before += distance[4:8]
        after += distance[12:18]
    assert sum(after) / len(after) < 0.6 * sum(before) / len(before)


def test_the_first_chunk_stops_mattering_once_newer_frames_are_cached():
    """LongLive keeps the first chunk as an attention sink; the hand-set history read gives it
    no weight once the ring holds newer frames, so the picture does not hang on its start."""
    config = make_engine().model_config
    chunks = 1 + (config.sink_frames + config.window_frames) // config.chunk_frames
    tokens = config.tokens_per_frame

    def next_chunk(forget: slice | None) -> torch.Tensor:
        engine = make_engine()
        engine.add_session("s", FOX, 4)
        for _ in range(chunks):
            next_chunks(engine)
        if forget is not None:
            for layer in range(config.num_layers):
                engine.pool.self_kv(layer, 0, 1)[..., forget, :] = 0.0
        return next_chunks(engine)[0].frames.float()

    reference = next_chunk(None)
    sink = slice(0, config.sink_frames * tokens)
    ring = slice(config.sink_frames * tokens, (config.sink_frames + config.window_frames) * tokens)
    assert float((next_chunk(sink) - reference).abs().max()) <= 1.0
    assert float((next_chunk(ring) - reference).abs().mean()) > 5.0


def test_save_strip_writes_a_png(tmp_path):
    rows = [clip(FOX, 1, 2), clip(WHALE, 1, 2)]
    path = save_strip(rows, tmp_path / "strip.png", every=4)
    from PIL import Image

    with Image.open(path) as image:
        height, width = rows[0].shape[1:3]
        assert image.size == (6 * width, 2 * height)
