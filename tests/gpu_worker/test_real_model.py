"""The real model's parts held to the libraries' own implementations, on tiny random models.

1. The DiT: our causal model with a diffusers ``WanTransformer3DModel``'s weights (renamed to
   Wan's layout) gives diffusers' output on a first chunk; the chunk-by-chunk rollout with the
   KV cache equals one full diffusers forward under a block-causal mask.
2. The VAE: decoding chunk by chunk with the carried feature cache equals
   ``AutoencoderKLWan.decode`` of all the latents at once; a session migrated mid-stream (its
   decoder cache in the exported state) decodes the same frames as one that never moved.
(3, the text path, is in test_text.py.)
"""

from __future__ import annotations

import pytest
import torch

from services.gpu_worker.engine import Engine, EngineConfig, next_chunks
from services.gpu_worker.model.checkpoint import dit_geometry, from_diffusers, load_tensors
from services.gpu_worker.model.config import ModelConfig
from services.gpu_worker.model.dit import CausalWanModel, ChunkCaches
from services.gpu_worker.model.vae import WanVaeDecoder, to_uint8
from tests.models import HEAD_DIM, HEADS, TEXT_DIM, build_folder, build_transformer, build_vae

CONFIG = ModelConfig(
    name="t",
    dim=HEADS * HEAD_DIM,
    ffn_dim=64,
    num_heads=HEADS,
    num_layers=2,
    text_dim=TEXT_DIM,
    text_len=20,
    height=32,
    width=48,
    freq_dim=32,
)


@pytest.fixture(scope="module")
def dit_pair():
    reference = build_transformer(seed=1)
    ours = CausalWanModel(CONFIG).eval()
    load_tensors(ours, from_diffusers(dict(reference.state_dict())), "diffusers")
    return reference, ours


def _text() -> torch.Tensor:
    text = torch.randn(1, CONFIG.text_len, TEXT_DIM, generator=torch.Generator().manual_seed(5))
    text[:, 12:] = 0  # Wan pads the prompt's rows with zeros
    return text


def _empty_caches(model: CausalWanModel, text: torch.Tensor) -> ChunkCaches:
    c = CONFIG
    tokens = c.cache_frames * c.tokens_per_frame
    start = (c.sink_frames + c.window_frames) * c.tokens_per_frame
    return ChunkCaches(
        self_kv=[torch.zeros(1, 2, c.num_heads, tokens, c.head_dim) for _ in range(c.num_layers)],
        cross_kv=model.encode_context(text),
        key_mask=None,
        scratch=(start, start + c.chunk_tokens),
    )


def _mask(valid_frames: torch.Tensor) -> torch.Tensor:
    return valid_frames.repeat_interleave(CONFIG.tokens_per_frame)[None, None, None, :]


def test_geometry_is_read_off_the_weights(dit_pair):
    reference, _ = dit_pair
    geometry = dit_geometry(from_diffusers(dict(reference.state_dict())))
    assert geometry == {
        "dim": 32,
        "in_dim": 16,
        "patch": (1, 2, 2),
        "text_dim": TEXT_DIM,
        "freq_dim": 32,
        "ffn_dim": 64,
        "num_layers": 2,
        "out_dim": 16,
        "cross_attn_norm": True,
    }


@torch.no_grad()
def test_first_chunk_equals_diffusers_forward(dit_pair):
    reference, ours = dit_pair
    c = CONFIG
    latents = torch.randn(1, 16, c.chunk_frames, c.latent_height, c.latent_width)
    text = _text()
    for t in (999.0, 500.0, 0.0):
        timestep = torch.tensor([t])
        expected = reference(latents, timestep, text).sample
        caches = _empty_caches(ours, text)
        valid = torch.zeros(c.cache_frames, dtype=torch.bool)
        valid[c.sink_frames + c.window_frames :] = True  # only the chunk itself
        caches.key_mask = _mask(valid)
        got = ours(latents, timestep, torch.tensor([0]), caches)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


class _BlockCausal:
    """diffusers' own attention processor with a mask passed in (its self-attention gets
    none)."""

    def __init__(self, inner, mask: torch.Tensor) -> None:
        self.inner, self.mask = inner, mask

    def __call__(
        self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None
    ):
        return self.inner(attn, hidden_states, encoder_hidden_states, self.mask, rotary_emb)


@torch.no_grad()
def test_chunked_rollout_with_the_kv_cache_equals_a_block_causal_full_forward(dit_pair):
    reference, ours = dit_pair
    c = CONFIG
    chunks = (c.sink_frames + c.window_frames) // c.chunk_frames + 1  # everything stays cached
    frames = chunks * c.chunk_frames
    latents = torch.randn(
        1, 16, frames, c.latent_height, c.latent_width, generator=torch.Generator().manual_seed(2)
    )
    text = _text()
    # The reference: one diffusers forward over every frame, each chunk's tokens seeing only
    # their own and earlier chunks (all at t = 0, as the cache-writing pass runs them).
    chunk_of = torch.arange(frames).repeat_interleave(c.tokens_per_frame) // c.chunk_frames
    mask = chunk_of[None, :] <= chunk_of[:, None]
    processors = {
        name: _BlockCausal(proc, mask) if name.endswith("attn1.processor") else proc
        for name, proc in reference.attn_processors.items()
    }
    original = reference.attn_processors
    reference.set_attn_processor(processors)
    try:
        expected = reference(latents, torch.tensor([0.0]), text).sample
    finally:
        reference.set_attn_processor(original)
    # Ours: chunk by chunk, each chunk's keys committed into the cache after its pass.
    caches = _empty_caches(ours, text)
    valid = torch.zeros(c.cache_frames, dtype=torch.bool)
    valid[c.sink_frames + c.window_frames :] = True
    start, end = caches.scratch
    for k in range(chunks):
        position = k * c.chunk_frames
        caches.key_mask = _mask(valid)
        chunk = latents[:, :, position : position + c.chunk_frames]
        got = ours(chunk, torch.tensor([0.0]), torch.tensor([position]), caches)
        torch.testing.assert_close(
            got, expected[:, :, position : position + c.chunk_frames], rtol=1e-4, atol=1e-4
        )
        dst = position * c.tokens_per_frame  # no eviction: frame slot = position here
        for kv in caches.self_kv:
            kv[:, :, :, dst : dst + end - start] = kv[:, :, :, start:end]
        valid[position : position + c.chunk_frames] = True


@pytest.mark.slow
def test_vae_chunk_by_chunk_equals_decoding_everything_at_once():
    vae = build_vae(seed=4)
    decoder = WanVaeDecoder(vae, (8, 8), chunk_frames=3)
    latents = torch.randn(2, 16, 12, 8, 8, generator=torch.Generator().manual_seed(3))
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
    with torch.no_grad():
        expected = to_uint8(vae.decode(latents * std + mean).sample)  # diffusers' own decode
    state = torch.zeros(2, decoder.state_numel)
    chunks = [
        decoder.decode(latents[:, :, i : i + 3], state, fresh=i == 0) for i in range(0, 12, 3)
    ]
    assert [c.shape[1] for c in chunks] == [9, 12, 12, 12]  # 1 + 4 * 11 = 45 frames in all
    assert torch.equal(torch.cat(chunks, dim=1), expected)  # bitwise, on the CPU


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_folder(tmp_path_factory.mktemp("wan") / "diffusers", "diffusers")


def _engine(folder) -> Engine:
    return Engine(
        EngineConfig(model=str(folder), resolution=(64, 64), device="cpu", max_sessions=2, seed=0)
    )


@pytest.mark.slow
def test_a_session_migrated_mid_stream_decodes_the_frames_of_one_that_never_moved(folder):
    still = _engine(folder)
    still.add_session("s", "a red fox running through snow", seed=3)
    expected = [next_chunks(still)[0].frames for _ in range(5)]

    source, destination = _engine(folder), _engine(folder)
    source.add_session("s", "a red fox running through snow", seed=3)
    got = [next_chunks(source)[0].frames for _ in range(2)]
    state = source.export_state("s")
    # The decoder's feature cache travels with the session and is counted in its bytes.
    decoder_bytes = source.pool.decoder_numel * state.misc.element_size()
    assert decoder_bytes > 0 and state.nbytes >= decoder_bytes
    assert state.misc[source.pool.history_numel :].abs().sum() > 0
    source.remove_session("s")
    destination.import_state(state)
    got += [next_chunks(destination)[0].frames for _ in range(3)]
    assert [f.shape for f in got] == [(9, 64, 64, 3)] + [(12, 64, 64, 3)] * 4
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_suspend_and_resume_keep_the_decoder_cache(folder):
    still = _engine(folder)
    still.add_session("s", "a wolf at night", seed=5)
    expected = [next_chunks(still)[0].frames for _ in range(3)]
    engine = _engine(folder)
    engine.add_session("s", "a wolf at night", seed=5)
    got = [next_chunks(engine)[0].frames]
    engine.suspend("s")
    engine.add_session("other", "a storm at sea", seed=1)  # takes the freed slot meanwhile
    next_chunks(engine)
    engine.remove_session("other")
    engine.resume("s")
    got += [next_chunks(engine)[0].frames for _ in range(2)]
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_recovery_rebuilds_the_decoder_cache_from_the_logged_latents(folder):
    """The recovery log holds the latents, not the VAE's cache; restore rebuilds the cache by
    decoding the latents still in the window. Not bitwise (the rebuilt cache has not seen the
    frames before the window, nor has the recomputed KV cache), but the video continues."""
    still = _engine(folder)
    still.add_session("s", "a train crossing a bridge", seed=8)
    frames = [next_chunks(still)[0].frames for _ in range(5)]
    point = still.recovery_point("s")
    assert len(point.history) == still.pool.history_numel * 4  # float32 latents only
    expected = next_chunks(still)[0].frames

    rebuilt = _engine(folder)
    rebuilt.restore(point)
    assert rebuilt.pool.decoder_state(0, 1).abs().sum() > 0  # the cache was refilled
    (result,) = next_chunks(rebuilt)
    assert result.seq == point.seq and result.frames.shape == (12, 64, 64, 3)
    moved = (result.frames.float() - expected.float()).abs().mean()
    baseline = (frames[-1].float() - expected.float()).abs().mean()  # one chunk of motion
    # Closer to the chunk that would have come than the chunk before it is (20 against 26
    # levels here).
    assert moved < baseline, (moved, baseline)
