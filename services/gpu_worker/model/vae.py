"""The Wan VAE's decoder, run chunk by chunk, its causal feature cache kept as session state.

The decoder is diffusers' ``AutoencoderKLWan`` (loaded from a diffusers ``vae/`` folder or from
the original ``Wan2.1_VAE.pth``); nothing here reimplements it. What this module adds is the
streaming: diffusers' own ``decode`` runs the decoder one latent frame at a time, carrying a
list of cached activations (the last two time steps at the input of every causal
convolution) from frame to frame, and throws the list away at the end. Self-Forcing keeps it
from one chunk to the next instead, so a stream decoded chunk by chunk is the same video as
the whole latent sequence decoded at once. Here that list is **per-session state**: it lives
in the session's slot (a flat region of the slot's ``misc`` buffer), so it suspends, resumes,
exports and migrates with the session like its KV cache.

Layout. Before a stream's first latent frame every entry is empty (None); the decoder fills
them during the first two latent frames, after which every cached entry holds exactly two time
steps, with shapes fixed by the resolution. A chunk has at least two latent frames (checked), so
at every chunk boundary after the first chunk the cache has that fixed layout, found once by
running the decoder on the meta device. The first chunk of a stream starts from the empty list
(``fresh``) and yields ``1 + 4 * (frames - 1)`` video frames (9 for 3 latent frames); every
later chunk yields ``4 * frames`` (12), as Wan's VAE maps 21 latent frames to 81 video frames.

Latents are in the DiT's normalised space; the decoder de-normalises them with the VAE config's
``latents_mean`` / ``latents_std`` first, as diffusers' Wan pipeline does.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # diffusers is imported only when a real VAE is loaded
    # From its own module: to mypy, the name the package re-exports is diffusers' placeholder
    # for a missing torch (utils.dummy_pt_objects, without nn.Module's members).
    from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """Where each cached decoder activation sits in a session's flat decoder state: one
    ``(offset, shape)`` per cache entry (without the batch dimension), or None for an entry the
    decoder never fills."""

    entries: tuple[tuple[int, tuple[int, ...]] | None, ...]
    numel: int


def wan_vae(**config: Any) -> AutoencoderKLWan:
    """An ``AutoencoderKLWan`` of these constructor arguments (on the current default device)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan

    vae: AutoencoderKLWan = AutoencoderKLWan(**config)
    return vae


def cache_layout(vae: AutoencoderKLWan, latent_hw: tuple[int, int]) -> CacheLayout:
    """The decoder's cache layout at a chunk boundary, found by decoding two latent frames on
    the meta device (no memory, no compute)."""
    with torch.device("meta"):
        probe = wan_vae(**vae.config)
    cache: list[Any] = [None] * probe._cached_conv_counts["decoder"]
    z = torch.empty(1, probe.config["z_dim"], 2, *latent_hw, device="meta")
    x = probe.post_quant_conv(z)
    for i in range(2):
        probe.decoder(x[:, :, i : i + 1], feat_cache=cache, feat_idx=[0], first_chunk=i == 0)
    entries: list[tuple[int, tuple[int, ...]] | None] = []
    offset = 0
    for entry in cache:
        if isinstance(entry, torch.Tensor):
            shape = tuple(entry.shape[1:])
            entries.append((offset, shape))
            offset += math.prod(shape)
        else:
            entries.append(None)
    return CacheLayout(tuple(entries), offset)


class WanVaeDecoder:
    """Latents ``[B, 16, F, h, w]`` to uint8 frames, one causal chunk at a time (module
    docstring). ``state`` rows ``[B, state_numel]`` carry each session's feature cache."""

    kind = "wan-vae"

    def __init__(
        self, vae: AutoencoderKLWan, latent_hw: tuple[int, int], chunk_frames: int
    ) -> None:
        if chunk_frames < 2:
            raise ValueError(
                "the Wan VAE's cache has a fixed layout only for chunks of 2 or more "
                f"latent frames, got {chunk_frames}"
            )
        self.vae = vae
        self.chunk_frames = chunk_frames
        self.layout = cache_layout(vae, latent_hw)
        config = vae.config
        param = next(vae.parameters())
        self.device, self.dtype = param.device, param.dtype
        channels = int(config["z_dim"])
        self._mean = torch.tensor(config["latents_mean"], dtype=torch.float32).view(
            1, channels, 1, 1, 1
        )
        self._std = torch.tensor(config["latents_std"], dtype=torch.float32).view(
            1, channels, 1, 1, 1
        )

    @property
    def state_numel(self) -> int:
        return self.layout.numel

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """The weights decoding uses (the decoder and post_quant_conv; not the encoder)."""
        yield from self.vae.decoder.parameters()
        yield from self.vae.post_quant_conv.parameters()

    def _views(self, state: torch.Tensor) -> list[Any]:
        batch = state.shape[0]
        views: list[Any] = []
        for entry in self.layout.entries:
            if entry is None:
                views.append(None)
                continue
            offset, shape = entry
            views.append(state[:, offset : offset + math.prod(shape)].view(batch, *shape))
        return views

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, state: torch.Tensor, fresh: bool) -> torch.Tensor:
        """Frames ``[B, T, H, W, 3]`` uint8; ``state`` (views into the slots) is read, unless
        ``fresh`` (a stream's first chunk), and updated in place to the cache after this chunk."""
        vae = self.vae
        z = latents.float() * self._std.to(latents.device) + self._mean.to(latents.device)
        x = vae.post_quant_conv(z.to(self.dtype))
        cache: list[Any] = [None] * len(self.layout.entries) if fresh else self._views(state)
        outs = []
        for i in range(x.shape[2]):
            outs.append(
                vae.decoder(
                    x[:, :, i : i + 1], feat_cache=cache, feat_idx=[0], first_chunk=fresh and i == 0
                )
            )
        for target, entry in zip(self._views(state), cache, strict=True):
            if target is None:
                continue
            if not isinstance(entry, torch.Tensor) or entry.shape != target.shape:
                raise RuntimeError(
                    "the VAE decoder's cache left its fixed layout: "
                    f"{getattr(entry, 'shape', entry)} where {tuple(target.shape)} "
                    "was expected"
                )
            target.copy_(entry)
        video = torch.cat(outs, dim=2).clamp_(-1.0, 1.0)
        return to_uint8(video)

    @torch.inference_mode()
    def rebuild(self, latents: torch.Tensor, state: torch.Tensor) -> None:
        """Refills one session's ``state`` ``[1, numel]`` by decoding ``latents`` ``[1, C, F, h,
        w]`` (the frames before the session's next chunk, oldest first) from an empty cache;
        the frames are dropped. An approximation where the stream is longer than ``latents``."""
        self.decode(latents, state, fresh=True)


def to_uint8(video: torch.Tensor) -> torch.Tensor:
    """``[B, 3, T, H, W]`` in [-1, 1] to ``[B, T, H, W, 3]`` uint8."""
    pixels = ((video.float() + 1.0) * 127.5).round_().clamp_(0, 255).to(torch.uint8)
    return pixels.permute(0, 2, 3, 4, 1)


# -- loading ---------------------------------------------------------------------------------
WAN21_DIM_MULT = (1, 2, 4, 4)


def load_diffusers_vae(folder: str, device: torch.device, dtype: torch.dtype) -> AutoencoderKLWan:
    """A diffusers-layout ``vae/`` folder (``config.json`` + weights)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan

    vae: AutoencoderKLWan = AutoencoderKLWan.from_pretrained(
        folder, torch_dtype=dtype, local_files_only=True
    )
    # Moves in place. diffusers wraps .to with functools.wraps, which mypy reads as a plain
    # function wanting the model as its first argument.
    vae.to(device)  # type: ignore[arg-type]
    return vae.eval().requires_grad_(False)


def load_original_vae(path: str, device: torch.device, dtype: torch.dtype) -> AutoencoderKLWan:
    """The original ``Wan2.1_VAE.pth``: keys converted with diffusers' own single-file mapping;
    the widths come from the file (Wan2.1's multipliers 1, 2, 4, 4 and two residual blocks per
    stage assumed, as in every Wan2.1 VAE)."""
    state, vae = fit_original_vae(path)
    vae.load_state_dict(state, strict=True, assign=True)
    # nn.Module's own .to: diffusers' override warns about fp32-only modules, of which the Wan
    # VAE has none.
    torch.nn.Module.to(vae, device=device, dtype=dtype)
    return vae.eval().requires_grad_(False)


def fit_original_vae(path: str) -> tuple[dict[str, torch.Tensor], AutoencoderKLWan]:
    """``Wan2.1_VAE.pth`` (memory-mapped) in diffusers' names, and the ``AutoencoderKLWan`` its
    shapes make, on the meta device; ``ValueError`` naming the keys that do not fit."""
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    from .text import raise_unless_fits

    raw = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if isinstance(raw, dict) and isinstance(raw.get("state_dict"), dict):
        raw = raw["state_dict"]
    if not isinstance(raw, dict):
        raise ValueError(f"VAE {path}: not a state dict")
    # diffusers leaves its key conversion without types.
    state: dict[str, torch.Tensor] = convert_wan_vae_to_diffusers(raw)  # type: ignore[no-untyped-call]
    try:
        base_dim = int(state["decoder.conv_in.weight"].shape[0]) // WAN21_DIM_MULT[-1]
        z_dim = int(state["post_quant_conv.weight"].shape[0])
    except KeyError as exc:
        raise ValueError(f"VAE {path}: no {exc} (not a Wan2.1 VAE)") from None
    with torch.device("meta"):
        vae = wan_vae(base_dim=base_dim, z_dim=z_dim, dim_mult=list(WAN21_DIM_MULT))
    raise_unless_fits(f"VAE {path}", set(vae.state_dict()), state)
    return state, vae
