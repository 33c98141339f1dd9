"""The quality budget in the latency profile: ``full_steps``, ``chunk_ms_at``, ``max_batch_at``
and the optional ``steps`` key (derived for the shipped profiles, measured when written)."""

from __future__ import annotations

import pytest

from shared.profile import (
    ProfileError,
    load_profile,
    profile_from_dict,
    profile_from_measurements,
    save_profile,
)


def _raw(**changes: object) -> dict[str, object]:
    raw = load_profile("h20-longlive-1.3b-nvlink").to_dict()
    raw.update(changes)
    return raw


def test_shipped_profiles_derive_fewer_steps_from_their_passes():
    p = load_profile("h20-longlive-1.3b-nvlink")
    assert "steps" not in p.to_dict()  # nothing to ship: derived
    assert p.full_steps == 4
    # 5 passes at full steps, 4 at 3 steps, 3 at 2: each pass costs the same.
    assert p.chunk_ms_at(12, 4) == p.chunk_ms(12) == pytest.approx(1201.0)
    assert p.chunk_ms_at(12, 3) == pytest.approx(1201.0 * 4 / 5)
    assert p.chunk_ms_at(12, 2) == pytest.approx(1201.0 * 3 / 5)
    assert p.pass_ms(12) == pytest.approx(1201.0 / 5)
    # At full steps max_batch_at is K; fewer steps hold more, up to the table's 16 batches
    # (3 steps: 279.2 + 56.8 b ms meets 1250 ms up to b = 17; the table stops at 16).
    assert p.max_batch_at(4) == p.capacity == 12
    assert p.max_batch_at(3) == 16 and p.max_batch_at(2) == 16
    measured = load_profile("h200-wan-1.3b-measured")
    assert [measured.max_batch_at(s) for s in (4, 3, 2, 1)] == [2, 3, 4, 7]


def test_full_steps_without_a_steps_key():
    one_pass = profile_from_dict(_raw(passes_per_chunk=1))
    assert one_pass.full_steps == 1 and one_pass.max_batch_at(1) == one_pass.capacity
    assert profile_from_dict(_raw(passes_per_chunk=3)).full_steps == 2


def test_a_measured_table_is_used_for_its_step_count_and_round_trips(tmp_path):
    table3 = [300.0 + 50.0 * b for b in range(1, 19)]  # meets 1250 ms up to batch 19: 18 here
    p = profile_from_dict(_raw(steps={"full": 4, "chunk_ms": {"3": table3}}))
    assert p.full_steps == 4
    assert p.chunk_ms_at(5, 3) == pytest.approx(550.0)
    assert p.chunk_ms_at(20, 3) == pytest.approx(1300.0)  # last slope, as chunk_ms does
    assert p.chunk_ms_at(5, 2) == pytest.approx(p.chunk_ms(5) * 3 / 5)  # not measured: derived
    assert p.max_batch_at(3) == 18  # bounded by the table it covers, below memory's 20
    path = tmp_path / "p.json"
    save_profile(p, path)
    again = load_profile(path)
    assert again == p and again.to_dict()["steps"] == {"full": 4, "chunk_ms": {"3": table3}}
    # Measured chunk times at full steps keep the steps tables.
    assert profile_from_measurements({1: 430.0}, p).steps_chunk_ms == p.steps_chunk_ms


def test_memory_bounds_max_batch_at_fewer_steps():
    state = 3_549_036_544
    p = profile_from_dict(_raw(memory={"gpu_bytes": 14 * state, "reserved_bytes": 0}))
    assert p.capacity == 12 and p.max_batch_at(2) == 14


def test_a_prompt_switch_counts_at_every_step_count():
    p = profile_from_dict(_raw(prompt_switch_ms=100.0))
    # 3 steps: (349 + 71 b) * 4/5 + 100 <= 1250 up to b = 15.
    assert p.max_batch_at(3) == 15


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ("four", "'steps' must be an object"),
        ({"full": 0}, "'steps.full' must be an integer >= 1"),
        ({"full": 3}, "steps.full (3) disagrees with passes_per_chunk (5)"),
        ({"chunk_ms": []}, "'steps.chunk_ms' must be an object"),
        ({"chunk_ms": {"4": [400.0]}}, "keys must be step counts 1..3"),
        ({"chunk_ms": {"x": [400.0]}}, "got 'x'"),
        ({"chunk_ms": {"3": [400.0], "03": [400.0]}}, "each once, got '03'"),
        ({"chunk_ms": {"3": []}}, "'steps.chunk_ms.3' must be a non-empty list"),
        ({"chunk_ms": {"3": [400.0, -1.0]}}, "steps.chunk_ms.3[1] must be > 0"),
        ({"chunk_ms": {"2": [500.0, 400.0]}}, "steps.chunk_ms.2 must be non-decreasing"),
    ],
)
def test_a_bad_steps_key_is_a_clear_error(steps, message):
    with pytest.raises(ProfileError, match="profile <dict>: ") as err:
        profile_from_dict(_raw(steps=steps))
    assert message in str(err.value)


def test_a_step_count_outside_the_model_is_refused():
    p = load_profile()
    for bad in (0, 5):
        with pytest.raises(ValueError, match=r"steps must be in 1\.\.4"):
            p.chunk_ms_at(1, bad)
        with pytest.raises(ValueError, match=r"steps must be in 1\.\.4"):
            p.max_batch_at(bad)
