"""``turboserve bench worker --steps``: chunk time per denoising step count (the quality
budget), in the table, the JSON and the profile."""

from __future__ import annotations

import json

import pytest

from tools.bench.worker import _parse_steps, _steps_table_ms, build_profile
from tools.cli import main
from tools.report import BenchUsageError

FAST = ["bench", "worker", "--device", "cpu", "--chunks", "1", "--warmup", "0", "--batch", "1"]


def test_steps_are_parsed_highest_first_and_checked():
    assert _parse_steps(None) is None
    assert _parse_steps("2,4,3,4") == [4, 3, 2]
    for bad, message in (
        ("x", "--steps must be comma-separated integers"),
        (",", "--steps needs step counts >= 1"),
        ("3,0", "--steps needs step counts >= 1"),
    ):
        with pytest.raises(BenchUsageError, match=message):
            _parse_steps(bad)


@pytest.mark.parametrize(
    ("steps", "message"),
    [("4,x", "--steps must be comma-separated integers"), ("5,3", "--steps 5: above the model")],
)
def test_bench_worker_refuses_bad_steps_in_one_line(steps, message, capsys):
    assert main([*FAST, "--steps", steps]) == 2
    err = capsys.readouterr().err
    assert err.startswith("turboserve bench worker: ") and message in err
    assert "Traceback" not in err


def test_bench_worker_times_each_step_count_and_writes_the_profiles_steps(tmp_path, capsys):
    out, profile_path = tmp_path / "bench.json", tmp_path / "profile.json"
    code = main(
        [*FAST, "--batch", "1,2", "--steps", "2,4,3", "--json", str(out)]
        + ["--profile-out", str(profile_path), "--deadline-ms", "600000"]  # any machine's speed
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "| batch | 4 steps ms | 3 steps ms (x full) | 2 steps ms (x full) |" in printed
    report = json.loads(out.read_text())
    assert report["full_steps"] == 4 and report["steps"] == [4, 3, 2]
    for row in report["results"]:
        assert set(row["steps_chunk_ms_p50"]) == {"4", "3", "2"}
        assert all(ms > 0 for ms in row["steps_chunk_ms_p50"].values())
        assert set(row["steps_ratio"]) == {"3", "2"}
    profile = json.loads(profile_path.read_text())
    assert profile["passes_per_chunk"] == 5 and profile["steps"]["full"] == 4
    assert sorted(profile["steps"]["chunk_ms"]) == ["2", "3"]
    assert all(len(t) == 2 for t in profile["steps"]["chunk_ms"].values())

    from shared.profile import load_profile

    loaded = load_profile(profile_path)  # the scheduler's loader takes it
    assert loaded.full_steps == 4 and loaded.pass_ms(1) == loaded.chunk_ms(1) / 5
    assert loaded.chunk_ms_at(2, 3) == profile["steps"]["chunk_ms"]["3"][1]


def test_the_profiles_steps_table_scales_chunk_ms_by_the_measured_ratio():
    """The ratio comes from chunks timed in turn; applied to chunk_ms, the table agrees with
    it, never above it (a ratio over 1 is noise), and non-decreasing in batch like it."""
    report = {
        "results": [
            {"batch": 1, "chunk_ms_p50": 40.0, "steps_ratio": {"3": 0.8, "2": 1.05}},
            {"batch": 3, "chunk_ms_p50": 100.0, "steps_ratio": {"3": 0.3, "2": 0.6}},
        ]
    }
    assert _steps_table_ms(report, 3) == [32.0, 32.0, 32.0]
    assert _steps_table_ms(report, 2) == [40.0, 50.0, 60.0]


def test_without_steps_the_report_and_profile_are_as_before():
    report = {
        "preset": "tiny",
        "device": "cpu",
        "state_bytes": 1000,
        "suspend_ms": 0.5,
        "resume_ms": 0.5,
        "video_frames_per_chunk": 12,
        "weights_bytes": 10,
        "results": [{"batch": 1, "chunk_ms_p50": 20.0}],
        "telemetry": {"name": "cpu"},
        "full_steps": 4,
        "steps": [4],
    }
    assert "steps" not in build_profile(report)
