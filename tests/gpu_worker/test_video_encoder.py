"""The frame encoders: the Wan VAE's encoder streamed chunk by chunk with its causal cache
carried, held to diffusers' own ``AutoencoderKLWan.encode`` of the whole clip; and the stand-in's
colour map run backwards, held to the stand-in decoder."""

from __future__ import annotations

import pytest
import torch

from services.gpu_worker.model import build_decoder, get_preset
from services.gpu_worker.model.decoder import ColourEncoder
from services.gpu_worker.model.vae import WanVaeEncoder
from services.gpu_worker.model.visible import visible_basis
from tests.models import build_vae


def _clip(batch: int, frames: int, height: int, width: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, frames, height, width, 3), generator=gen).to(torch.uint8)


def _whole(vae, clip: torch.Tensor) -> torch.Tensor:
    """diffusers' encode of the whole clip: the posterior's mode, normalised as the DiT's."""
    x = clip.permute(0, 4, 1, 2, 3).float().contiguous() / 127.5 - 1.0
    with torch.no_grad():
        mode = vae.encode(x).latent_dist.mode()
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    return (mode - mean) / std


def _stream(encoder: WanVaeEncoder, clip: torch.Tensor, chunks: int) -> list[torch.Tensor]:
    state = torch.zeros(clip.shape[0], encoder.state_numel)
    out, start = [], 0
    for i in range(chunks):
        count = encoder.input_frames(i == 0)
        out.append(encoder.encode(clip[:, start : start + count], state, fresh=i == 0))
        start += count
    return out


@pytest.mark.slow
def test_the_streamed_encode_equals_encoding_the_whole_clip_at_once():
    vae = build_vae(seed=5)
    encoder = WanVaeEncoder(vae, (64, 64), chunk_frames=3)
    assert (encoder.input_frames(True), encoder.input_frames(False)) == (9, 12)
    clip = _clip(2, 9 + 12 * 3, 64, 64, seed=1)
    chunks = _stream(encoder, clip, 4)
    assert [c.shape[2] for c in chunks] == [3, 3, 3, 3]  # 45 frames: 12 latent frames
    # Bitwise on the CPU: the same convolutions on the same cached activations, in order.
    assert torch.equal(torch.cat(chunks, dim=2), _whole(vae, clip))


@pytest.mark.slow
def test_the_encoder_cache_is_the_whole_state_a_stream_needs():
    """Encoding on from a copy of the state equals encoding on from the original: nothing
    else (no hidden cache on the VAE) carries the stream."""
    vae = build_vae(seed=6)
    encoder = WanVaeEncoder(vae, (32, 32), chunk_frames=3)
    clip = _clip(1, 9 + 12, 32, 32, seed=2)
    state = torch.zeros(1, encoder.state_numel)
    encoder.encode(clip[:, :9], state, fresh=True)
    assert state.abs().sum() > 0
    copy = state.clone()
    other = WanVaeEncoder(build_vae(seed=6), (32, 32), chunk_frames=3)
    a = encoder.encode(clip[:, 9:], state, fresh=False)
    b = other.encode(clip[:, 9:], copy, fresh=False)
    assert torch.equal(a, b) and torch.equal(state, copy)


def test_a_wrong_sized_input_chunk_is_refused():
    encoder = WanVaeEncoder(build_vae(light=True), (16, 16), chunk_frames=3)
    state = torch.zeros(1, encoder.state_numel)
    with pytest.raises(ValueError, match="takes 9"):
        encoder.encode(_clip(1, 10, 16, 16, seed=0), state, fresh=True)


@pytest.mark.slow
def test_at_480x832_the_light_vae_streams_and_its_cache_is_sized():
    """The model's own resolution, on the lightest Wan VAE: the layout probe (on the meta
    device) sizes the cache, and a first and a later chunk encode to 60x104 latents."""
    vae = build_vae(light=True)
    encoder = WanVaeEncoder(vae, (480, 832), chunk_frames=3)
    state = torch.zeros(1, encoder.state_numel)
    clip = _clip(1, 9 + 12, 480, 832, seed=3)
    first = encoder.encode(clip[:, :9], state, fresh=True)
    later = encoder.encode(clip[:, 9:], state, fresh=False)
    assert first.shape == later.shape == (1, vae.config.z_dim, 3, 60, 104)
    assert torch.isfinite(later).all()
    # Every cached activation keeps two time steps (one after a temporal downsampling).
    assert encoder.state_numel > 3 * 2 * 480 * 832


def test_the_stand_in_encoder_inverts_the_stand_in_decoder_on_a_still_picture():
    config = get_preset("tiny")
    decoder = build_decoder(config, seed=0)
    encoder = ColourEncoder(decoder, config)
    assert encoder.state_numel == 0 and encoder.input_frames(True) == 4 * config.chunk_frames
    # A still, flat latent picture, decoded then encoded again: the colour is given back
    # (away from the edge, where the stand-in decoder fades to grey).
    gen = torch.Generator().manual_seed(0)
    colour = torch.randn(1, config.out_dim, 1, 1, 1, generator=gen) * 0.3
    latents = colour.expand(1, -1, 3, config.latent_height, config.latent_width).contiguous()
    context = latents[:, :, :2].clone()  # as if the picture had always been there
    frames = decoder(latents, context)
    back = encoder.encode(frames, torch.zeros(1, 0), fresh=True)
    basis = visible_basis(config.out_dim)
    seen = torch.einsum("bcfhw,cr->brfhw", latents, basis)
    got = torch.einsum("bcfhw,cr->brfhw", back, basis)
    inner = (slice(None), slice(None), slice(None), slice(2, -2), slice(2, -2))  # off the edge
    error = (got[inner] - seen[inner]).abs().max()
    assert error < 0.02 * seen[inner].abs().max()  # 8-bit pixels, through tanh and back
