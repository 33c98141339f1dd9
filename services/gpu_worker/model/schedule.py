"""The few-step flow-matching schedule of Self-Forcing (4 steps, shifted sigmas).

A noisy latent at noise level sigma is ``x_t = (1 - sigma) * x0 + sigma * noise``; the model
predicts the flow ``noise - x0``, so ``x0 = x_t - sigma * flow``. Between steps the predicted
clean latent is re-noised with fresh noise to the next level.
"""

from __future__ import annotations

from .config import ModelConfig


def shifted_sigma(timestep: float, shift: float) -> float:
    s = timestep / 1000.0
    return shift * s / (1.0 + (shift - 1.0) * s)


def sigmas(config: ModelConfig) -> list[float]:
    """Noise level of each denoising step, highest first."""
    return [shifted_sigma(t, config.shift) for t in config.denoising_steps]
