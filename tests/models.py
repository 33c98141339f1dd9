"""Tiny Wan2.1 model folders, built by the tests with the libraries' own classes and configs.

No weights can be downloaded, so the tests make their own: a sentencepiece tokenizer trained on
a few sentences, a small ``UMT5EncoderModel``, a small ``AutoencoderKLWan`` and a small
``WanTransformer3DModel``, all randomly initialised and written with ``save_pretrained`` (the
diffusers layout) or as the original Wan2.1 files (``.pth`` in Wan's own key names, the DiT as
Wan-layout safetensors with Wan's ``config.json``).

    python -m tests.models /tmp/tiny-wan --layout diffusers
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tools.bench.random_wan import build_tokenizer as build_tokenizer  # the tests' too

if (
    TYPE_CHECKING
):  # from their own modules: to mypy, the names the packages re-export are placeholders
    from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan
    from diffusers.models.transformers.transformer_wan import WanTransformer3DModel
    from transformers.models.umt5.modeling_umt5 import UMT5EncoderModel

TEXT_DIM = 24  # umT5's d_model here (4096 in umT5-XXL)
HEADS, HEAD_DIM = 2, 16  # the DiT: dim 32
RESOLUTION = (64, 64)  # a latent of 8x8, 16 tokens per latent frame


def build_text_encoder(seed: int = 0) -> UMT5EncoderModel:
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    config = UMT5Config(
        vocab_size=128,
        d_model=TEXT_DIM,
        d_kv=8,
        d_ff=40,
        num_layers=2,
        num_heads=3,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
    )
    return UMT5EncoderModel(config).eval()


def build_vae(seed: int = 0, light: bool = False) -> AutoencoderKLWan:
    """``light``: the fewest channels and blocks the Wan VAE takes (no attention), so a chunk
    at 480x832 decodes in seconds on a CPU; its strides and latent are Wan's all the same."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan

    torch.manual_seed(seed)
    if light:
        vae: AutoencoderKLWan = AutoencoderKLWan(
            base_dim=2, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, attn_scales=[]
        )
    else:
        vae = AutoencoderKLWan(base_dim=8, z_dim=16)
    return vae.eval()


def build_transformer(seed: int = 0) -> WanTransformer3DModel:
    from diffusers.models.transformers.transformer_wan import WanTransformer3DModel

    torch.manual_seed(seed)
    model: WanTransformer3DModel = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM,
        in_channels=16,
        out_channels=16,
        text_dim=TEXT_DIM,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        cross_attn_norm=True,
    )
    model.eval()
    with torch.no_grad():  # diffusers zero-initialises nothing we rely on; make every weight count
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    return model


def build_folder(
    root: Path, layout: str = "diffusers", seed: int = 0, light_vae: bool = False
) -> Path:
    """A tiny Wan2.1 text-to-video folder in ``layout`` (``diffusers`` or ``original``);
    ``light_vae``: :func:`build_vae`'s light one (the diffusers layout)."""
    from safetensors.torch import save_file

    from services.gpu_worker.model.checkpoint import from_diffusers

    root.mkdir(parents=True, exist_ok=True)
    text, vae, dit = build_text_encoder(seed), build_vae(seed, light_vae), build_transformer(seed)
    if layout == "diffusers":
        build_tokenizer(root / "tokenizer")
        text.save_pretrained(str(root / "text_encoder"))
        vae.save_pretrained(str(root / "vae"))
        dit.save_pretrained(str(root / "transformer"))
        return root
    if layout != "original":
        raise ValueError(layout)
    build_tokenizer(root / "google" / "umt5-xxl")
    torch.save(umt5_to_original(text.state_dict()), root / "models_t5_umt5-xxl-enc-bf16.pth")
    torch.save(vae_to_original(vae.state_dict()), root / "Wan2.1_VAE.pth")
    tensors = {k: v.contiguous() for k, v in from_diffusers(dict(dit.state_dict())).items()}
    save_file(tensors, str(root / "diffusion_pytorch_model.safetensors"))
    (root / "config.json").write_text(
        json.dumps(
            {
                "_class_name": "WanModel",
                "model_type": "t2v",
                "dim": HEADS * HEAD_DIM,
                "num_heads": HEADS,
                "num_layers": 2,
                "ffn_dim": 64,
                "freq_dim": 32,
                "in_dim": 16,
                "out_dim": 16,
                "text_len": 512,
                "eps": 1e-6,
            }
        )
    )
    return root


def umt5_to_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' umT5 encoder keys in Wan2.1's T5 naming (the inverse of
    ``text.original_umt5_keys``)."""
    from services.gpu_worker.model.text import original_umt5_keys

    out: dict[str, torch.Tensor] = {}
    originals = ["token_embedding.weight", "norm.weight"]
    layers = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("encoder.block."))
    from services.gpu_worker.model.text import UMT5_BLOCK_KEYS

    originals += [f"blocks.{i}.{key}" for i in range(layers) for key in UMT5_BLOCK_KEYS]
    for key in originals:
        out[key] = state[original_umt5_keys(key)].clone()
    return out


_RESNET = {
    "norm1.gamma": "residual.0.gamma",
    "conv1.weight": "residual.2.weight",
    "conv1.bias": "residual.2.bias",
    "norm2.gamma": "residual.3.gamma",
    "conv2.weight": "residual.6.weight",
    "conv2.bias": "residual.6.bias",
    "conv_shortcut.weight": "shortcut.weight",
    "conv_shortcut.bias": "shortcut.bias",
}


def vae_to_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' ``AutoencoderKLWan`` keys in the original ``Wan2.1_VAE.pth`` naming: the
    inverse of diffusers' own ``convert_wan_vae_to_diffusers``, checked by a round trip."""
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    out = {_original_vae_key(k): v.clone() for k, v in state.items()}
    back = convert_wan_vae_to_diffusers(dict(out))
    assert set(back) == set(state), sorted(set(back) ^ set(state))[:5]
    return out


def _original_vae_key(key: str) -> str:
    top = {"quant_conv": "conv1", "post_quant_conv": "conv2"}
    head, _, rest = key.partition(".")
    if head in top:
        return f"{top[head]}.{rest}"
    side, _, rest = key.partition(".")  # encoder / decoder
    parts = rest.split(".")
    if parts[0] == "conv_in":
        return f"{side}.conv1.{parts[1]}"
    if parts[0] == "norm_out":
        return f"{side}.head.0.{parts[1]}"
    if parts[0] == "conv_out":
        return f"{side}.head.2.{parts[1]}"
    if parts[0] == "mid_block":
        kind, index, leaf = parts[1], int(parts[2]), ".".join(parts[3:])
        if kind == "attentions":
            return f"{side}.middle.1.{leaf}"
        return f"{side}.middle.{2 * index}.{_RESNET[leaf]}"
    if parts[0] == "down_blocks":
        leaf = ".".join(parts[2:])
        return f"{side}.downsamples.{parts[1]}.{_RESNET.get(leaf, leaf)}"
    if parts[0] == "up_blocks":
        block = int(parts[1])
        if parts[2] == "resnets":
            leaf = ".".join(parts[4:])
            return f"{side}.upsamples.{4 * block + int(parts[3])}.{_RESNET[leaf]}"
        if parts[2] == "upsamplers":
            return f"{side}.upsamples.{4 * block + 3}.{'.'.join(parts[4:])}"
    raise ValueError(f"no original name for VAE key {key}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layout", choices=("diffusers", "original"), default="diffusers")
    args = parser.parse_args()
    print(build_folder(args.out, args.layout))


if __name__ == "__main__":
    main()
