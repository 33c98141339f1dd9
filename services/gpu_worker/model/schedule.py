"""The few-step flow-matching schedule of Self-Forcing (4 steps, shifted sigmas).

A noisy latent at noise level sigma is ``x_t = (1 - sigma) * x0 + sigma * noise``; the model
predicts the flow ``noise - x0``, so ``x0 = x_t - sigma * flow``. Between steps the predicted
clean latent is re-noised with fresh noise to the next level.
"""

from __future__ import annotations

from collections.abc import Sequence

from .config import ModelConfig


def shifted_sigma(timestep: float, shift: float) -> float:
    s = timestep / 1000.0
    return shift * s / (1.0 + (shift - 1.0) * s)


def sigmas(config: ModelConfig) -> list[float]:
    """Noise level of each denoising step, highest first."""
    return [shifted_sigma(t, config.shift) for t in config.denoising_steps]


def sub_schedule(levels: Sequence[float], steps: int) -> list[float]:
    """The levels a chunk denoised in ``steps`` steps runs at, out of the full schedule's
    ``levels`` (highest first): the quality budget's shorter sampler.

    A subset of the full schedule's levels, not a schedule re-spaced to ``steps`` levels: a
    distilled few-step generator (Self-Forcing and LongLive are DMD-distilled) was trained at
    exactly those levels and at no level between them, and the hand-set stand-in
    (``visible.py``) is solved at exactly those timesteps. Which ones:

    - the first, always: a chunk starts from pure noise, which is what the first level
      (timestep 1000, sigma 1) expects;
    - the last, from two steps up: the chunk's clean latent is predicted from its least noisy
      input, which is what decides its detail;
    - between them, the levels nearest to evenly spaced by index (a tie goes to the later,
      less noisy one): 3 of (1000, 750, 500, 250) is (1000, 500, 250), 2 is (1000, 250),
      1 is (1000).

    At the full count this is ``levels`` itself, so a chunk at full steps runs as before.
    """
    count = len(levels)
    if not 1 <= steps <= count:
        raise ValueError(f"steps must be 1..{count} (the full schedule's), got {steps}")
    if steps == 1:
        return [levels[0]]
    span = 2 * (steps - 1)
    return [levels[(2 * i * (count - 1) + steps - 1) // span] for i in range(steps)]
