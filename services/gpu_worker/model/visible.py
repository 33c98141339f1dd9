"""Hand-set weights that make the untrained model visibly alive. It is not a trained model.

With random weights the DiT's clean latents are close to noise and a random decoder turns them
into flat grey. ``init_visible_dit`` sets the weights of the first two blocks, the embeddings
and the head by hand, so that the model is a small deterministic dynamical system over a
3-dimensional *visible subspace* of the 16 latent channels (``visible_basis``), which the
decoder maps to colour (``decoder.py``). Per token, the clean latent a chunk ends with is

    x0 = mu + detail
    mu = HISTORY * read(frames) - GLOBAL_PULL * mean(frames)
         - (HISTORY - GLOBAL_PULL) * read(prompt colours) + prompt colour

- ``read``: self-attention head 0 of blocks 0 and 1 averages the cached clean frames at the
  same place (moved by a small seeded drift), mostly the most recent ones, so chunk k + 1
  continues chunk k. Block 0 reads the frames, block 1 the prompt colour each frame was cached
  under, so a KV re-cache under a new prompt changes what the history means. ``mean``, head 1
  of block 0, averages the same frames over the whole picture: the frame-wide colour returns
  to the prompt's within a few chunks while the shapes persist.
- ``prompt colour``: cross-attention head 0 of block 0 averages a seeded linear map of the
  prompt's word embeddings (padding rows get no weight), so prompts differ in colour.
- ``detail``: at the last denoising step, self-attention head 1 of block 1 smooths the
  chunk's own noise (x_t less its known mean) over space and neighbouring frames, so the
  session's seed decides it.
- The first chunk has no history (its read is 0) and marks itself in a latent direction the
  decoder does not show; later reads give those frames (the attention sink) no weight once
  newer frames exist, so the picture does not hang on its first second.

The flow head returns ``(x_t - x0) / sigma``, so the sampler's ``x_t - sigma * flow`` lands on
``x0`` at every step. What keeps the sub-layers linear where they must be:

- the residual stream holds large constant channels (+c, -c, ...), so each LayerNorm divides
  by an almost constant standard deviation; a reader subtracts a channel that is 0 in the
  stream (and modulated like the channels read), which undoes the LayerNorm's mean exactly
  and, being small after the LayerNorm, loses nothing to bf16 rounding;
- GELU and SiLU pass a signal linearly in (+a, -a) pairs: ``f(a) - f(-a) == a`` for both;
- the timestep embedding is solved, at the sampler's timesteps, into one-hot *time lanes*,
  from which the modulation builds each per-step factor as a gate or a scale (1 / sigma,
  whether keys are noisy, the detail's gain), never as a shift of a small signal;
- the query's and key's RoPE pairs are set so that each logit is a sum of
  ``a * cos(theta * distance + phase)`` terms: a kernel over frames, rows and columns.

Blocks after the second keep Wan's random initialisation with zeroed output projections, so
they pass the stream through (as DiT's adaLN-Zero starts). ``load_checkpoint`` overwrites all
of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .config import ModelConfig
from .embedding import rope_split, sinusoidal_embedding
from .schedule import sigmas

VISIBLE_DIMS = 3  # latent directions the decoder shows: one colour each
_BASIS_SEED = 0x5EED  # fixed: the DiT and the decoder must agree on the subspace

# The dynamics, tuned by eye on strips of frames (tests/gpu_worker/test_visible.py).
HISTORY = 0.9  # weight of the cached frames in a chunk's mean; the prompt's colour has the rest
GLOBAL_PULL = 0.4  # taken off HISTORY for the frame-wide mean: its colour returns to the prompt's
DETAIL = 0.5  # standard deviation of a chunk's fresh detail, per visible direction
PROMPT_GAIN = 1.4  # a six-word prompt's colour is about unit size
DRIFT = 0.3  # tokens per chunk that the picture moves, in a seeded direction
HISTORY_NEIGHBOUR = 0.15  # history weight of a neighbouring token, relative to the centre
HISTORY_RECENCY = 1.6  # history logit lost by a frame one chunk older
DETAIL_FRAME_NEIGHBOUR = 0.5  # detail weight of the next frame, relative to the same frame
DETAIL_WIDTH = 0.2  # the detail's spatial width, as a fraction of the token grid's smaller side
FLAG_SCORE = 15.0  # logit by which a head prefers clean (cached) keys, or noisy ones
PROMPT_SCORE = 20.0  # logit by which the prompt head prefers words over padding
STREAM_CONSTANT = 100.0  # size of the constant channels that steady the LayerNorms
MARK = 2.0  # the stream's copy of the first-chunk mark (small: it adds to the LayerNorm's std)
_SILU_ONE = 1.2784645427610738  # silu(_SILU_ONE) == 1


def latent_basis(channels: int) -> torch.Tensor:
    """``[channels, VISIBLE_DIMS + 1]`` orthonormal: the visible directions, then the one
    that marks the first chunk (the decoder does not show it)."""
    generator = torch.Generator().manual_seed(_BASIS_SEED)
    draw = torch.randn(channels, VISIBLE_DIMS + 1, generator=generator, dtype=torch.float64)
    basis: torch.Tensor = torch.linalg.qr(draw).Q
    return basis.float()


def visible_basis(channels: int) -> torch.Tensor:
    """``[channels, VISIBLE_DIMS]``: the latent directions the decoder shows."""
    return latent_basis(channels)[:, :VISIBLE_DIMS]


def unfit_reason(config: ModelConfig) -> str | None:
    """Why ``config`` is too small for the hand-set weights (None when it fits)."""
    layout = _Layout(config.dim, math.prod(config.patch))
    if config.num_layers < 2 or config.num_heads < 2:
        return "it needs 2 blocks with 2 heads each"
    if config.patch[0] != 1:
        return f"patches {config.patch} span frames"
    if len(layout.constants) < max(8, len(config.denoising_steps) + 1):
        return f"dim {config.dim} leaves too few constant channels"
    if config.ffn_dim < 2 * VISIBLE_DIMS or rope_split(config.head_dim)[2] < 2:
        return "the FFN or the head's width RoPE pairs are too narrow"
    return None


@torch.no_grad()
def init_visible_dit(model: nn.Module, config: ModelConfig, generator: torch.Generator) -> None:
    """Overwrites blocks 0-1, the embeddings and the head of ``model``, a ``CausalWanModel``
    of ``config`` (module docstring); later blocks keep their weights but pass the stream
    through. Deterministic in ``generator``, from which the prompt's colour map and the drift
    direction are drawn. Takes any module by its parameters' names, so that this module need
    not import the DiT that calls it."""
    reason = unfit_reason(config)
    if reason:
        raise ValueError(f"preset {config.name!r} cannot take the visible weights: {reason}")
    layout = _Layout(config.dim, math.prod(config.patch))
    draw = _Draws.make(config, generator)
    schedule = _Schedule.make(sigmas(config), _detail_gain(config))
    designed = {
        n: p
        for n, p in model.named_parameters()
        if n.startswith(
            (
                "patch_embedding.",
                "text_embedding.",
                "time_embedding.",
                "time_projection.",
                "blocks.0.",
                "blocks.1.",
                "head.",
            )
        )
    }
    # Values are worked out in float64 and land in float32 (the model's dtype at init).
    params = {n: torch.zeros(p.shape, dtype=torch.float32) for n, p in designed.items()}
    _patch_embedding(params, config, layout)
    _time_embedding(params, config, layout, schedule)
    _history(params, config, layout, draw)
    _prompt_colour(params, config, layout, draw)
    _prompt_history_detail_and_mean(params, config, layout, draw)
    _head(params, config, layout)
    for name, param in designed.items():
        param.copy_(params[name].to(device=param.device, dtype=param.dtype))
    outputs = (".self_attn.o.", ".cross_attn.o.", ".ffn.2.")
    for name, param in model.named_parameters():
        block = name.split(".")[1] if name.startswith("blocks.") else ""
        if block.isdigit() and int(block) >= 2 and any(o in name for o in outputs):
            param.zero_()


@dataclass(frozen=True, slots=True)
class _Layout:
    """Residual-stream channels (see the module docstring)."""

    dim: int
    pixels: int  # latent pixels per token (2x2)

    @property
    def signal(self) -> list[list[int]]:
        """``signal[q][i]``: visible direction i at the token's latent pixel q: x_t, then
        x_t / sigma after block 0's FFN, then (x_t - x0) / sigma, the flow, after block 1."""
        r = VISIBLE_DIMS
        return [[q * r + i for i in range(r)] for q in range(self.pixels)]

    @property
    def signal_flat(self) -> list[int]:
        return list(range(self.pixels * VISIBLE_DIMS))

    @property
    def mean(self) -> list[int]:
        """``mu``, the chunk's mean per visible direction (one value per token)."""
        start = self.pixels * VISIBLE_DIMS
        return list(range(start, start + VISIBLE_DIMS))

    @property
    def prompt(self) -> list[int]:
        """The prompt's colour (times PROMPT_GAIN)."""
        start = (self.pixels + 1) * VISIBLE_DIMS
        return list(range(start, start + VISIBLE_DIMS))

    @property
    def mark(self) -> int:
        """MARK times the token's mean along the mark direction; like the signal, it becomes
        the flow (minus the target, divided by sigma)."""
        return (self.pixels + 2) * VISIBLE_DIMS

    @property
    def flag(self) -> int:
        """0 in the stream; in blocks 0-1 its modulated value is the key flag (its shift)."""
        return self.mark + 1

    @property
    def references(self) -> tuple[int, int, int]:
        """Channels that are 0 in the stream, modulated like the signal, like nothing, and
        like the mark: a reader subtracts the one modulated like the channels it reads."""
        return self.flag + 1, self.flag + 2, self.flag + 3

    @property
    def constants(self) -> list[int]:
        """Channels holding +c, -c, +c, ... (an even number of them)."""
        start = self.flag + 4
        return list(range(start, start + (self.dim - start) // 2 * 2))

    @property
    def norm_scale(self) -> float:
        """The standard deviation a LayerNorm sees: the constants' (the signal is small)."""
        return STREAM_CONSTANT * math.sqrt(len(self.constants) / self.dim)

    def reader(self, weights: dict[int, float], reference: int) -> torch.Tensor:
        """A row over a LayerNorm's (modulated) output that gives ``sum(w * x[channel])``:
        ``norm(x)[c] - norm(x)[reference] == x[c] / std`` for a reference that is 0 in the
        stream, and ``norm_scale`` undoes the division."""
        row = torch.zeros(self.dim, dtype=torch.float64)
        scale = self.norm_scale
        for channel, weight in weights.items():
            row[channel] += weight * scale
        row[reference] -= sum(weights.values()) * scale
        return row


# -- what is drawn from the generator ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Draws:
    prompt_map: torch.Tensor  # [VISIBLE_DIMS, text_dim]: word embedding -> colour
    presence: torch.Tensor  # [4, text_dim]: directions whose sizes tell a word from padding
    drift: tuple[float, float]  # (rows, columns) of tokens per chunk

    @classmethod
    def make(cls, config: ModelConfig, generator: torch.Generator) -> _Draws:
        seed = torch.randint(0, 2**62, (1,), generator=generator, device=generator.device)
        cpu = torch.Generator().manual_seed(int(seed))
        text = config.text_dim
        prompt_map = torch.randn(VISIBLE_DIMS, text, generator=cpu, dtype=torch.float64)
        presence = torch.randn(4, text, generator=cpu, dtype=torch.float64)
        angle = float(torch.rand(1, generator=cpu, dtype=torch.float64)) * 2.0 * math.pi
        return cls(
            prompt_map / math.sqrt(text),
            presence / math.sqrt(text),
            (DRIFT * math.sin(angle), DRIFT * math.cos(angle)),
        )


# -- time: per-step factors -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Schedule:
    """Values at the sampler's timesteps: each denoising step's, then t = 0 (cache write)."""

    timesteps: list[float]
    inv_sigma: list[float]
    key_flag: list[float]  # -1 for keys of noisy latents, +1 for the clean ones cached
    cache_write: list[float]  # 1 at the cache-write pass, else 0
    detail_gate: list[float]  # the detail head's output gate: minus its gain / sigma, last step

    @classmethod
    def make(cls, levels: list[float], detail_gain: float) -> _Schedule:
        steps = len(levels)
        return cls(
            timesteps=[s * 1000.0 for s in levels] + [0.0],
            inv_sigma=[1.0 / s for s in levels] + [1.0],
            key_flag=[-1.0] * steps + [1.0],
            cache_write=[0.0] * steps + [1.0],
            # The signal channels hold (x_t - x0) / sigma from block 0's FFN on.
            detail_gate=[0.0] * (steps - 1) + [-detail_gain / levels[-1], 0.0],
        )


def _value_gain(last_sigma: float) -> float:
    """The last step's x_t is (1 - s) x0 + s noise: 1 / (1 - s) reads x0 back at full size."""
    return 1.0 / (1.0 - last_sigma) if last_sigma < 1.0 else 1.0


def _detail_gain(config: ModelConfig) -> float:
    """The detail head's gain for a detail of standard deviation DETAIL.

    At the last step the detail head (block 1, head 1) reads ``gain * x_t``, whose noise part is ``gain * s`` times the
    token mean of 4 unit latent pixels (variance 1/4), through its weights ``w``: a standard
    deviation of ``gain * s * 0.5 * sqrt(sum w^2)``, taken as its root mean square over
    positions.
    """
    spread = 0.5 * math.sqrt(_detail_concentration(config))
    last = sigmas(config)[-1]
    return DETAIL / (_value_gain(last) * last * spread)


def _time_embedding(
    params: dict[str, torch.Tensor], config: ModelConfig, layout: _Layout, schedule: _Schedule
) -> None:
    """time_embedding -> e0 and time_projection -> e, exact at the sampler's timesteps.

    e0 is 0 but for one-hot time lanes: silu(lane_j) is 1 at timestep j, else 0.
    time_projection builds e, the blocks' per-step modulation, from the lanes.
    """
    # The engine passes timesteps as float32: solve at exactly those values.
    times = torch.tensor(schedule.timesteps, dtype=torch.float32)
    features = sinusoidal_embedding(config.freq_dim, times).double()  # [T, freq_dim]
    count = min(config.freq_dim, config.dim // 2)
    features = features[:, :count]
    # Hidden units in +/- pairs: silu(z) - silu(-z) == z, so e0 is linear in the features.
    w1 = params["time_embedding.0.weight"]
    for j in range(count):
        w1[2 * j, j], w1[2 * j + 1, j] = 1.0, -1.0
    design = torch.cat([features, torch.ones(len(times), 1, dtype=torch.float64)], dim=1)
    solve = torch.linalg.pinv(design)  # [count + 1, T]
    lanes = layout.constants[: len(times)]  # e0 reaches only the head, which ignores them
    targets = {
        lane: [_SILU_ONE if j == i else 0.0 for i in range(len(times))]
        for j, lane in enumerate(lanes)
    }
    w2, b2 = params["time_embedding.2.weight"], params["time_embedding.2.bias"]
    for channel, values in targets.items():
        coef = solve @ torch.tensor(values, dtype=torch.float64)
        w2[channel, 0 : 2 * count : 2] = coef[:-1]
        w2[channel, 1 : 2 * count : 2] = -coef[:-1]
        b2[channel] = coef[-1]

    # e = W silu(e0), in roles shift1, scale1, gate1, shift2, scale2, gate2 (each `dim` wide).
    wp = params["time_projection.1.weight"]

    def role(index: int, channels: list[int], values: list[float]) -> None:
        for channel in channels:
            for lane, value in zip(lanes, values, strict=True):
                wp[index * config.dim + channel, lane] = value

    # Block 0 reads the signal and the mark only from clean (cached) tokens: their scale is
    # -1 while denoising (block 1 adds the value gain back to the signal's).
    signal_ref, _, mark_ref = layout.references
    role(0, [layout.flag], schedule.key_flag)
    cleared = [w - 1.0 for w in schedule.cache_write]
    role(1, [*layout.signal_flat, signal_ref, layout.mark, mark_ref], cleared)
    role(2, layout.signal_flat, schedule.detail_gate)
    role(2, [layout.mark], [1.0 - w for w in schedule.cache_write])
    # Block 0's FFN divides the signal and the mark by sigma (block 1's adds 1 to the gate).
    role(5, [*layout.signal_flat, layout.mark], [g - 1.0 for g in schedule.inv_sigma])


# -- attention kernels ------------------------------------------------------------------------


def _rope_pairs(config: ModelConfig) -> tuple[list[int], list[int], list[int]]:
    """A head's RoPE pair indices along frames, rows and columns."""
    cf, ch, cw = rope_split(config.head_dim)
    return list(range(cf)), list(range(cf, cf + ch)), list(range(cf + ch, cf + ch + cw))


def _axis_freqs(pairs: int) -> list[float]:
    return [10000.0 ** (-j / pairs) for j in range(pairs)]


def _flag_pair(config: ModelConfig) -> int:
    """The slowest column pair: it barely rotates across a frame, so it carries the flag."""
    return _rope_pairs(config)[2][-1]


def _kernel_terms(
    config: ModelConfig, kind: str, drift: tuple[float, float]
) -> list[tuple[int, float, float]]:
    """RoPE terms (pair, amplitude, phase) of a head of one kind: ``history`` (the cached
    frames at the same place, moved by the drift), ``global`` (the cached frames, everywhere)
    or ``detail`` (the chunk's own tokens, nearby)."""
    frame, rows, columns = _rope_pairs(config)
    axes = [  # (pairs, their frequencies, tokens along the axis, drift along it)
        (rows, _axis_freqs(len(rows)), config.grid[0], drift[0]),
        (columns[:-1], _axis_freqs(len(columns))[:-1], config.grid[1], drift[1]),
    ]
    frame_freqs = _axis_freqs(len(frame))
    terms: list[tuple[int, float, float]] = []
    if kind in ("history", "global"):
        if kind == "history":  # every row and column pair: a sharp peak, moved by the drift
            for pairs, freqs, _, shift in axes:
                amplitude = -math.log(HISTORY_NEIGHBOUR) / sum(1.0 - math.cos(f) for f in freqs)
                terms += [(p, amplitude, -f * shift) for p, f in zip(pairs, freqs, strict=True)]
        # Recency: the fastest frame pair still decreasing across the ring; cos peaks at 0,
        # so no frame, however old, outscores the most recent ones.
        reach = config.window_frames + config.chunk_frames - 1
        pair = next(
            (p for p, f in zip(frame, frame_freqs, strict=True) if f * reach <= math.pi), frame[-1]
        )
        f = frame_freqs[pair]
        k = config.chunk_frames
        terms.append((pair, HISTORY_RECENCY / (math.cos(f) - math.cos(f * (1 + k))), 0.0))
        return terms
    # Detail: per axis the fastest pair that stays monotone across the grid, with a Gaussian
    # width (near its peak, a cos(f d) ~ a - a f^2 d^2 / 2), and the fastest frame pair.
    width = max(0.8, DETAIL_WIDTH * min(config.grid))
    for pairs, freqs, tokens, _ in axes:
        if tokens > 1:
            monotone = [
                (p, f) for p, f in zip(pairs, freqs, strict=True) if f * (tokens - 1) <= math.pi
            ]
            pair, f = monotone[0] if monotone else (pairs[-1], freqs[-1])
            terms.append((pair, 1.0 / (width * f) ** 2, 0.0))
    terms.append((frame[0], -math.log(DETAIL_FRAME_NEIGHBOUR) / (1.0 - math.cos(1.0)), 0.0))
    return terms


def _pair_vectors(
    config: ModelConfig, terms: list[tuple[int, float, float]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(query, key) of one head: each term (pair, amplitude >= 0, phase) adds
    ``amplitude * cos(theta * (pos_q - pos_k) + phase)`` to the attention logit."""
    q = torch.zeros(config.head_dim, dtype=torch.float64)
    k = torch.zeros(config.head_dim, dtype=torch.float64)
    scale = config.head_dim**0.25  # SDPA divides the dot product by sqrt(head_dim)
    for pair, amplitude, phase in terms:
        size = math.sqrt(amplitude) * scale
        q[2 * pair], q[2 * pair + 1] = size * math.cos(phase), size * math.sin(phase)
        k[2 * pair] = size
    return q, k


def _detail_concentration(config: ModelConfig) -> float:
    """The mean over the chunk's tokens of ``sum(w^2)`` for the detail head's weights ``w``.

    Its logit is a sum of one term per axis over a full grid of keys, so its weights are a
    product of one softmax per axis, and so is this mean.
    """
    frame, rows, columns = _rope_pairs(config)
    sizes = {0: config.chunk_frames, 1: config.grid[0], 2: config.grid[1]}
    logits = {axis: torch.zeros(n, n, dtype=torch.float64) for axis, n in sizes.items()}
    for pair, amplitude, phase in _kernel_terms(config, "detail", (0.0, 0.0)):
        axis, pairs = next((a, p) for a, p in enumerate((frame, rows, columns)) if pair in p)
        theta = _axis_freqs(len(pairs))[pairs.index(pair)]
        pos = torch.arange(sizes[axis], dtype=torch.float64)
        logits[axis] += amplitude * torch.cos(theta * (pos[:, None] - pos[None, :]) + phase)
    return math.prod(
        float(torch.softmax(x, dim=1).pow(2).sum(dim=1).mean()) for x in logits.values()
    )


def _queries_and_keys(
    params: dict[str, torch.Tensor],
    block: int,
    config: ModelConfig,
    layout: _Layout,
    draw: _Draws,
    kinds: tuple[str, ...],
) -> None:
    """Queries and keys of a block's heads 0, 1, ... of the given kinds (``_kernel_terms``).

    A query is ``-flag * target``: the target while denoising (flag -1). A key is a constant
    plus, in the flag pair, ``(flag, 0)``: +1 for cached frames, -1 for the chunk's own noisy
    tokens. For the heads that read the cache the mark turns the pair of the first chunk's
    frames (the sink) to ``(0, 1)``, which scores between the two. Queries and keys keep
    their size, so RMSNorm keeps them; its weight restores the size.
    """
    prefix = f"blocks.{block}.self_attn."
    hd = config.head_dim
    flag_dim = 2 * _flag_pair(config)
    flag = math.sqrt(FLAG_SCORE) * hd**0.25
    q_target = torch.zeros(config.dim, dtype=torch.float64)
    k_bias = torch.zeros(config.dim, dtype=torch.float64)
    k_flag = torch.zeros(config.dim, dtype=torch.float64)
    keys = params[prefix + "k.weight"]
    mark = layout.reader({layout.mark: flag / MARK}, layout.references[2])
    for head, kind in enumerate(kinds):
        q, k = _pair_vectors(config, _kernel_terms(config, kind, draw.drift))
        q[flag_dim] = -flag if kind == "detail" else flag
        q_target[head * hd : (head + 1) * hd] = q
        k_bias[head * hd : (head + 1) * hd] = k
        k_flag[head * hd + flag_dim] = flag
        if kind != "detail":
            keys[head * hd + flag_dim] -= mark
            keys[head * hd + flag_dim + 1] += mark
    params[prefix + "q.weight"][:, layout.flag] = -q_target
    params[prefix + "norm_q.weight"][:] = q_target.pow(2).mean().sqrt()
    keys[:, layout.flag] = k_flag
    params[prefix + "k.bias"][:] = k_bias
    params[prefix + "norm_k.weight"][:] = (k_bias.pow(2).mean() + k_flag.pow(2).mean()).sqrt()
    params[f"blocks.{block}.modulation"][0, 1, layout.flag] = -1.0  # the lane is its shift


def _history(
    params: dict[str, torch.Tensor], config: ModelConfig, layout: _Layout, draw: _Draws
) -> None:
    """Block 0's self-attention. Head 0 adds HISTORY * read(frames) to mu, and sets the mark's
    target: 1 when the head found no cached frame, else 0. Head 1 takes GLOBAL_PULL *
    (frame-wide mean of the frames) off it."""
    _queries_and_keys(params, 0, config, layout, draw, ("history", "global"))
    hd = config.head_dim
    value = params["blocks.0.self_attn.v.weight"]
    for i in range(VISIBLE_DIMS):
        pixels = {row[i]: 1.0 / layout.pixels for row in layout.signal}
        value[i] = value[hd + i] = layout.reader(pixels, layout.references[0])
    value[VISIBLE_DIMS, layout.flag] = 1.0  # the key flag: +1 if cached, -1 if noisy
    out, bias = params["blocks.0.self_attn.o.weight"], params["blocks.0.self_attn.o.bias"]
    for i, channel in enumerate(layout.mean):
        out[channel, i] = HISTORY
        out[channel, hd + i] = -GLOBAL_PULL
    out[layout.mark, VISIBLE_DIMS] = MARK / 2
    bias[layout.mark] = -MARK / 2
    params["blocks.0.modulation"][0, 2, layout.mean] = 1.0
    # The FFN passes the signal and the mark through (gate: 1 / sigma - 1): divides by sigma.
    w0, w2 = params["blocks.0.ffn.0.weight"], params["blocks.0.ffn.2.weight"]
    for unit, channel in enumerate([*layout.signal_flat, layout.mark]):
        read = layout.reader({channel: 1.0}, layout.references[1])
        w0[2 * unit], w0[2 * unit + 1] = read, -read
        w2[channel, 2 * unit], w2[channel, 2 * unit + 1] = 1.0, -1.0


def _prompt_colour(
    params: dict[str, torch.Tensor], config: ModelConfig, layout: _Layout, draw: _Draws
) -> None:
    """Block 0's cross-attention: head 0 averages the words' colours into mu and into the
    prompt channels; padding rows (zeros) get no weight."""
    r = VISIBLE_DIMS
    # text_embedding: hidden (+a, -a) pairs per colour and per presence direction; its output
    # holds the colour (gelu(a) - gelu(-a) == a) and, in channel r, a presence score
    # (gelu(a) + gelu(-a) > 0 for a word, 0 for padding).
    w0, w2 = params["text_embedding.0.weight"], params["text_embedding.2.weight"]
    for i in range(r):
        w0[2 * i], w0[2 * i + 1] = draw.prompt_map[i], -draw.prompt_map[i]
        w2[i, 2 * i], w2[i, 2 * i + 1] = 1.0, -1.0
    for j in range(draw.presence.shape[0]):
        unit = 2 * r + 2 * j
        w0[unit], w0[unit + 1] = draw.presence[j], -draw.presence[j]
        w2[r, unit], w2[r, unit + 1] = 1.0, 1.0
    prefix = "blocks.0.cross_attn."
    # Query and key live in dim 0; RMSNorm makes any word's key sqrt(dim) * weight.
    size = math.sqrt(PROMPT_SCORE) * config.head_dim**0.25
    params[prefix + "q.bias"][0] = 1.0
    params[prefix + "norm_q.weight"][:] = size / math.sqrt(config.dim)
    params[prefix + "k.weight"][0, r] = 1.0
    params[prefix + "norm_k.weight"][:] = size / math.sqrt(config.dim)
    out = params[prefix + "o.weight"]
    for i in range(r):
        params[prefix + "v.weight"][i, i] = 1.0
        out[layout.mean[i], i] = out[layout.prompt[i], i] = PROMPT_GAIN
    for block in (0, 1):
        params[f"blocks.{block}.norm3.weight"][:] = 1.0


def _prompt_history_detail_and_mean(
    params: dict[str, torch.Tensor], config: ModelConfig, layout: _Layout, draw: _Draws
) -> None:
    """Block 1. Head 0 subtracts ``kept * read(prompt colours of the cached frames)`` from
    mu (``kept = HISTORY - GLOBAL_PULL``). Head 1 smooths ``gain * x_t - (mu without that
    term)`` over the chunk's noisy tokens: at the last step ``gain * x_t = mu + gain * s *
    noise``, so it reads ``-kept * read(..) + noise``, and head 0's read, added back, leaves
    the noise: the detail. The FFN then subtracts mu from every pixel's signal."""
    _queries_and_keys(params, 1, config, layout, draw, ("history", "detail"))
    hd = config.head_dim
    signal_ref, steady, _ = layout.references
    modulation = params["blocks.1.modulation"]
    last = sigmas(config)[-1]
    # The signal is x_t / sigma here: the value gain times sigma reads x0 back.
    gain = _value_gain(last) * last
    kept = HISTORY - GLOBAL_PULL  # the prompt colours' share: they are the same everywhere
    modulation[0, 1, [*layout.signal_flat, signal_ref]] = gain  # on top of e's -1
    modulation[0, 2, layout.mean] = 1.0
    modulation[0, 5, layout.signal_flat] = 1.0  # gate 1 / sigma: subtracts mu / sigma
    value, out = params["blocks.1.self_attn.v.weight"], params["blocks.1.self_attn.o.weight"]
    for i in range(VISIBLE_DIMS):
        value[i] = layout.reader({layout.prompt[i]: 1.0}, steady)
        pixels = {row[i]: 1.0 / layout.pixels for row in layout.signal}
        value[hd + i] = layout.reader(pixels, signal_ref) - layout.reader(
            {layout.mean[i]: 1.0}, steady
        )
        out[layout.mean[i], i] = -kept  # gate 1
        for row in layout.signal:  # gate: minus the detail's gain / sigma
            out[row[i], hd + i] = 1.0
            out[row[i], i] = kept
    w0, w2 = params["blocks.1.ffn.0.weight"], params["blocks.1.ffn.2.weight"]
    for i, channel in enumerate(layout.mean):
        read = layout.reader({channel: 1.0}, steady)
        w0[2 * i], w0[2 * i + 1] = read, -read
        for pixel in layout.signal:
            w2[pixel[i], 2 * i], w2[pixel[i], 2 * i + 1] = -1.0, 1.0


# -- the embeddings and the head --------------------------------------------------------------


def _patch_embedding(params: dict[str, torch.Tensor], config: ModelConfig, layout: _Layout) -> None:
    basis = latent_basis(config.in_dim).double()  # [C, r + 1]
    weight = params["patch_embedding.weight"]  # [dim, C, pt, ph, pw]
    pw = config.patch[2]
    for q, channels in enumerate(layout.signal):
        dy, dx = divmod(q, pw)
        for i, channel in enumerate(channels):
            weight[channel, :, 0, dy, dx] = basis[:, i]
        weight[layout.mark, :, 0, dy, dx] = basis[:, VISIBLE_DIMS] * MARK / layout.pixels
    signs = torch.tensor([(-1.0) ** k for k in range(len(layout.constants))])
    params["patch_embedding.bias"][layout.constants] = STREAM_CONSTANT * signs


def _head(params: dict[str, torch.Tensor], config: ModelConfig, layout: _Layout) -> None:
    """flow = (x_t - x0) / sigma along the visible and mark directions, 0 across them: the
    signal and mark channels already hold it (block 0's FFN divided by sigma). The mark is one
    value per token: the latent pixels' own spread along it survives, and averages out."""
    basis = latent_basis(config.out_dim).double()
    steady = layout.references[1]
    weight = params["head.head.weight"]  # [pixels * out_dim, dim]
    for q, channels in enumerate(layout.signal):
        for c in range(config.out_dim):
            reads = {channel: float(basis[c, i]) for i, channel in enumerate(channels)}
            reads[layout.mark] = float(basis[c, VISIBLE_DIMS]) / MARK
            weight[q * config.out_dim + c] = layout.reader(reads, steady)
