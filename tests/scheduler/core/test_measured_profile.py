"""profile_from_measurements: measured chunk times per batch + a fallback -> a profile."""

from __future__ import annotations

import math

import pytest

from shared.profile import (
    ProfileError,
    load_profile,
    profile_from_dict,
    profile_from_measurements,
)

H20 = load_profile()  # 349 + 71 b ms, deadline 1250 ms, K = 12
# wan-1.3b on one H200 (README, "The worker"): batching gains almost nothing.
H200 = {1: 472.4, 2: 902.5, 4: 1797.9, 8: 3514.7}


def test_nothing_measured_is_the_fallback():
    assert profile_from_measurements({}, H20) is H20


def test_measured_batches_interpolated_and_extrapolated():
    p = profile_from_measurements(H200, H20)
    table = p.chunk_ms_table
    assert len(table) == len(H20.chunk_ms_table) == 16
    for batch, ms in H200.items():
        assert table[batch - 1] == ms
    assert table[2] == pytest.approx((902.5 + 1797.9) / 2)  # batch 3, between 2 and 4
    assert table[5] == pytest.approx(1797.9 + (3514.7 - 1797.9) * 2 / 4)  # batch 6
    slope = (3514.7 - 1797.9) / 4
    assert table[15] == pytest.approx(3514.7 + 8 * slope)  # batch 16, on the last slope
    assert p.capacity == 2  # 903 ms meets the 1.25 s deadline, 1350 ms does not
    assert (p.deadline_ms, p.passes_per_chunk, p.migration_per_session_ms) == (
        H20.deadline_ms,
        H20.passes_per_chunk,
        H20.migration_per_session_ms,
    )
    assert p.name == "h20-longlive-1.3b-nvlink+measured" and "measured" in p.sources["chunk_ms"]
    # A valid profile in every respect: it survives the loader's checks.
    assert profile_from_dict(p.to_dict()).chunk_ms_table == table


def test_one_measurement_scales_the_fallback_curve():
    p = profile_from_measurements({1: 2 * H20.chunk_ms(1)}, H20, name="slow")
    assert p.name == "slow"
    assert [p.chunk_ms(b) for b in (1, 2, 12)] == pytest.approx(
        [2 * H20.chunk_ms(b) for b in (1, 2, 12)]
    )
    below = profile_from_measurements({4: 2 * H20.chunk_ms(4)}, H20)
    assert below.chunk_ms(1) == pytest.approx(2 * H20.chunk_ms(1))  # below: scaled too


def test_noise_never_makes_a_bigger_batch_faster():
    p = profile_from_measurements({1: 500.0, 2: 480.0, 3: 700.0}, H20)
    assert list(p.chunk_ms_table[:3]) == [500.0, 500.0, 700.0]
    assert all(a <= b for a, b in zip(p.chunk_ms_table, p.chunk_ms_table[1:], strict=False))


def test_a_larger_measured_batch_extends_the_table():
    p = profile_from_measurements({1: 100.0, 20: 1200.0}, H20)
    assert len(p.chunk_ms_table) == 20 and p.chunk_ms(20) == 1200.0


@pytest.mark.parametrize(
    "measured, needle",
    [
        ({0: 100.0}, "integers >= 1"),
        ({1.5: 100.0}, "integers >= 1"),
        ({1: -1.0}, "finite number > 0"),
        ({1: math.nan}, "finite number > 0"),
        ({1: True}, "finite number > 0"),
        ({1: 5000.0}, "no batch meets the deadline"),
    ],
)
def test_bad_measurements_are_refused(measured, needle):
    with pytest.raises(ProfileError, match=needle):
        profile_from_measurements(measured, H20)


# A CPU worker emulating an H20 under six steady sessions: its passes are paced to the shipped
# times (pass = chunk / 5) at every batch it runs, but it timed whole chunks only at batches 1
# and 2 (the ramp-up; afterwards its sessions are out of phase, so no chunk runs every pass at
# one batch). The chunks carry about 120 ms of encoding on top of their passes.
EMULATED_PASSES = {b: H20.chunk_ms(b) / H20.passes_per_chunk for b in range(1, 7)}


@pytest.mark.parametrize("batch_2_ms", [621.0, 640.0, 660.0])
def test_pass_times_fill_the_batches_no_whole_chunk_was_timed_at(batch_2_ms):
    """Two neighbouring chunk times alone extrapolate their noise: 531 / 621-660 ms made K 8
    down to 6 (six steady sessions then asked for a second GPU, and gave it back later). With
    the pass times of batches 3-6, K stays where the emulated chunk times put it."""
    chunks = {1: 531.0, 2: batch_2_ms}
    assert profile_from_measurements(chunks, H20).capacity <= 8
    p = profile_from_measurements(chunks, H20, pass_ms=EMULATED_PASSES)
    # The median of the two batches' chunk - 5 x pass (the median of two is their mean).
    overhead = ((531.0 - H20.chunk_ms(1)) + (batch_2_ms - H20.chunk_ms(2))) / 2
    assert p.chunk_ms(1) == 531.0 and p.chunk_ms(2) == batch_2_ms  # chunk times stay measured
    for batch in (3, 6):
        assert p.chunk_ms(batch) == pytest.approx(H20.chunk_ms(batch) + overhead)
    assert p.capacity == 10  # 775 + ~130 ms at batch 6, on the passes' slope of 71 ms


def test_pass_times_alone_are_not_chunk_times():
    """Without a batch timed both ways the overhead is unknown: pass times are not used."""
    chunks = {1: 600.0}
    assert profile_from_measurements(chunks, H20, pass_ms={3: 112.4}) == (
        profile_from_measurements(chunks, H20)
    )
    with pytest.raises(ProfileError, match="finite number > 0"):
        profile_from_measurements(chunks, H20, pass_ms={2: -1.0})


def test_a_stalled_pass_is_not_the_cost_of_its_batch():
    """A worker that replaced a killed one timed its first pass at batch 5 at 553 ms (batch 6:
    155 ms): as measured, K was 3 (the loop asked for two GPUs and gave them back seconds
    later). A bigger batch is never faster: batch 5's pass is left out, and the chunk times
    run from batch 1 to batch 6 on the shipped slope."""
    passes = {1: 84.0, 5: 552.5, 6: 155.0}
    p = profile_from_measurements({1: 428.7}, H20, pass_ms=passes)
    overhead = 428.7 - H20.chunk_ms(1)
    for batch in (5, 6, 12):
        assert p.chunk_ms(batch) == pytest.approx(H20.chunk_ms(batch) + overhead)
    assert p.capacity == 12
