"""A causal video diffusion transformer in the style of Wan2.1 (as Self-Forcing and LongLive use it).

Module names and parameter shapes follow the public Wan2.1 ``WanModel`` so that a checkpoint in
that layout loads by name (see ``checkpoint.py``). What differs from the bidirectional model is
the attention: a chunk's tokens attend to a per-session KV cache (attention-sink frames plus a
ring of recent frames) and to themselves, with a key mask so that sessions at different
positions and cache fills run in one batched pass.

Shapes: latents are ``[B, C, F, h, w]``; tokens ``[B, L, dim]``; a session's self-attention
cache for one layer is ``[2, heads, cache_tokens, head_dim]`` (keys, values) and its
cross-attention cache ``[2, heads, text_len, head_dim]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .embedding import rope_split, sinusoidal_embedding
from .visible import init_visible_dit, unfit_reason


@dataclass(slots=True)
class ChunkCaches:
    """Views of the slot buffers for the sessions of one batched pass.

    ``self_kv[i]`` is layer i's ``[B, 2, H, cache_tokens, d]``; the current chunk's keys and
    values are written into its scratch token range ``scratch`` before attention, so no
    concatenation (a copy of the whole cache) is needed. ``key_mask`` is ``[B, 1, 1,
    cache_tokens]`` (True = attend) or None when every key is valid.
    """

    self_kv: list[torch.Tensor]
    cross_kv: list[torch.Tensor]
    key_mask: torch.Tensor | None
    scratch: tuple[int, int]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class LayerNorm(nn.LayerNorm):
    """LayerNorm computed in float32, as Wan does under bf16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.float() if self.weight is not None else None
        bias = self.bias.float() if self.bias is not None else None
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).type_as(x)


def _axis_freqs(pairs: int, device: torch.device) -> torch.Tensor:
    exponents = torch.arange(0, 2 * pairs, 2, dtype=torch.float64, device=device) / (2 * pairs)
    return 1.0 / torch.pow(10000.0, exponents)


def rope_angles(
    config: ModelConfig, start_frames: torch.Tensor, frames: int, device: torch.device
) -> torch.Tensor:
    """Rotation angles ``[B, frames * tokens_per_frame, head_dim // 2]`` (float64) at absolute
    positions.

    Positions are absolute latent-frame indices, computed on the fly, so a long stream never
    runs off a precomputed table; the cache stores keys already rotated.
    """
    cf, ch, cw = rope_split(config.head_dim)
    gh, gw = config.grid
    frame_pos = start_frames.to(device=device, dtype=torch.float64)[:, None] + torch.arange(
        frames, device=device, dtype=torch.float64
    )
    f_ang = frame_pos[..., None] * _axis_freqs(cf, device)  # [B, F, cf]
    h_ang = torch.arange(gh, device=device, dtype=torch.float64)[:, None] * _axis_freqs(ch, device)
    w_ang = torch.arange(gw, device=device, dtype=torch.float64)[:, None] * _axis_freqs(cw, device)
    batch = start_frames.shape[0]
    f_part = f_ang[:, :, None, None, :].expand(batch, frames, gh, gw, cf)
    h_part = h_ang[None, None, :, None, :].expand(batch, frames, gh, gw, ch)
    w_part = w_ang[None, None, None, :, :].expand(batch, frames, gh, gw, cw)
    angles = torch.cat([f_part, h_part, w_part], dim=-1)
    return angles.reshape(batch, frames * gh * gw, cf + ch + cw)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of ``x`` ``[B, L, H, d]`` by angles given as ``[B, L, 1, d/2]``."""
    pairs = torch.unflatten(x.float(), -1, (-1, 2))
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


class _Attention(nn.Module):
    """Wan's attention weights: q, k, v, o projections and RMS norms of queries and keys."""

    def __init__(self, dim: int, num_heads: int, eps: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm_q = RMSNorm(dim, eps)
        self.norm_k = RMSNorm(dim, eps)


class SelfAttention(_Attention):
    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: torch.Tensor,
        scratch: tuple[int, int],
        key_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        batch, length, dim = x.shape
        heads = (batch, length, self.num_heads, dim // self.num_heads)
        q = apply_rope(self.norm_q(self.q(x)).view(heads), *rope)
        k = apply_rope(self.norm_k(self.k(x)).view(heads), *rope)
        v = self.v(x).view(heads)
        start, end = scratch
        kv[:, 0, :, start:end] = k.transpose(1, 2)
        kv[:, 1, :, start:end] = v.transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), kv[:, 0], kv[:, 1], attn_mask=key_mask
        )
        projected: torch.Tensor = self.o(out.transpose(1, 2).reshape(batch, length, dim))
        return projected


class CrossAttention(_Attention):
    def compute_kv(self, context: torch.Tensor) -> torch.Tensor:
        """``[B, 2, H, text_len, d]`` from embedded context ``[B, text_len, dim]``."""
        batch, length, dim = context.shape
        heads = (batch, length, self.num_heads, dim // self.num_heads)
        k = self.norm_k(self.k(context)).view(heads).transpose(1, 2)
        v = self.v(context).view(heads).transpose(1, 2)
        return torch.stack([k, v], dim=1)

    def forward(self, x: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q = self.norm_q(self.q(x)).view(batch, length, self.num_heads, dim // self.num_heads)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), kv[:, 0], kv[:, 1])
        projected: torch.Tensor = self.o(out.transpose(1, 2).reshape(batch, length, dim))
        return projected


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dim, eps = config.dim, config.eps
        self.norm1 = LayerNorm(dim, eps, elementwise_affine=False)
        self.self_attn = SelfAttention(dim, config.num_heads, eps)
        self.norm3 = (
            LayerNorm(dim, eps, elementwise_affine=True)
            if config.cross_attn_norm
            else nn.Identity()
        )
        self.cross_attn = CrossAttention(dim, config.num_heads, eps)
        self.norm2 = LayerNorm(dim, eps, elementwise_affine=False)
        self.ffn = nn.Sequential(
            nn.Linear(dim, config.ffn_dim),
            nn.GELU(approximate="tanh"),
            nn.Linear(config.ffn_dim, dim),
        )
        self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    def forward(
        self,
        x: torch.Tensor,
        e: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        self_kv: torch.Tensor,
        cross_kv: torch.Tensor,
        scratch: tuple[int, int],
        key_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = (self.modulation.float() + e).chunk(6, dim=1)
        y = self.self_attn(
            (self.norm1(x).float() * (1 + scale1) + shift1).type_as(x),
            rope,
            self_kv,
            scratch,
            key_mask,
        )
        x = x + (y.float() * gate1).type_as(x)
        x = x + self.cross_attn(self.norm3(x), cross_kv)
        y = self.ffn((self.norm2(x).float() * (1 + scale2) + shift2).type_as(x))
        out: torch.Tensor = x + (y.float() * gate2).type_as(x)
        return out


class Head(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dim = config.dim
        self.norm = LayerNorm(dim, config.eps, elementwise_affine=False)
        self.head = nn.Linear(dim, config.out_dim * math.prod(config.patch))
        self.modulation = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)

    def forward(self, x: torch.Tensor, e0: torch.Tensor) -> torch.Tensor:
        shift, scale = (self.modulation.float() + e0[:, None, :]).chunk(2, dim=1)
        out: torch.Tensor = self.head((self.norm(x).float() * (1 + scale) + shift).type_as(x))
        return out


class CausalWanModel(nn.Module):
    """Predicts the flow (noise - x0) of a noisy chunk, reading and filling the KV caches."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.dim
        self.patch_embedding = nn.Conv3d(
            config.in_dim, dim, kernel_size=config.patch, stride=config.patch
        )
        self.text_embedding = nn.Sequential(
            nn.Linear(config.text_dim, dim), nn.GELU(approximate="tanh"), nn.Linear(dim, dim)
        )
        self.time_embedding = nn.Sequential(
            nn.Linear(config.freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim)
        )
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.head = Head(config)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Seeded weights for running without a checkpoint: Wan's random scheme, then (for
        a config large enough) the hand-set weights of ``visible.py``, which make the frames
        a visibly moving picture that follows the prompt, the seed and the cache. Not a
        trained model; ``load_checkpoint`` replaces all of it."""
        self._init_random(generator)
        if unfit_reason(self.config) is None:
            init_visible_dit(self, self.config, generator)

    def _blocks(self) -> list[Block]:
        # nn.ModuleList yields plain Modules to the type checker; these are all Blocks.
        return cast(list[Block], list(self.blocks))

    def _init_random(self, generator: torch.Generator) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight, generator=generator)
                assert module.bias is not None  # every Linear here is built with one
                nn.init.zeros_(module.bias)
        nn.init.xavier_uniform_(self.patch_embedding.weight.flatten(1), generator=generator)
        assert self.patch_embedding.bias is not None
        nn.init.zeros_(self.patch_embedding.bias)
        for seq in (self.text_embedding, self.time_embedding):
            for module in seq:
                if isinstance(module, nn.Linear):
                    nn.init.normal_(module.weight, std=0.02, generator=generator)
        nn.init.normal_(self.head.head.weight, std=0.02, generator=generator)
        for param in [b.modulation for b in self._blocks()] + [self.head.modulation]:
            nn.init.normal_(param, std=param.shape[-1] ** -0.5, generator=generator)

    def encode_context(self, text: torch.Tensor) -> list[torch.Tensor]:
        """Per-layer cross-attention caches ``[B, 2, H, text_len, d]`` for text ``[B, L, text_dim]``."""
        context = self.text_embedding(text.to(self.patch_embedding.weight.dtype))
        return [block.cross_attn.compute_kv(context) for block in self._blocks()]

    def forward(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        start_frames: torch.Tensor,
        caches: ChunkCaches,
    ) -> torch.Tensor:
        """Flow prediction ``[B, C, F, h, w]`` for noisy latents at (per-sample) timesteps."""
        config = self.config
        dtype = self.patch_embedding.weight.dtype
        batch, _, frames, height, width = latents.shape
        x = self.patch_embedding(latents.to(dtype)).flatten(2).transpose(1, 2)

        e0 = self.time_embedding(sinusoidal_embedding(config.freq_dim, timesteps).to(dtype))
        e = self.time_projection(e0).float().unflatten(1, (6, config.dim))
        angles = rope_angles(config, start_frames, frames, x.device)[:, :, None, :]
        # cos/sin in float64 first: a long stream's frame index times the fastest frequency
        # would lose its phase in float32.
        rope = (torch.cos(angles).float(), torch.sin(angles).float())

        for block, self_kv, cross_kv in zip(
            self.blocks, caches.self_kv, caches.cross_kv, strict=True
        ):
            x = block(x, e, rope, self_kv, cross_kv, caches.scratch, caches.key_mask)

        out = self.head(x, e0.float())
        return self._unpatchify(out, frames, height, width)

    def _unpatchify(self, out: torch.Tensor, frames: int, height: int, width: int) -> torch.Tensor:
        pt, ph, pw = self.config.patch
        gh, gw = height // ph, width // pw
        channels = self.config.out_dim
        grid = out.view(out.shape[0], frames // pt, gh, gw, pt, ph, pw, channels)
        # 'b f h w p q r c -> b c f p h q w r', Wan's unpatchify order.
        return grid.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(
            out.shape[0], channels, frames, height, width
        )


def build_model(
    config: ModelConfig,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> CausalWanModel:
    """A model with seeded random weights, built directly on ``device``.

    Two workers with the same seed on the same kind of device hold the same weights, which
    is what lets a session migrate between them.
    """
    device = torch.device(device)
    with torch.device(device):
        model = CausalWanModel(config)
    generator = torch.Generator(device=device).manual_seed(seed)
    model.init_weights(generator)
    return model.to(dtype).eval().requires_grad_(False)
