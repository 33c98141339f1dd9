"""Model shapes: one frozen config per preset.

The shapes follow Wan2.1 as used by Self-Forcing and LongLive: 16 latent channels, a VAE
stride of 4x8x8 (time x height x width), patches of 1x2x2, chunks of 3 latent frames
(12 video frames). ``wan-1.3b`` is the real 1.3B geometry at 480x832; ``tiny`` and ``small``
keep the same structure at sizes a CPU can run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

VAE_STRIDE = (4, 8, 8)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    dim: int
    ffn_dim: int
    num_heads: int
    num_layers: int
    text_dim: int
    text_len: int
    height: int  # video pixels
    width: int
    in_dim: int = 16
    out_dim: int = 16
    freq_dim: int = 256
    patch: tuple[int, int, int] = (1, 2, 2)
    eps: float = 1e-6
    cross_attn_norm: bool = True
    chunk_frames: int = 3  # latent frames per chunk
    sink_frames: int = 3  # LongLive's attention sink: the first chunk stays visible
    # Recent cached latent frames visible besides the sink. With the chunk itself, a chunk sees
    # sink + window + chunk = 12 latent frames at the defaults (LongLive's short window).
    window_frames: int = 6
    denoising_steps: tuple[int, ...] = (1000, 750, 500, 250)
    shift: float = 5.0
    decoder_channels: int = 32

    def __post_init__(self) -> None:
        if self.dim % self.num_heads:
            raise ValueError(f"dim {self.dim} not divisible by num_heads {self.num_heads}")
        if self.head_dim % 2 or self.head_dim < 6:
            raise ValueError(f"head_dim {self.head_dim} must be even and >= 6 for 3D RoPE")
        if self.height % (VAE_STRIDE[1] * self.patch[1]) or self.width % (
            VAE_STRIDE[2] * self.patch[2]
        ):
            raise ValueError(f"{self.height}x{self.width} is not a multiple of VAE stride x patch")
        # Chunks must tile the sink and the ring, so a chunk always lands in one run of slots.
        if self.sink_frames % self.chunk_frames or self.window_frames % self.chunk_frames:
            raise ValueError("sink_frames and window_frames must be multiples of chunk_frames")
        if not self.denoising_steps:
            raise ValueError("at least one denoising step is required")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def latent_height(self) -> int:
        return self.height // VAE_STRIDE[1]

    @property
    def latent_width(self) -> int:
        return self.width // VAE_STRIDE[2]

    @property
    def grid(self) -> tuple[int, int]:
        """Token grid of one latent frame (height, width)."""
        return self.latent_height // self.patch[1], self.latent_width // self.patch[2]

    @property
    def tokens_per_frame(self) -> int:
        gh, gw = self.grid
        return gh * gw

    @property
    def chunk_tokens(self) -> int:
        return self.chunk_frames * self.tokens_per_frame

    @property
    def cache_frames(self) -> int:
        """Frame slots per session: sink, ring window, and a scratch area for the current chunk."""
        return self.sink_frames + self.window_frames + self.chunk_frames

    @property
    def video_frames_per_chunk(self) -> int:
        return self.chunk_frames * VAE_STRIDE[0]


PRESETS: dict[str, ModelConfig] = {
    # Small enough that a chunk takes a few milliseconds on two CPU cores: for tests.
    "tiny": ModelConfig(
        name="tiny",
        dim=64,
        ffn_dim=256,
        num_heads=2,
        num_layers=2,
        text_dim=32,
        text_len=16,
        height=64,
        width=64,
        freq_dim=32,
        window_frames=6,
        decoder_channels=8,
    ),
    "small": ModelConfig(
        name="small",
        dim=256,
        ffn_dim=1024,
        num_heads=4,
        num_layers=6,
        text_dim=384,
        text_len=32,
        height=128,
        width=192,
        freq_dim=128,
        window_frames=6,
        decoder_channels=16,
    ),
    # Wan2.1-T2V-1.3B: the text encoder is umT5-XXL (4096-d, 512 tokens).
    "wan-1.3b": ModelConfig(
        name="wan-1.3b",
        dim=1536,
        ffn_dim=8960,
        num_heads=12,
        num_layers=30,
        text_dim=4096,
        text_len=512,
        height=480,
        width=832,
        freq_dim=256,
        window_frames=6,
        decoder_channels=64,
    ),
}


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """The named preset, optionally with some fields replaced (tests shrink windows this way);
    ``ModelConfig`` checks the result."""
    try:
        config = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}") from None
    return replace(config, **overrides) if overrides else config
