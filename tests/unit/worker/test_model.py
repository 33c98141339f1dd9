from __future__ import annotations

import pytest
import torch

from services.gpu_worker.model import CausalWanModel, build_model, get_preset
from services.gpu_worker.model.dit import apply_rope, rope_angles, rope_split
from services.gpu_worker.model.schedule import sigmas


def test_wan_1_3b_geometry():
    config = get_preset("wan-1.3b")
    assert (config.dim, config.num_layers, config.num_heads, config.ffn_dim) == (1536, 30, 12, 8960)
    assert config.tokens_per_frame == 1560  # 480x832 / (8x8 VAE) / (2x2 patch)
    assert config.chunk_frames == 3 and config.video_frames_per_chunk == 12
    with torch.device("meta"):
        model = CausalWanModel(config)
    params = sum(p.numel() for p in model.parameters())
    assert 1.3e9 < params < 1.5e9  # Wan2.1-T2V-1.3B has about 1.42e9


def test_unknown_preset_and_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("wan-14b-typo")
    with pytest.raises(ValueError, match="multiple"):
        get_preset("tiny", window_frames=4)


def test_rope_split_covers_the_head():
    for head_dim in (32, 64, 128):
        assert sum(rope_split(head_dim)) == head_dim // 2


def test_rope_is_a_rotation_and_relative():
    config = get_preset("tiny")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, config.chunk_tokens, 1, config.head_dim, generator=gen)
    k = torch.randn(1, config.chunk_tokens, 1, config.head_dim, generator=gen)

    def rotate(x, start):
        angles = rope_angles(config, torch.tensor([start]), config.chunk_frames, x.device)
        angles = angles[:, :, None, :]
        return apply_rope(x, torch.cos(angles).float(), torch.sin(angles).float())

    torch.testing.assert_close(rotate(q, 5).norm(dim=-1), q.norm(dim=-1))
    # Attention scores depend only on relative positions: shift both by the same offset.
    near = (rotate(q, 3) * rotate(k, 3)).sum(-1)
    far = (rotate(q, 3003) * rotate(k, 3003)).sum(-1)
    torch.testing.assert_close(near, far, rtol=1e-4, atol=1e-4)


def test_unpatchify_matches_wan_einsum():
    config = get_preset("tiny")
    model = build_model(config)
    frames, (gh, gw) = config.chunk_frames, config.grid
    out = torch.randn(2, frames * gh * gw, 16 * 4)
    got = model._unpatchify(out, frames, config.latent_height, config.latent_width)
    for b in range(2):
        u = out[b].view(frames, gh, gw, 1, 2, 2, 16)
        expected = torch.einsum("fhwpqrc->cfphqwr", u).reshape(
            16, frames, config.latent_height, config.latent_width
        )
        assert torch.equal(got[b], expected)


def test_weights_are_seeded():
    config = get_preset("tiny")
    a, b, c = build_model(config, seed=1), build_model(config, seed=1), build_model(config, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.blocks[0].self_attn.q.weight, c.blocks[0].self_attn.q.weight)


def test_sigmas_are_shifted_and_decreasing():
    config = get_preset("tiny")
    levels = sigmas(config)
    assert len(levels) == 4 and levels[0] == pytest.approx(1.0)
    assert all(x > y for x, y in zip(levels, levels[1:], strict=False))
    assert levels[-1] == pytest.approx(5 * 0.25 / (1 + 4 * 0.25))


def test_wan_state_per_session_matches_the_scheduler_estimate():
    """The slot of a wan-1.3b session (bf16) holds a 12-frame KV window of 1560-token frames
    in 30 layers plus the prompt's cross-attention cache: ~3.55 GB, the figure the scheduler's
    shipped profile assumes."""
    from services.gpu_worker.engine.slots import SlotPool

    config = get_preset("wan-1.3b")
    with torch.device("meta"):
        pool = SlotPool(config, 1, torch.device("meta"), torch.bfloat16)
    kv = 30 * 2 * 1536 * 2 * (12 * 1560)
    cross = 30 * 2 * 1536 * 2 * 512
    assert kv + cross <= pool.bytes_per_slot < kv + cross + 5_000_000
    assert pool.scratch[1] == 12 * 1560
