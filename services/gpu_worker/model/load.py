"""What an engine runs: the DiT, the frame decoder and the text encoder, from a preset (the
stand-in) or from what the user points at (a model folder, a DiT checkpoint).

| path | DiT | text encoder | decoder | frame encoder (video input) |
| --- | --- | --- | --- | --- |
| no model (default) | preset geometry, seeded hand-set weights (``visible.py``) | hashing stand-in | fixed colour map (``decoder.py``) | the colour map backwards |
| ``checkpoint`` only | the checkpoint, geometry from its weights | hashing stand-in | fixed colour map | the colour map backwards |
| ``model`` folder (+ ``checkpoint``) | the checkpoint, else the folder's DiT | umT5 (``transformers``) | Wan VAE (``diffusers``), causal, cached per session | Wan VAE encoder, causal, cached per session |

The geometry of a loaded DiT comes from its weights (``checkpoint.dit_geometry``); the heads
from a DiT config beside it, else Wan's head width of 128; the resolution from
``resolution`` (default Wan2.1's 480x832); the text length is Wan's 512 tokens.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Protocol

import torch

from .checkpoint import (
    dit_geometry,
    has_lora,
    load_tensors,
    read_checkpoint,
)
from .config import PRESETS, ModelConfig, get_preset
from .decoder import ColourEncoder, build_decoder
from .dit import CausalWanModel, build_model
from .folder import ModelFolder, ModelFolderError, dit_files, dit_heads, find_components
from .text import HashingTextEncoder, TextEncoder, UMT5TextEncoder

WAN_HEAD_DIM = 128
WAN_TEXT_LEN = 512
WAN_RESOLUTION = (480, 832)


class FrameDecoder(Protocol):
    """Latents to uint8 frames, carrying a per-session causal state (a flat row per session)."""

    kind: str

    @property
    def state_numel(self) -> int: ...

    def decode(self, latents: torch.Tensor, state: torch.Tensor, fresh: bool) -> torch.Tensor: ...

    def rebuild(self, latents: torch.Tensor, state: torch.Tensor) -> None: ...


class FrameEncoder(Protocol):
    """A video session's input frames to latents, carrying a per-session causal state (a flat
    row per session; none for a stateless encoder)."""

    kind: str

    @property
    def state_numel(self) -> int: ...

    def input_frames(self, fresh: bool) -> int:
        """Video frames an input chunk has: a stream's first (``fresh``) or a later one."""
        ...

    def encode(self, frames: torch.Tensor, state: torch.Tensor, fresh: bool) -> torch.Tensor:
        """Normalised latents ``[B, C, F, h, w]`` float32 from uint8 ``[B, T, H, W, 3]``."""
        ...


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What to load: the engine's settings that choose the model."""

    preset: str = "tiny"
    checkpoint: str | None = None
    model: str | None = None  # a Wan2.1 model folder (either layout)
    resolution: tuple[int, int] | None = None  # (height, width); None: preset's / 480x832
    text_device: str | None = None  # where umT5 runs; None: the engine's device
    seed: int = 0


@dataclass(slots=True)
class LoadedModel:
    config: ModelConfig
    dit: CausalWanModel
    decoder: FrameDecoder
    text_encoder: TextEncoder
    encoder: FrameEncoder  # video sessions' input frames to latents
    # (digest, description) of the weights a session's caches depend on ("none" for seeded
    # weights): states only move between engines with the same identity.
    identity: tuple[str, str]
    longlive: bool  # a LongLive checkpoint (LoRA merged): the KV re-cache is on by default
    sources: dict[str, str]  # component -> where it came from, for logs and telemetry


def load_model(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    if spec.model is None:
        return _load_standin(spec, device, dtype)
    return _load_folder(spec, device, dtype)


def _load_standin(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    preset = get_preset(spec.preset)
    if spec.resolution is not None:
        preset = replace(preset, height=spec.resolution[0], width=spec.resolution[1])
    tensors = None
    if spec.checkpoint:
        tensors = read_checkpoint(spec.checkpoint)
        geometry = dit_geometry(tensors)
        heads = preset.num_heads if geometry["dim"] == preset.dim else None
        preset = config_for(geometry, heads, preset, preset.text_len, (preset.height, preset.width))
    dit = build_model(preset, device, dtype, seed=spec.seed)
    identity = ("none", "none")
    sources = {
        "DiT": f"seeded stand-in ({preset.name})",
        "text encoder": "hashing stand-in",
        "VAE": "colour-map stand-in (decoder and encoder)",
    }
    if tensors is not None and spec.checkpoint:
        load_tensors(dit, tensors, spec.checkpoint)
        identity = _identity([Path(spec.checkpoint)])
        sources["DiT"] = spec.checkpoint
    decoder = build_decoder(preset, device, dtype, seed=spec.seed)
    encoder = ColourEncoder(decoder, preset)
    text = HashingTextEncoder(preset.text_dim, preset.text_len)
    longlive = _is_longlive(spec.checkpoint)
    return LoadedModel(preset, dit, decoder, text, encoder, identity, longlive, sources)


def _load_folder(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    from .vae import WanVaeDecoder, WanVaeEncoder, load_diffusers_vae, load_original_vae

    assert spec.model is not None
    folder = find_components(spec.model, spec.checkpoint)
    _require(folder)
    dit_part = folder.get("DiT")
    assert dit_part.path is not None
    files = dit_files(dit_part.path)
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        tensors.update(read_checkpoint(path))
    geometry = dit_geometry(tensors)
    text_device = torch.device(spec.text_device) if spec.text_device else device
    text_dtype = torch.bfloat16 if text_device.type == "cuda" else torch.float32
    text = _load_text(folder, text_device, text_dtype)
    if text.dim != geometry["text_dim"]:
        raise ModelFolderError(
            f"text encoder width {text.dim} does not fit the DiT (text_embedding.0.weight takes "
            f"{geometry['text_dim']}): the DiT and the text encoder are from different models"
        )
    resolution = spec.resolution or WAN_RESOLUTION
    config = config_for(geometry, dit_heads(folder), None, WAN_TEXT_LEN, resolution)
    dit = _empty_dit(config, device, dtype)
    load_tensors(dit, tensors, str(dit_part.path))
    vae_part = folder.get("VAE")
    assert vae_part.path is not None
    if folder.layout == "diffusers":
        vae = load_diffusers_vae(str(vae_part.path), device, dtype)
    else:
        vae = load_original_vae(str(vae_part.path), device, dtype)
    if int(vae.config["z_dim"]) != config.out_dim:
        raise ModelFolderError(
            f"VAE latent channels {vae.config['z_dim']} do not fit the DiT's "
            f"{config.out_dim} (head.head.weight)"
        )
    decoder = WanVaeDecoder(vae, (config.latent_height, config.latent_width), config.chunk_frames)
    encoder = WanVaeEncoder(vae, (config.height, config.width), config.chunk_frames)
    vae_files = [vae_part.path] if vae_part.path.is_file() else sorted(vae_part.path.glob("*"))
    identity = _identity([*files, *vae_files])
    sources = {name: f"{part.path} ({part.fmt})" for name, part in folder.components.items()}
    longlive = _is_longlive(spec.checkpoint)
    return LoadedModel(config, dit, decoder, text, encoder, identity, longlive, sources)


def _require(folder: ModelFolder) -> None:
    missing = [name for name, part in folder.components.items() if part.path is None]
    if missing:
        hint = {"DiT": "set TURBOSERVE_CHECKPOINT or add the DiT to the folder"}
        raise ModelFolderError(
            f"model folder {folder.root} ({folder.layout} layout) lacks: "
            + "; ".join(
                f"the {name}" + (f" ({hint[name]})" if name in hint else "") for name in missing
            )
        )


def _load_text(folder: ModelFolder, device: torch.device, dtype: torch.dtype) -> UMT5TextEncoder:
    encoder, tokenizer = folder.get("text encoder").path, folder.get("tokenizer").path
    assert encoder is not None and tokenizer is not None
    if folder.layout == "diffusers":
        return UMT5TextEncoder.from_folders(encoder, tokenizer, device, dtype, WAN_TEXT_LEN)
    return UMT5TextEncoder.from_original(encoder, tokenizer, device, dtype, WAN_TEXT_LEN)


def config_for(
    geometry: dict[str, object],
    heads: int | None,
    like: ModelConfig | None,
    text_len: int,
    resolution: tuple[int, int],
) -> ModelConfig:
    """The ModelConfig of a DiT whose weights give ``geometry`` (``checkpoint.dit_geometry``):
    ``like``'s other fields (Wan2.1-1.3B's when None), named after a preset it equals."""
    dim = int(geometry["dim"])  # type: ignore[call-overload]
    heads = heads or max(1, dim // WAN_HEAD_DIM)
    known = {f.name for f in fields(ModelConfig)}
    values = {k: v for k, v in geometry.items() if k in known}
    base = like if like is not None else PRESETS["wan-1.3b"]
    candidate = replace(
        base,
        name="",
        num_heads=heads,
        text_len=text_len,
        height=resolution[0],
        width=resolution[1],
        **values,  # type: ignore[arg-type]
    )
    for name, preset in PRESETS.items():
        if replace(preset, name="", decoder_channels=candidate.decoder_channels) == candidate:
            return replace(candidate, name=name)
    return replace(candidate, name=f"wan-d{dim}-l{geometry['num_layers']}")


def _empty_dit(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> CausalWanModel:
    """A DiT with uninitialised weights (every one is overwritten by the checkpoint)."""
    with torch.device("meta"):
        model = CausalWanModel(config)
    model = model.to_empty(device=device)
    return model.to(dtype).eval().requires_grad_(False)


def _identity(paths: list[Path]) -> tuple[str, str]:
    """A content hash of the weight files (blake2b, a streaming read of about a second per GB),
    and a description naming them."""
    hasher = hashlib.blake2b(digest_size=16)
    size = 0
    for path in paths:
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                hasher.update(block)
        size += path.stat().st_size
    digest = hasher.hexdigest()
    names = ", ".join(p.name for p in paths[:3]) + (" ..." if len(paths) > 3 else "")
    return digest, f"{names} ({size} bytes, blake2b {digest})"


def _is_longlive(checkpoint: str | None) -> bool:
    """LongLive's checkpoints: named so (``longlive_base.pt``), or carrying its LoRA adapter;
    ``prompt_recache`` overrides what this decides."""
    if not checkpoint:
        return False
    return "longlive" in Path(checkpoint).name.lower() or has_lora(checkpoint)


__all__ = ["FrameDecoder", "FrameEncoder", "LoadedModel", "ModelSpec", "config_for", "load_model"]
