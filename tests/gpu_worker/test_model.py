from __future__ import annotations

import pytest
import torch

from services.gpu_worker.engine import next_chunks
from services.gpu_worker.model import CausalWanModel, build_model, get_preset
from services.gpu_worker.model.dit import apply_rope, rope_angles
from services.gpu_worker.model.embedding import rope_split
from services.gpu_worker.model.schedule import sigmas

from .conftest import make_engine


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
        pool = SlotPool(
            config, 1, torch.device("meta"), torch.bfloat16, decoder_state_numel=16 * 2 * 60 * 104
        )  # the stand-in's context
    kv = 30 * 2 * 1536 * 2 * (12 * 1560)
    cross = 30 * 2 * 1536 * 2 * 512
    assert kv + cross <= pool.bytes_per_slot < kv + cross + 5_000_000
    assert pool.scratch[1] == 12 * 1560


def _clean_latents_per_pass(engine, chunks: int) -> list[tuple[float, torch.Tensor]]:
    """(timestep, the sampler's clean latent x_t - sigma * flow) of every denoising pass of
    the first session, over ``chunks`` chunks."""
    seen = []
    forward = engine.model.forward

    def record(latents, timesteps, start_frames, caches):
        flow = forward(latents, timesteps, start_frames, caches)
        t = float(timesteps[0])
        if t > 0:  # timesteps are sigma * 1000 (float32): the engine's sigma of the step
            sigma = min(engine._sigmas, key=lambda s: abs(s * 1000.0 - t))
            seen.append((t, (latents - sigma * flow.float())[0].clone()))
        return flow

    engine.model.forward = record
    for _ in range(chunks):
        next_chunks(engine)
    return seen


def test_visible_flow_lands_every_step_on_a_token_constant_target():
    """The hand-set head returns (x_t - x0) / sigma exactly at each of the sampler's
    timesteps: the clean latent it implies is one value per token (2x2 latent pixels) along
    the visible directions, whatever the noise; the first chunk carries the mark 1, later
    ones 0."""
    from services.gpu_worker.model.visible import VISIBLE_DIMS, latent_basis

    engine = make_engine()
    engine.add_session("s", "a lighthouse", 3)
    passes = _clean_latents_per_pass(engine, 2)
    assert len(passes) == 2 * len(engine._sigmas)
    basis = latent_basis(engine.model_config.out_dim)
    for index, (_, x0) in enumerate(passes):
        along = torch.einsum("cfhw,ci->ifhw", x0, basis)
        tokens = along.unflatten(2, (-1, 2)).unflatten(4, (-1, 2))  # [dirs, F, gh, 2, gw, 2]
        assert tokens[:VISIBLE_DIMS].std(dim=(3, 5)).max() < 1e-3
        if (index + 1) % len(engine._sigmas) == 0:  # the last step: the chunk's x0
            mark = tokens[VISIBLE_DIMS].mean(dim=(2, 4))  # [F, gh, gw]
            expected = 1.0 if index < len(engine._sigmas) else 0.0
            torch.testing.assert_close(mark, torch.full_like(mark, expected), atol=1e-2, rtol=0)


def test_decoder_maps_only_the_visible_subspace_to_colour():
    from services.gpu_worker.model import build_decoder
    from services.gpu_worker.model.visible import visible_basis

    config = get_preset("tiny")
    decoder = build_decoder(config, seed=3)
    shape = (1, config.out_dim, config.chunk_frames, config.latent_height, config.latent_width)

    def decode(latents):
        return decoder(latents, torch.zeros(*shape[:2], 2, *shape[3:])).float()

    grey = decode(torch.zeros(shape))
    assert grey.min() == grey.max()  # the base colour, everywhere
    gen = torch.Generator().manual_seed(0)
    basis = visible_basis(config.out_dim)
    noise = torch.randn(shape, generator=gen)
    hidden = noise - torch.einsum("ci,di,bdfhw->bcfhw", basis, basis, noise)
    # Directions the decoder does not show (grey is 127.5 before rounding: 127 or 128).
    assert (decode(hidden) - grey).abs().max() <= 1
    # Linear before the tanh: contributions add (up to the uint8 rounding).
    a = 0.3 * torch.einsum("ci,bifhw->bcfhw", basis, torch.randn(1, 3, *shape[2:], generator=gen))
    b = 0.3 * torch.einsum("ci,bifhw->bcfhw", basis, torch.randn(1, 3, *shape[2:], generator=gen))

    def pre_tanh(frames):
        return torch.atanh((frames / 127.5 - 1.0).clamp(-0.999, 0.999))

    total = pre_tanh(decode(a + b))
    parts = pre_tanh(decode(a)) + pre_tanh(decode(b))
    assert (total - parts).abs().max() < 0.05 and total.abs().mean() > 0.1


def test_streaming_decode_equals_whole_decode():
    """The decoder is causal in time: decoding chunk by chunk with the 2-frame context the
    session keeps gives the frames of decoding the whole stream at once."""
    from services.gpu_worker.model import build_decoder

    config = get_preset("tiny")
    decoder = build_decoder(config, seed=0)
    gen = torch.Generator().manual_seed(1)
    chunks = [
        torch.randn(
            1,
            config.out_dim,
            config.chunk_frames,
            config.latent_height,
            config.latent_width,
            generator=gen,
        )
        for _ in range(3)
    ]
    context = torch.zeros(1, config.out_dim, 2, config.latent_height, config.latent_width)
    streamed = torch.cat([decoder(chunk, context) for chunk in chunks], dim=1)
    whole = decoder(torch.cat(chunks, dim=2), torch.zeros_like(context))
    assert streamed.shape == whole.shape
    assert (streamed.int() - whole.int()).abs().max() <= 1


def test_a_config_too_small_for_the_visible_weights_keeps_random_ones():
    from services.gpu_worker.model.visible import unfit_reason

    config = get_preset("tiny", num_layers=1)
    assert "2 blocks" in unfit_reason(config)
    model = build_model(config, seed=0)  # builds, with Wan's random initialisation
    assert model.blocks[0].self_attn.o.weight.abs().sum() > 0
    assert unfit_reason(get_preset("tiny")) is None and unfit_reason(get_preset("wan-1.3b")) is None


def test_visible_weights_keep_their_picture_in_bfloat16():
    """GPUs run bf16: the hand-set model never adds a large offset to a small signal, so its
    clean latents and frames are the float32 ones up to rounding (an earlier version leaked
    4-8% of the noise in bf16)."""
    from services.gpu_worker.model.visible import VISIBLE_DIMS, latent_basis

    frames, spread = {}, {}
    for dtype in ("float32", "bfloat16"):
        engine = make_engine(dtype=dtype)
        engine.add_session("s", "a lighthouse", 3)
        x0 = _clean_latents_per_pass(engine, 3)[-1][1].float()
        frames[dtype] = next_chunks(engine)[0].frames.float()
        along = torch.einsum("cfhw,ci->ifhw", x0, latent_basis(engine.model_config.out_dim))
        tokens = along.unflatten(2, (-1, 2)).unflatten(4, (-1, 2))
        spread[dtype] = float(tokens[:VISIBLE_DIMS].std(dim=(3, 5)).max())
    assert spread["bfloat16"] < 0.02
    assert (frames["float32"] - frames["bfloat16"]).abs().mean() < 3.0
