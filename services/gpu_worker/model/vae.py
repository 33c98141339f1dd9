"""The Wan VAE's decoder and encoder, run chunk by chunk, each with its causal feature cache
kept as session state (the encoder's for video-to-video sessions, ``WanVaeEncoder``).

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

import itertools
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


def _views(layout: CacheLayout, state: torch.Tensor) -> list[Any]:
    """A cache list whose entries are views into the ``state`` rows ``[B, layout.numel]``."""
    batch = state.shape[0]
    views: list[Any] = []
    for entry in layout.entries:
        if entry is None:
            views.append(None)
            continue
        offset, shape = entry
        views.append(state[:, offset : offset + math.prod(shape)].view(batch, *shape))
    return views


def _store(layout: CacheLayout, state: torch.Tensor, cache: list[Any], part: str) -> None:
    """Copies ``cache`` (after a chunk) into the ``state`` rows, checking its layout."""
    for target, entry in zip(_views(layout, state), cache, strict=True):
        if target is None:
            continue
        if not isinstance(entry, torch.Tensor) or entry.shape != target.shape:
            raise RuntimeError(
                f"the VAE {part}'s cache left its fixed layout: "
                f"{getattr(entry, 'shape', entry)} where {tuple(target.shape)} was expected"
            )
        target.copy_(entry)


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

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, state: torch.Tensor, fresh: bool) -> torch.Tensor:
        """Frames ``[B, T, H, W, 3]`` uint8; ``state`` (views into the slots) is read, unless
        ``fresh`` (a stream's first chunk), and updated in place to the cache after this chunk."""
        vae = self.vae
        z = latents.float() * self._std.to(latents.device) + self._mean.to(latents.device)
        x = vae.post_quant_conv(z.to(self.dtype))
        cache: list[Any] = (
            [None] * len(self.layout.entries) if fresh else _views(self.layout, state)
        )
        outs = []
        for i in range(x.shape[2]):
            outs.append(
                vae.decoder(
                    x[:, :, i : i + 1], feat_cache=cache, feat_idx=[0], first_chunk=fresh and i == 0
                )
            )
        _store(self.layout, state, cache, "decoder")
        video = torch.cat(outs, dim=2).clamp_(-1.0, 1.0)
        return to_uint8(video)

    @torch.inference_mode()
    def rebuild(self, latents: torch.Tensor, state: torch.Tensor) -> None:
        """Refills one session's ``state`` ``[1, numel]`` by decoding ``latents`` ``[1, C, F, h,
        w]`` (the frames before the session's next chunk, oldest first) from an empty cache;
        the frames are dropped. An approximation where the stream is longer than ``latents``."""
        self.decode(latents, state, fresh=True)


def encoder_cache_layout(vae: AutoencoderKLWan, hw: tuple[int, int]) -> CacheLayout:
    """The encoder's cache layout at a chunk boundary, found on the meta device: after the
    shortest first input chunk (one frame, then a group of 4; a chunk of 2 latent frames) and,
    checked to be the same, after two groups more."""
    with torch.device("meta"):
        probe = wan_vae(**vae.config)
    cache: list[Any] = [None] * probe._cached_conv_counts["encoder"]
    x = torch.empty(1, 3, 13, *hw, device="meta")
    shapes = []
    for bounds in ((0, 1, 5), (5, 9, 13)):
        for start, end in itertools.pairwise(bounds):
            probe.encoder(x[:, :, start:end], feat_cache=cache, feat_idx=[0])
        shapes.append([tuple(e.shape) if isinstance(e, torch.Tensor) else None for e in cache])
    if shapes[0] != shapes[1]:
        raise RuntimeError("the VAE encoder's cache has no fixed layout at chunk boundaries")
    entries: list[tuple[int, tuple[int, ...]] | None] = []
    offset = 0
    for shape in shapes[0]:
        if shape is None:
            entries.append(None)
            continue
        entries.append((offset, shape[1:]))
        offset += math.prod(shape[1:])
    return CacheLayout(tuple(entries), offset)


class WanVaeEncoder:
    """Input frames ``[B, T, H, W, 3]`` uint8 to normalised latents ``[B, 16, F, h, w]``, one
    causal chunk at a time, as ``AutoencoderKLWan.encode`` runs the encoder over a whole clip:
    the first frame alone, then groups of 4, a list of cached activations carried from group to
    group. Here that list is carried from chunk to chunk as well, in ``state`` rows (a region of
    the session's slot, like the decoder's), so a stream encoded chunk by chunk is the clip
    encoded at once. A stream's first input chunk is ``1 + 4 * (frames - 1)`` frames (9), every
    later one ``4 * frames`` (12): output chunk ``n`` has as many frames as input chunk ``n``.
    The latent is the posterior's mode (its mean), normalised as the DiT's latents are."""

    kind = "wan-vae"

    def __init__(self, vae: AutoencoderKLWan, hw: tuple[int, int], chunk_frames: int) -> None:
        if chunk_frames < 2:
            raise ValueError(
                "the Wan VAE's cache has a fixed layout only for chunks of 2 or more "
                f"latent frames, got {chunk_frames}"
            )
        self.vae = vae
        self.chunk_frames = chunk_frames
        self.layout = encoder_cache_layout(vae, hw)
        config = vae.config
        param = next(vae.parameters())
        self.device, self.dtype = param.device, param.dtype
        channels = self.channels = int(config["z_dim"])
        shape = (1, channels, 1, 1, 1)
        self._mean = torch.tensor(config["latents_mean"], dtype=torch.float32).view(shape)
        self._std = torch.tensor(config["latents_std"], dtype=torch.float32).view(shape)

    @property
    def state_numel(self) -> int:
        return self.layout.numel

    def input_frames(self, fresh: bool) -> int:
        return 1 + 4 * (self.chunk_frames - 1) if fresh else 4 * self.chunk_frames

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """The weights encoding uses (the encoder and quant_conv)."""
        yield from self.vae.encoder.parameters()
        yield from self.vae.quant_conv.parameters()

    @torch.inference_mode()
    def encode(self, frames: torch.Tensor, state: torch.Tensor, fresh: bool) -> torch.Tensor:
        """Latents ``[B, C, F, h, w]`` float32; ``state`` is read, unless ``fresh``, and updated
        in place to the cache after this chunk."""
        vae = self.vae
        x = frames.to(self.device).permute(0, 4, 1, 2, 3).to(self.dtype).contiguous() / 127.5 - 1.0
        cache: list[Any] = (
            [None] * len(self.layout.entries) if fresh else _views(self.layout, state)
        )
        bounds = [0, 1] if fresh else [0]
        bounds += list(range(bounds[-1] + 4, x.shape[2] + 1, 4))
        if bounds[-1] != x.shape[2]:
            raise ValueError(
                f"an input chunk of {x.shape[2]} frames: the encoder takes "
                f"{self.input_frames(fresh)} here"
            )
        outs = [
            vae.encoder(x[:, :, start:end], feat_cache=cache, feat_idx=[0])
            for start, end in itertools.pairwise(bounds)
        ]
        _store(self.layout, state, cache, "encoder")
        moments = vae.quant_conv(torch.cat(outs, dim=2))
        mean: torch.Tensor = moments[:, : self.channels].float()
        return (mean - self._mean.to(mean.device)) / self._std.to(mean.device)


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
