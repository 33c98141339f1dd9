"""Wan2.1-shaped model components with random weights, built with the libraries' own classes.

No weights can be downloaded where the GPU check runs, and none are needed to time a pass or
size memory: the DiT of a preset (the seeded stand-in has Wan's geometry), diffusers'
``AutoencoderKLWan`` with Wan2.1's config (the real VAE, ``base_dim`` 96) and transformers'
``UMT5EncoderModel`` with umT5-XXL's geometry (5.7 B parameters), all randomly initialised on
the device; a sentencepiece tokenizer trained on a few sentences. The ``tiny`` preset gets a
small VAE and a small umT5 of the preset's text width instead, for dry runs on a CPU.
"""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

CORPUS = [
    "a red fox running through snow",
    "a blue whale in the deep ocean",
    "a wolf at night",
    "a storm at sea with lightning",
    "the quick brown fox jumps over the lazy dog",
    "a city street in the rain at dusk",
    "sunlight through green leaves in a forest",
    "an old man reading a newspaper on a bench",
    "waves crashing on a rocky shore",
    "a cat sleeping by the window",
    "mountains under a starry sky",
    "a train crossing a bridge",
]
# umT5-XXL, the text encoder of every Wan2.1 model (google/umt5-xxl's encoder).
UMT5_XXL: dict[str, Any] = {
    "vocab_size": 256384,
    "d_model": 4096,
    "d_kv": 64,
    "d_ff": 10240,
    "num_layers": 24,
    "num_heads": 64,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "feed_forward_proj": "gated-gelu",
}


def build_tokenizer(out: Path) -> None:
    """A sentencepiece unigram tokenizer of 64 pieces, saved as transformers' T5Tokenizer."""
    import sentencepiece as spm
    from transformers import T5Tokenizer

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 8),
        model_writer=model,
        vocab_size=64,
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        model_type="unigram",
        character_coverage=1.0,
        minloglevel=2,
    )
    processor = spm.SentencePieceProcessor(model_proto=model.getvalue())
    vocab = [
        (processor.id_to_piece(i), processor.get_score(i))
        for i in range(processor.get_piece_size())
    ]
    T5Tokenizer(vocab=vocab, extra_ids=0).save_pretrained(str(out))


def umt5_geometry(text_dim: int) -> dict[str, Any]:
    """umT5-XXL's for a 4096-wide DiT input, else a small one of width ``text_dim``."""
    if text_dim == UMT5_XXL["d_model"]:
        return dict(UMT5_XXL)
    return {
        "vocab_size": 128,
        "d_model": text_dim,
        "d_kv": 8,
        "d_ff": 2 * text_dim,
        "num_layers": 2,
        "num_heads": 4,
        "relative_attention_num_buckets": 8,
        "feed_forward_proj": "gated-gelu",
    }


def random_vae(config: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """A ``WanVaeDecoder`` over a random ``AutoencoderKLWan``: Wan2.1's config for a preset of
    Wan's text width (``wan-1.3b``), else a small one (``base_dim`` 8). On the ``meta`` device
    it allocates nothing (for sizes)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan

    from services.gpu_worker.model.vae import WanVaeDecoder

    with torch.device(device):
        if config.text_dim == UMT5_XXL["d_model"]:
            vae = AutoencoderKLWan()
        else:
            vae = AutoencoderKLWan(base_dim=8, z_dim=config.out_dim)
    vae = vae.to(dtype).eval().requires_grad_(False)
    return WanVaeDecoder(vae, (config.latent_height, config.latent_width), config.chunk_frames)


def preset_config(preset: str, resolution: tuple[int, int] | None) -> Any:
    """The preset's ``ModelConfig``, at ``resolution`` when given."""
    from services.gpu_worker.model.config import get_preset

    config = get_preset(preset)
    if resolution is not None:
        config = replace(config, height=resolution[0], width=resolution[1])
    return config


def random_wan(
    preset: str,
    resolution: tuple[int, int] | None,
    device: torch.device,
    dtype: torch.dtype,
    workdir: Path,
    seed: int = 0,
) -> Any:
    """A ``LoadedModel`` for ``Engine(config, loaded=...)``: the preset's DiT, the Wan VAE
    (Wan2.1's config for a 16-channel 4096-text preset of Wan's size, else a small one) and
    umT5 (``umt5_geometry``), random weights in ``dtype`` on ``device``."""
    from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

    from services.gpu_worker.model.dit import build_model
    from services.gpu_worker.model.load import LoadedModel
    from services.gpu_worker.model.text import UMT5TextEncoder
    from services.gpu_worker.model.vae import WanVaeEncoder

    config = preset_config(preset, resolution)
    torch.manual_seed(seed)
    dit = build_model(config, device, dtype, seed=seed)
    real = config.text_dim == UMT5_XXL["d_model"]
    decoder = random_vae(config, device, dtype)
    encoder = WanVaeEncoder(decoder.vae, (config.height, config.width), config.chunk_frames)
    with torch.device(device):
        umt5: Any = UMT5EncoderModel(UMT5Config(**umt5_geometry(config.text_dim)))
    umt5 = umt5.to(dtype=dtype).eval()
    tokenizer_dir = workdir / "tokenizer"
    if not (tokenizer_dir / "tokenizer_config.json").exists():
        build_tokenizer(tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    text = UMT5TextEncoder(umt5, tokenizer, config.text_len)
    sources = {
        "DiT": f"seeded stand-in ({config.name})",
        "text encoder": f"random umT5 (d_model {config.text_dim})",
        "VAE": "random AutoencoderKLWan" + (" (Wan2.1's config)" if real else " (base_dim 8)"),
    }
    return LoadedModel(config, dit, decoder, text, encoder, ("none", "random"), False, sources)
