"""A video session's input frames at the worker: decoded and fitted to the model's frame, held
in a bounded, ordered buffer, and fed from the session's NATS subject (a real NATS)."""

from __future__ import annotations

import asyncio
import io
import threading

import numpy as np
import pytest
from PIL import Image

from services.gpu_worker.input_feed import InputFeed
from services.gpu_worker.input_frames import FrameRefused, InputBuffer, decode_frame
from shared.wire import InputFrame, SessionInput, Subjects, encode
from tests.gpu_worker.conftest import make_engine


def jpeg(width: int, height: int, colour=(200, 40, 90), quality: int = 90) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, format="JPEG", quality=quality)
    return out.getvalue()


def test_a_frame_is_scaled_to_cover_and_cropped_at_the_centre():
    # A 640x480 camera frame, left half red and right half blue, into 480x832.
    picture = np.zeros((480, 640, 3), dtype=np.uint8)
    picture[:, :320] = (255, 0, 0)
    picture[:, 320:] = (0, 0, 255)
    png = io.BytesIO()
    Image.fromarray(picture).save(png, format="PNG")
    out = decode_frame(png.getvalue(), 480, 832)
    assert out.shape == (480, 832, 3) and out.dtype == np.uint8
    # Scaled by 832/640 = 1.3 to 624 rows, 72 cut from the top and the bottom: no stretch,
    # so the halves still meet in the middle.
    assert tuple(out[240, 100]) == (255, 0, 0) and tuple(out[240, 730]) == (0, 0, 255)
    assert out[240, 410, 0] > 200 and out[240, 422, 2] > 200
    # The model's own size passes through untouched.
    assert np.array_equal(decode_frame(png.getvalue(), 480, 640), picture)


def test_what_is_not_an_image_or_is_too_large_is_refused_with_its_code():
    with pytest.raises(FrameRefused) as refused:
        decode_frame(b"\xff\xd8 not really a jpeg", 64, 64)
    assert refused.value.code == "not_an_image"
    with pytest.raises(FrameRefused) as refused:
        decode_frame(jpeg(4200, 4100, quality=10), 64, 64)
    assert refused.value.code == "frame_too_large"
    # A frame of the model's size decodes to its colour (JPEG's rounding aside).
    assert np.abs(decode_frame(jpeg(64, 48), 48, 64).astype(int) - (200, 40, 90)).max() < 6


def test_the_buffer_keeps_order_drops_the_oldest_and_refuses_the_stale():
    buffer = InputBuffer(capacity=4)
    frame = np.zeros((2, 2, 3), dtype=np.uint8)
    for seq in range(6):
        assert buffer.put(seq, frame + seq, float(seq))
    assert buffer.dropped == 2 and len(buffer) == 4  # 0 and 1 went
    assert not buffer.put(3, frame, 3.0) and buffer.stale == 1  # overtaken
    assert buffer.take(5) is None and len(buffer) == 4  # not enough: nothing taken
    chunk = buffer.take(3)
    assert chunk is not None
    assert (chunk.first_seq, chunk.last_seq, chunk.captured_at) == (2, 4, 4.0)
    assert [int(f[0, 0, 0]) for f in chunk.frames] == [2, 3, 4]
    buffer.clear()
    assert not buffer.ready(1) and not buffer.put(5, frame, 5.0)  # the order carries on
    with pytest.raises(ValueError):
        InputBuffer(capacity=0)


def test_the_buffer_takes_puts_from_another_thread_in_order():
    buffer = InputBuffer(capacity=1000)
    frame = np.zeros((1, 1, 3), dtype=np.uint8)

    def put() -> None:
        for seq in range(2000):
            buffer.put(seq, frame, 0.0)

    thread = threading.Thread(target=put)
    thread.start()
    seen: list[int] = []
    while thread.is_alive() or buffer.ready(1):
        chunk = buffer.take(1)
        if chunk is not None:
            seen.append(chunk.last_seq)
    thread.join()
    assert seen == sorted(seen) and len(set(seen)) == len(seen)
    assert len(seen) + buffer.dropped == 2000


@pytest.mark.integration
async def test_the_feed_subscribes_per_video_session_and_fills_its_buffer(nats_client, isolation):
    engine = make_engine()
    config = engine.model_config
    engine.add_session("v", "a woodcut", 1, input=SessionInput.VIDEO)
    engine.add_session("t", "a fox", 2)
    subjects = Subjects(isolation["TURBOSERVE_SUBJECT_PREFIX"])
    outcomes: list[str] = []
    woken = asyncio.Event()
    feed = InputFeed(
        nats_client,
        subjects,
        engine.video_sessions,
        engine.input_buffer,
        (config.height, config.width),
        woken.set,
        outcomes.append,
    )
    await feed.reconcile()
    assert feed.subscribed == ["v"]  # the text session has no input subject

    def frame(seq: int, image: bytes) -> bytes:
        return encode(
            InputFrame(session_id="v", seq=seq, captured_at=1.0, received_at=2.0, image=image)
        )

    subject = subjects.session_input("v")
    await nats_client.publish(subject, frame(0, jpeg(640, 480)))
    await nats_client.publish(subject, b"not a message")
    await nats_client.publish(subject, frame(1, b"not an image"))
    await nats_client.publish(subject, frame(0, jpeg(640, 480)))  # a duplicate
    green = InputFrame(
        session_id="v",
        seq=2,
        captured_at=1.0,
        received_at=2.0,
        image=jpeg(320, 240, colour=(10, 200, 10)),
        dropped=2,  # the gateway dropped two frames before this one
    )
    await nats_client.publish(subject, encode(green))
    # Addressed to another session on this one's subject: dropped, not put in either.
    wrong = InputFrame(session_id="w", seq=3, captured_at=1.0, received_at=2.0, image=jpeg(8, 8))
    await nats_client.publish(subject, encode(wrong))
    await nats_client.flush()
    for _ in range(100):
        if len(outcomes) == 8:
            break
        await asyncio.sleep(0.05)
    expected = ["put", "malformed", "refused", "stale", "put", "malformed"]
    assert sorted(outcomes) == sorted([*expected, "dropped_at_gateway", "dropped_at_gateway"])
    assert woken.is_set()
    buffer = engine.input_buffer("v")
    assert buffer is not None
    chunk = buffer.take(2)
    assert chunk is not None and (chunk.first_seq, chunk.last_seq) == (0, 2)
    assert chunk.frames[1].shape == (config.height, config.width, 3)
    red, green, blue = chunk.frames[1][config.height // 2, config.width // 2]
    assert green > 180 and red < 40 and blue < 40  # the green frame, as sent
    # The session leaves: its subscription goes with it.
    engine.remove_session("v")
    await feed.reconcile()
    assert feed.subscribed == []
    await feed.close()
