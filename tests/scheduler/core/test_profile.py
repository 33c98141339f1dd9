from __future__ import annotations

import json

import pytest

from shared.profile import (
    ProfileError,
    available_profiles,
    load_profile,
    profile_from_dict,
    save_profile,
)


def _raw(**changes):
    raw = load_profile("h20-longlive-1.3b-nvlink").to_dict()
    raw.update(changes)
    return raw


def test_default_profile_matches_the_papers_figures():
    p = load_profile()
    assert p.capacity == 12 and p.capacity_reason == "deadline"
    # 917-1201 ms per chunk at the paper's loads; 23-30 ms per migration on NVLink.
    assert p.chunk_ms(8) == pytest.approx(917.0) and p.chunk_ms(12) == pytest.approx(1201.0)
    assert 23.0 <= p.migration_ms() <= 30.0
    assert p.chunk_ms(p.capacity) <= p.deadline_ms < p.chunk_ms(p.capacity + 1)
    assert p.sources["chunk_ms"] and p.sources["migration"]


def test_pcie_variant_differs_only_in_migration():
    nv, pcie = load_profile("h20-longlive-1.3b-nvlink"), load_profile("h20-longlive-1.3b-pcie")
    assert {"h20-longlive-1.3b-nvlink", "h20-longlive-1.3b-pcie"} <= set(available_profiles())
    assert pcie.migration_ms() > 4 * nv.migration_ms()
    assert pcie.chunk_ms_table == nv.chunk_ms_table and pcie.capacity == nv.capacity


def test_latency_and_migration_model():
    p = load_profile()
    assert p.chunk_ms(0) == 0.0
    assert [p.chunk_ms(b) for b in range(1, 20)] == sorted(p.chunk_ms(b) for b in range(1, 20))
    last = len(p.chunk_ms_table)
    assert p.chunk_ms(last + 2) - p.chunk_ms(last) == pytest.approx(
        2 * (p.chunk_ms_table[-1] - p.chunk_ms_table[-2])
    )
    assert p.migration_ms(0) == pytest.approx(p.migration_fixed_ms)
    assert p.migration_ms(2 * p.state_bytes_per_session) == pytest.approx(
        2 * p.migration_ms() - p.migration_fixed_ms
    )


def test_memory_can_bind_capacity():
    raw = _raw(memory={"gpu_bytes": 10 * 3_549_036_544, "reserved_bytes": 3 * 3_549_036_544})
    p = profile_from_dict(raw)
    assert p.capacity == 7 and p.capacity_reason == "memory"


def test_round_trip_through_a_file(tmp_path):
    p = load_profile()
    path = tmp_path / "measured.json"
    save_profile(p, path)
    assert load_profile(path) == p
    assert load_profile(str(path)).sources == p.sources


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"chunk_ms": []}, "'chunk_ms' must be a non-empty list"),
        ({"chunk_ms": [400, 300]}, "non-decreasing"),
        ({"chunk_ms": [400, "x"]}, r"chunk_ms\[1\]' must be a finite number"),
        ({"chunk_ms": [2000, 2100]}, "no batch meets the deadline"),
        ({"deadline_ms": -1}, "'deadline_ms' must be > 0"),
        ({"deadline_ms": True}, "'deadline_ms' must be a finite number"),
        ({"memory": {"gpu_bytes": 10, "reserved_bytes": 0}}, "not one session's state"),
        ({"migration": {"per_session_ms": 5, "fixed_ms": 9}}, "exceeds"),
        ({"migration": {"fixed_ms": 1}}, "missing field 'migration.per_session_ms'"),
        ({"migration": 3}, "'migration' must be an object"),
        ({"name": ""}, "'name' must be a non-empty string"),
        ({"sources": {"x": 1}}, "'sources' must map"),
    ],
)
def test_bad_profiles_give_clear_errors(change, message):
    with pytest.raises(ProfileError, match=message) as info:
        profile_from_dict(_raw(**change), source="bad.json")
    assert str(info.value).startswith("profile bad.json: ")


def test_missing_field_and_bad_files(tmp_path):
    raw = _raw()
    del raw["state_bytes_per_session"]
    with pytest.raises(ProfileError, match="missing field 'state_bytes_per_session'"):
        profile_from_dict(raw)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ProfileError, match="broken.json: not valid JSON"):
        load_profile(broken)
    with pytest.raises(ProfileError, match="no such profile .*shipped: h20-"):
        load_profile("no-such-gpu")
    with pytest.raises(ProfileError, match="no such file"):
        load_profile(tmp_path / "absent.json")
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps([1, 2]))
    with pytest.raises(ProfileError, match="top level must be a JSON object"):
        load_profile(listed)


def test_passes_per_chunk_defaults_to_one_and_is_validated():
    raw = _raw()
    assert raw["passes_per_chunk"] == 5  # shipped: 4 denoising passes + 1 cache write
    p = profile_from_dict(raw)
    assert p.passes_per_chunk == 5 and p.pass_ms(12) == pytest.approx(p.chunk_ms(12) / 5)
    del raw["passes_per_chunk"]
    legacy = profile_from_dict(raw)
    assert legacy.passes_per_chunk == 1 and legacy.pass_ms(12) == legacy.chunk_ms(12)
    assert "passes_per_chunk" not in legacy.to_dict()
    for bad in (0, -1, 2.5, True, "5"):
        with pytest.raises(ProfileError, match="passes_per_chunk"):
            profile_from_dict(_raw(passes_per_chunk=bad))


def test_a_table_fitted_with_another_profile_is_found_by_its_name():
    from services.scheduler.shipped import DEFAULT_TABLE_PATH, table_path_for

    assert table_path_for(None) == DEFAULT_TABLE_PATH
    assert table_path_for("h20-longlive-1.3b-nvlink") == DEFAULT_TABLE_PATH
    assert table_path_for("h200-wan-1.3b-measured").name == (
        "rho_table_h200-wan-1.3b-measured.json"
    )
    assert table_path_for("no-such-profile") == DEFAULT_TABLE_PATH


def test_a_prompt_switch_is_part_of_the_deadline_and_round_trips():
    base = profile_from_dict(_raw())
    p = profile_from_dict(_raw(prompt_switch_ms=200.0))
    assert p.prompt_switch_ms == 200.0 and p.capacity < base.capacity
    assert p.chunk_ms(p.capacity) + 200.0 <= p.deadline_ms < p.chunk_ms(p.capacity + 1) + 200.0
    assert profile_from_dict(p.to_dict()) == p
    assert "prompt_switch_ms" not in base.to_dict()  # absent means 0, as before
    with pytest.raises(ProfileError, match="prompt_switch_ms"):
        profile_from_dict(_raw(prompt_switch_ms=-1.0))
