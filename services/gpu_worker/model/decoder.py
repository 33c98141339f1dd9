"""A small causal convolutional decoder from latents to RGB frames.

It has the Wan VAE's strides (4x in time, 8x8 in space) but few channels, and it is not
trained: it gives the decode step a real, streaming shape. It is causal in time: a chunk's
first latent frame sees the two latent frames before it, which the session keeps in its state
(``context_frames``), so decoding chunk by chunk equals decoding the whole stream.

Its initialisation is a fixed colour mapping, not random weights (``init_weights``): the
latent's visible subspace (``visible.visible_basis``, 3 directions; the others are not shown)
is interpolated in time between latent frames, smoothed and upsampled (nearest 2x then a
[1, 2, 1] blur per stage: a bilinear upsampling), mixed into RGB by a seeded palette around
mid-grey and squashed by tanh. Every stage is linear: the SiLU before a convolution passes a
signal carried in a (+s, -s) channel pair, since ``silu(s) - silu(-s) == s``. The convolutions
pad with zeros, so the picture fades to mid-grey over its outer ~10 pixels (a third of the
signal is left at the edge pixel, 90% nine pixels in).
"""

from __future__ import annotations

import torch
from torch import nn

from .config import VAE_STRIDE, ModelConfig
from .visible import VISIBLE_DIMS, visible_basis

CONTRAST = 1.4  # tanh gain on the palette's output: colours stay saturated, rarely clipped
_BLUR = (0.25, 0.5, 0.25)


class LatentDecoder(nn.Module):
    """The stand-in decoder. As a ``load.FrameDecoder`` its per-session state is the causal
    context: the last two latent frames."""

    kind = "colour-map"
    context_frames = 2  # temporal kernel 3, causal

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.context_shape = (
            config.out_dim,
            self.context_frames,
            config.latent_height,
            config.latent_width,
        )
        width = config.decoder_channels
        self.time_stride = VAE_STRIDE[0]
        self.width = width
        self.conv_in = nn.Conv3d(
            config.out_dim,
            width * self.time_stride,
            kernel_size=(self.context_frames + 1, 3, 3),
            padding=(0, 1, 1),
        )
        channels = [width, max(width // 2, 8), max(width // 4, 8), max(width // 4, 8)]
        self.narrowest = min(channels)
        self.ups = nn.ModuleList(
            nn.Conv2d(channels[i], channels[i + 1], kernel_size=3, padding=1)
            for i in range(3)  # 2x per stage: 8x in all
        )
        self.conv_out = nn.Conv2d(channels[-1], 3, kernel_size=3, padding=1)
        self.act = nn.SiLU()

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """The fixed colour mapping (module docstring), with a palette drawn from
        ``generator``; seeded random weights where the widths cannot carry 3 signed signals."""
        convs = [m for m in self.modules() if isinstance(m, nn.Conv2d | nn.Conv3d)]
        for conv in convs:
            assert conv.bias is not None
            nn.init.zeros_(conv.bias)
            if self.narrowest < 2 * VISIBLE_DIMS:
                nn.init.kaiming_uniform_(conv.weight, a=1.0, generator=generator)
            else:
                nn.init.zeros_(conv.weight)
        if self.narrowest < 2 * VISIBLE_DIMS:
            return
        r = VISIBLE_DIMS
        blur = torch.tensor(_BLUR, dtype=torch.float64)
        blur2d = blur[:, None] * blur[None, :]
        basis = visible_basis(self.conv_in.in_channels).double()  # [C, r]
        # conv_in: sub-frame tau of latent frame t interpolates frames t - 1 and t (the
        # kernel's taps 1 and 2), so the picture changes smoothly between latent frames.
        weight = torch.zeros(self.conv_in.weight.shape, dtype=torch.float64)
        for tau in range(self.time_stride):
            late = (tau + 1) / self.time_stride
            taps = torch.tensor([0.0, 1.0 - late, late], dtype=torch.float64)
            for i in range(r):
                kernel = basis[:, i, None, None, None] * taps[:, None, None] * blur2d
                weight[tau * self.width + 2 * i] = kernel
                weight[tau * self.width + 2 * i + 1] = -kernel
        self.conv_in.weight.copy_(weight)
        for conv in convs[1:-1]:  # the ups: (+s, -s) pairs in, blurred (+s, -s) pairs out
            weight = torch.zeros(conv.weight.shape, dtype=torch.float64)
            for i in range(r):
                weight[2 * i, 2 * i], weight[2 * i, 2 * i + 1] = blur2d, -blur2d
                weight[2 * i + 1, 2 * i], weight[2 * i + 1, 2 * i + 1] = -blur2d, blur2d
            conv.weight.copy_(weight)
        # The palette: a seeded rotation of the visible directions into RGB around mid-grey.
        seed = torch.randint(0, 2**62, (1,), generator=generator, device=generator.device)
        cpu = torch.Generator().manual_seed(int(seed))
        palette = torch.linalg.qr(torch.randn(3, r, generator=cpu, dtype=torch.float64)).Q
        weight = torch.zeros(self.conv_out.weight.shape, dtype=torch.float64)
        for i in range(r):
            weight[:, 2 * i, 1, 1] = CONTRAST * palette[:, i]
            weight[:, 2 * i + 1, 1, 1] = -CONTRAST * palette[:, i]
        self.conv_out.weight.copy_(weight)

    @property
    def state_numel(self) -> int:
        return int(torch.Size(self.context_shape).numel())

    def decode(self, latents: torch.Tensor, state: torch.Tensor, fresh: bool) -> torch.Tensor:
        """``forward`` with the context kept in ``state`` rows ``[B, state_numel]`` (zeros
        before a stream's first chunk, so ``fresh`` changes nothing)."""
        frames: torch.Tensor = self(latents, state.view(state.shape[0], *self.context_shape))
        return frames

    def rebuild(self, latents: torch.Tensor, state: torch.Tensor) -> None:
        """The context after ``latents`` ``[1, C, F, h, w]``: exactly their last two frames."""
        context = state.view(1, *self.context_shape)
        context.zero_()
        tail = latents[:, :, -self.context_frames :]
        context[:, :, self.context_frames - tail.shape[2] :] = tail.to(context.dtype)

    def forward(self, latents: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """Frames ``[B, 4F, H, W, 3]`` uint8 from latents ``[B, C, F, h, w]``.

        ``context`` ``[B, C, 2, h, w]`` holds the previous two latent frames (zeros before the
        first chunk) and is updated in place to this chunk's last two.
        """
        dtype = self.conv_in.weight.dtype
        full = torch.cat([context.to(dtype), latents.to(dtype)], dim=2)
        context.copy_(full[:, :, -self.context_frames :])
        x = self.conv_in(full)  # [B, 4W, F, h, w]
        batch, _, frames, height, width = x.shape
        # Pixel shuffle in time: 4 video frames per latent frame.
        x = x.view(batch, self.time_stride, self.width, frames, height, width)
        x = x.permute(0, 3, 1, 2, 4, 5).reshape(
            batch * frames * self.time_stride, self.width, height, width
        )
        for conv in self.ups:
            x = conv(nn.functional.interpolate(self.act(x), scale_factor=2.0, mode="nearest"))
        rgb = torch.tanh(self.conv_out(self.act(x)).float())
        pixels = ((rgb + 1.0) * 127.5).round_().clamp_(0, 255).to(torch.uint8)
        return pixels.view(batch, frames * self.time_stride, 3, *pixels.shape[-2:]).permute(
            0, 1, 3, 4, 2
        )


def build_decoder(
    config: ModelConfig,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> LatentDecoder:
    device = torch.device(device)
    with torch.device(device):
        decoder = LatentDecoder(config)
    decoder.init_weights(torch.Generator(device=device).manual_seed(seed + 1))
    return decoder.to(dtype).eval().requires_grad_(False)


class ColourEncoder:
    """The stand-in's frame encoder (a ``load.FrameEncoder``): the colour map run backwards.

    Each pixel's RGB is un-squashed (atanh) and rotated back through the decoder's palette
    into the latent's visible directions; 4 video frames average into one latent frame and
    8x8 pixels into one latent pixel (the VAE's strides). It is stateless (``state_numel`` 0)
    and, like the stand-in decoder, maps 4 frames to each latent frame in every chunk, the
    first included. Decoding what it encodes gives back a blurred, time-averaged input."""

    kind = "colour-map"
    state_numel = 0

    def __init__(self, decoder: LatentDecoder, config: ModelConfig) -> None:
        self.time_stride, self.space_stride = VAE_STRIDE[0], VAE_STRIDE[1]
        self.chunk_frames = config.chunk_frames
        weight = decoder.conv_out.weight.detach().float()
        mix = weight[:, 0 : 2 * VISIBLE_DIMS : 2, 1, 1]  # [3, r]: the palette, with its gain
        basis = visible_basis(config.out_dim).to(weight.device)  # [C, r]
        # RGB (un-squashed) -> latent: the mix's pseudo-inverse, then the visible basis.
        self.unmix = basis.float() @ torch.linalg.pinv(mix)  # [C, 3]

    def input_frames(self, fresh: bool) -> int:
        return self.time_stride * self.chunk_frames

    @torch.no_grad()
    def encode(self, frames: torch.Tensor, state: torch.Tensor, fresh: bool) -> torch.Tensor:
        """Latents ``[B, C, F, h, w]`` float32 from frames ``[B, 4F, H, W, 3]`` uint8."""
        batch, count, height, width, _ = frames.shape
        rgb = (frames.float() / 127.5 - 1.0).clamp_(-0.999, 0.999)
        signal = torch.atanh(rgb).to(self.unmix.device)  # [B, T, H, W, 3]
        latent = signal @ self.unmix.T  # [B, T, H, W, C]
        latent = latent.permute(0, 4, 1, 2, 3)  # [B, C, T, H, W]
        pooled = nn.functional.avg_pool3d(
            latent, kernel_size=(self.time_stride, self.space_stride, self.space_stride)
        )
        return pooled.contiguous()
