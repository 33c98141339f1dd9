"""A small causal convolutional decoder from latents to RGB frames.

It has the Wan VAE's strides (4x in time, 8x8 in space) but few channels and random weights:
it gives the decode step a real, streaming shape, not real pictures. It is causal in time: a
chunk's first latent frame sees the two latent frames before it, which the session keeps in
its state (``context_frames``), so decoding chunk by chunk equals decoding the whole stream.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import VAE_STRIDE, ModelConfig


class LatentDecoder(nn.Module):
    context_frames = 2  # temporal kernel 3, causal

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        width = config.decoder_channels
        self.time_stride = VAE_STRIDE[0]
        self.width = width
        self.conv_in = nn.Conv3d(
            config.out_dim, width * self.time_stride,
            kernel_size=(self.context_frames + 1, 3, 3), padding=(0, 1, 1),
        )
        channels = [width, max(width // 2, 8), max(width // 4, 8), max(width // 4, 8)]
        self.ups = nn.ModuleList(
            nn.Conv2d(channels[i], channels[i + 1], kernel_size=3, padding=1)
            for i in range(3)  # 2x per stage: 8x in all
        )
        self.conv_out = nn.Conv2d(channels[-1], 3, kernel_size=3, padding=1)
        self.act = nn.SiLU()

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        for module in self.modules():
            if isinstance(module, nn.Conv2d | nn.Conv3d):
                nn.init.kaiming_uniform_(module.weight, a=1.0, generator=generator)
                nn.init.zeros_(module.bias)

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
        x = x.permute(0, 3, 1, 2, 4, 5).reshape(batch * frames * self.time_stride, self.width, height, width)
        for conv in self.ups:
            x = conv(nn.functional.interpolate(self.act(x), scale_factor=2.0, mode="nearest"))
        rgb = torch.tanh(self.conv_out(self.act(x)).float())
        pixels = ((rgb + 1.0) * 127.5).round_().clamp_(0, 255).to(torch.uint8)
        return pixels.view(batch, frames * self.time_stride, 3, *pixels.shape[-2:]).permute(
            0, 1, 3, 4, 2
        )


def build_decoder(
    config: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> LatentDecoder:
    device = torch.device(device)
    with torch.device(device):
        decoder = LatentDecoder(config)
    decoder.init_weights(torch.Generator(device=device).manual_seed(seed + 1))
    return decoder.to(dtype).eval().requires_grad_(False)
