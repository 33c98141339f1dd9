"""Noise is drawn on a CPU generator (and copied to the engine's device), so a seed gives the
same numbers on any GPU model: a session moved or recovered across GPU kinds continues
exactly."""

from __future__ import annotations

import torch

from services.gpu_worker.engine.engine import draw_noise, noise_seed

SHAPE = (4, 3, 6, 8)


def test_each_row_is_its_seeds_own_cpu_draw_whatever_the_batch():
    seeds = [noise_seed(7, seq, step) for seq, step in [(0, 0), (0, 1), (3, 2)]]
    batch = draw_noise(seeds, SHAPE)
    assert batch.shape == (3, *SHAPE) and batch.dtype == torch.float32
    assert batch.device.type == "cpu"
    for row, seed in zip(batch, seeds, strict=True):
        alone = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(row, alone)
        assert torch.equal(draw_noise([seed], SHAPE, torch.Generator().manual_seed(99))[0], row)
    assert not torch.equal(batch[0], batch[1])


def test_the_engine_draws_the_same_noise_on_every_device_it_is_given():
    from .conftest import make_engine

    engine = make_engine()
    engine.add_session("s", "a fox", 7)
    session = engine._sessions["s"]
    config = engine.model_config
    shape = (config.in_dim, config.chunk_frames, config.latent_height, config.latent_width)
    got = engine._noise([session], 2)
    assert got.device == engine.torch_device
    assert torch.equal(got.cpu(), draw_noise([noise_seed(7, 0, 2)], shape))
