"""The position and timestep embeddings of Wan2.1 that the DiT (``dit.py``) and its hand-set
weights (``visible.py``) both build on; apart so that neither imports the other for them."""

from __future__ import annotations

import torch


def sinusoidal_embedding(dim: int, t: torch.Tensor) -> torch.Tensor:
    half = dim // 2
    freqs = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64, device=t.device) / half)
    angles = torch.outer(t.to(torch.float64), freqs)
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=1).float()


def rope_split(head_dim: int) -> tuple[int, int, int]:
    """Complex pairs per axis (frame, height, width), Wan's 3D RoPE split of the head dim."""
    c = head_dim // 2
    return c - 2 * (c // 3), c // 3, c // 3
