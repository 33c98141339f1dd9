"""The fMP4 form of a chunk: each decodes on its own (PyAV), in the right frames and size, on
one timeline across chunks; the generation loop makes it for every chunk, once."""

from __future__ import annotations

import numpy as np
import pytest

from services.gpu_worker.fmp4 import (
    FragmentTooLarge,
    chunk_start_s,
    decode_fragment,
    encode_chunk,
    mime_of,
)
from shared.settings import DEFAULT_VIDEO_BITRATE
from shared.video import chunk_bytes_limit

from .test_generation import RecordingSink, _assign, _loop, _run


def _moving(count: int, height: int = 64, width: int = 96, shift: int = 0) -> np.ndarray:
    rng = np.random.default_rng(7)
    cells = rng.integers(0, 256, ((height + 64) // 8 + 1, (width + 64) // 8 + 1, 3), dtype=np.uint8)
    texture = np.repeat(np.repeat(cells, 8, 0), 8, 1)  # 8-pixel blocks: 4:2:0 keeps their colour
    return np.stack(
        [texture[i + shift : i + shift + height, 2 * i : 2 * i + width] for i in range(count)]
    )


@pytest.mark.parametrize("count", [9, 12])
def test_a_fragment_decodes_alone_into_its_frames_at_its_time(count):
    fps = count / 0.75  # a chunk lasts one period whatever its frame count
    fragment = encode_chunk(_moving(count), fps, chunk_start_s(4, 0.75))
    frames, times = decode_fragment(fragment.data)
    assert frames.shape == (count, 64, 96, 3)
    assert times[0] == pytest.approx(3.0, abs=1e-4) and times[-1] < 3.75
    assert np.diff(times) == pytest.approx([1 / fps] * (count - 1), abs=1e-4)
    assert fragment.start_s == 3.0 and fragment.duration_s == pytest.approx(0.75)
    assert fragment.mime.startswith('video/mp4; codecs="avc1.') and fragment.mime == mime_of(
        fragment.data
    )
    assert (
        fragment.data[4:8] == b"ftyp" and b"moof" in fragment.data and b"mfra" not in fragment.data
    )
    # lossy, but the picture is the one given (mean error a few levels on a busy texture)
    assert np.abs(frames.astype(int) - _moving(count).astype(int)).mean() < 12


def test_odd_sides_are_padded_to_even_and_bad_frames_are_refused():
    frames, _ = decode_fragment(encode_chunk(_moving(3, 33, 45), 16.0, 0.0).data)
    assert frames.shape == (3, 34, 46, 3)
    with pytest.raises(ValueError, match="uint8"):
        encode_chunk(np.zeros((2, 8, 8, 3), np.float32), 16.0, 0.0)
    with pytest.raises(ValueError, match="fps"):
        encode_chunk(_moving(2), 0.0, 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("bitrate", [DEFAULT_VIDEO_BITRATE, 500_000])
def test_every_chunk_of_uniform_noise_at_480x832_is_within_its_bound(bitrate):
    """The worst picture for an encoder, at the model's size: every chunk within the bound the
    bitrate sets, however many encodes it takes."""
    rng = np.random.default_rng(11)
    fps = 16.0
    for seq in range(3):
        frames = rng.integers(0, 256, (12, 480, 832, 3), dtype=np.uint8)
        fragment = encode_chunk(frames, fps, chunk_start_s(seq, 0.75), bitrate=bitrate)
        assert len(fragment.data) <= fragment.limit_bytes == chunk_bytes_limit(bitrate, 0.75)
        assert decode_fragment(fragment.data)[0].shape == (12, 480, 832, 3)


@pytest.mark.slow
def test_a_chunk_over_its_bound_is_encoded_again_coarser_until_it_fits():
    """The retry: at 2.5 Mbit/s x264's first try of this noise is over the bound (one thread:
    the same bytes every time); a coarser quantiser floor brings every chunk within it."""
    rng = np.random.default_rng(11)
    encodes = []
    for seq in range(3):
        frames = rng.integers(0, 256, (12, 480, 832, 3), dtype=np.uint8)
        fragment = encode_chunk(frames, 16.0, chunk_start_s(seq, 0.75), bitrate=2_500_000)
        assert len(fragment.data) <= fragment.limit_bytes
        encodes.append(fragment.encodes)
    assert max(encodes) > 1, encodes


def test_a_chunk_over_its_bound_at_the_coarsest_quantiser_is_held_to_fewer_pictures():
    """The last resort: at 0.9 Mbit/s this noise at 480x832 fits at no quantiser (x264 runs on
    one thread: the same bytes every time), so the chunk keeps its frames but shows fewer
    pictures, and fits."""
    frames = np.random.default_rng(11).integers(0, 256, (12, 480, 832, 3), dtype=np.uint8)
    fragment = encode_chunk(frames, 16.0, 0.0, bitrate=900_000)
    assert fragment.hold > 1 and len(fragment.data) <= fragment.limit_bytes
    decoded, times = decode_fragment(fragment.data)
    assert decoded.shape == (12, 480, 832, 3) and len(times) == 12
    # frame 1 repeats frame 0 (both lossy copies of frames[0]), frame 0 is not frames[1]
    assert np.abs(decoded[1].astype(int) - decoded[0].astype(int)).mean() < 3


def test_a_chunk_over_its_bound_at_the_coarsest_quantiser_is_refused():
    frames = np.random.default_rng(5).integers(0, 256, (4, 480, 832, 3), dtype=np.uint8)
    with pytest.raises(FragmentTooLarge) as raised:
        encode_chunk(frames, 16.0, 0.0, bitrate=1_000)
    assert raised.value.size > raised.value.limit == chunk_bytes_limit(1_000, 4 / 16.0)


def test_a_smooth_chunk_takes_one_encode_far_under_its_bound():
    y, x = np.mgrid[0:480, 0:832]
    frames = np.stack(
        [
            np.stack([(x + 4 * i) % 256, (y + 2 * i) % 256, (x + y) // 5 % 256], -1)
            for i in range(12)
        ]
    ).astype(np.uint8)
    fragment = encode_chunk(frames, 16.0, 0.0)
    assert fragment.encodes == 1 and len(fragment.data) < fragment.limit_bytes / 2


def test_the_generation_loop_sends_every_chunk_as_a_fragment_on_one_timeline():
    loop = _loop(period_s=0.05)
    sink = RecordingSink(loop)
    loop.inbox.put(_assign("s", 1))
    _run(loop, lambda: len(sink.chunks("s")) >= 3)
    chunks = sink.chunks("s")[:3]
    for chunk in chunks:
        frames, times = decode_fragment(chunk.fmp4)  # each alone: a viewer may join at any chunk
        assert frames.shape[1:] == (
            chunk.height + chunk.height % 2,
            chunk.width + chunk.width % 2,
            3,
        )
        assert times[0] == pytest.approx(chunk.start_s, abs=1e-4)
        assert chunk.duration_s == pytest.approx(len(frames) / chunk.fps)
        assert chunk.encode_ms > 0 and chunk.fmp4_mime.startswith("video/mp4")
    for before, after in zip(chunks, chunks[1:], strict=False):
        assert after.start_s == pytest.approx(before.start_s + before.duration_s)
    # the worker's measured chunk time holds the encoding
    assert (
        max(loop.chunk_times.snapshot().values())
        >= min(c.gen_ms + c.encode_ms for c in chunks) * 0.5
    )


def test_a_session_moved_to_a_new_worker_goes_on_along_the_same_timeline():
    loop = _loop(period_s=0.05)
    sink = RecordingSink(loop)
    loop.inbox.put(_assign("s", 2, seq=5))  # migrated or recovered: generation from seq 5
    _run(loop, lambda: len(sink.chunks("s")) >= 1)
    first = sink.chunks("s")[0]
    assert first.seq == 5 and first.start_s == pytest.approx(5 * first.duration_s)
    assert decode_fragment(first.fmp4)[1][0] == pytest.approx(first.start_s, abs=1e-4)
