from __future__ import annotations

import numpy as np
import pytest
import torch

from services.gpu_worker.codec import decode_frame, encode_frames


def _gradient_frames(t=3, h=32, w=48):
    y, x = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    frames = torch.stack([(x * 5 + i * 20) % 256 for i in range(t)])  # [T, H, W]
    return torch.stack([frames, (y * 7).expand_as(frames), frames.flip(-1)], dim=-1).to(torch.uint8)


def test_png_and_raw_are_lossless():
    frames = _gradient_frames()
    for fmt in ("png", "raw"):
        encoded = encode_frames(frames, fmt=fmt)
        assert len(encoded) == 3
        for i, data in enumerate(encoded):
            assert np.array_equal(decode_frame(data, fmt, shape=(32, 48)), frames[i].numpy())


def test_jpeg_is_close_and_quality_matters():
    frames = _gradient_frames()
    low = encode_frames(frames, fmt="jpeg", quality=20)
    high = encode_frames(frames, fmt="jpeg", quality=90)
    assert all(d[:2] == b"\xff\xd8" for d in high)  # JPEG start-of-image marker
    error = np.abs(decode_frame(high[0]).astype(int) - frames[0].numpy().astype(int)).mean()
    assert error < 8
    assert sum(map(len, low)) < sum(map(len, high))


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="uint8"):
        encode_frames(torch.zeros(1, 4, 4, 3))
    with pytest.raises(ValueError, match="format"):
        encode_frames(_gradient_frames(), fmt="gif")
