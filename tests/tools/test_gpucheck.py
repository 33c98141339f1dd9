"""``turboserve gpu-check``: its CPU dry run (every step, every key), and a step that breaks or
outruns its limit fails the check."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest

from tools.gpucheck import STEP_NAMES, markdown, options_of

ROOT = Path(__file__).resolve().parents[2]
# What each step's entry must carry besides name, ok, seconds (its figures).
FIGURES = {
    "bench": {"batches", "memory_after_init_bytes", "memory_peak_bytes", "k_at_period"},
    "vae": {"decodes", "state_bytes", "encodes", "encoder_state_bytes"},
    "sdpa": {"unmasked_ms", "flash_ms", "masked_ms", "q_tokens", "k_tokens"},
    "umt5": {"pass_ms_alone", "pass_ms_umt5_default_stream", "pass_ms_umt5_own_stream"},
    "handoff": {"transport", "results", "session_mib", "nccl"},
    "up": {"on_time_share", "first_chunk_s", "sessions"},
    "encode": {"jpeg_ms", "x264_ms", "resolution"},
    "profile": {"profile", "capacity", "chunk_ms"},
}


def check(out: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--device", "cpu", "--out", str(out)]
        + list(args),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


@pytest.mark.slow
def test_the_dry_run_runs_every_step_and_writes_every_key(tmp_path):
    proc = check(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["device"] == "cpu" and report["preset"] == "tiny"
    assert [s["name"] for s in report["steps"]] == list(STEP_NAMES)
    for step in report["steps"]:
        assert step["ok"] is True and step["seconds"] > 0, step
        assert FIGURES[step["name"]] <= set(step), (step["name"], sorted(step))
    bench = next(s for s in report["steps"] if s["name"] == "bench")
    assert [row["batch"] for row in bench["batches"]] == [1, 2]
    assert bench["decoder"] == "wan-vae" and bench["text_encoder"] == "umt5"
    assert all(row["pass_ms"] > 0 and row["decode_ms"] > 0 for row in bench["batches"])
    handoff = next(s for s in report["steps"] if s["name"] == "handoff")
    assert handoff["transport"] == "gloo" and len(handoff["results"]) == 3
    table = (tmp_path / "gpu-check.md").read_text()
    assert all(f"| {name} | yes |" in table for name in STEP_NAMES)
    assert list(tmp_path.glob("profile-*.json"))  # the profile the scheduler loaded


def test_a_step_that_breaks_fails_the_check(tmp_path):
    # The profile is made from the bench step's figures: alone, it has none and breaks.
    proc = check(tmp_path, "--only", "profile")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (step,) = json.loads((tmp_path / "gpu-check.json").read_text())["steps"]
    assert step["name"] == "profile" and step["ok"] is False
    assert "bench step" in step["error"]
    assert "| profile | **no** |" in (tmp_path / "gpu-check.md").read_text()


def test_a_step_past_its_limit_fails_the_check(tmp_path):
    proc = check(tmp_path, "--only", "sdpa", "--limit-scale", "0.001")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (step,) = json.loads((tmp_path / "gpu-check.json").read_text())["steps"]
    assert step["ok"] is False and "timed out after its limit" in step["error"]


def test_the_options_on_a_gpu_and_in_the_dry_run():
    def of(*argv: str):
        parser = argparse.ArgumentParser()
        from tools import gpucheck

        sub = parser.add_subparsers()
        gpucheck.register(sub)
        return options_of(parser.parse_args(["gpu-check", *argv]))

    gpu = of("--out", "x")
    assert (gpu.device, gpu.preset, gpu.resolution) == ("cuda", "wan-1.3b", (480, 832))
    assert gpu.batches == [1, 2, 4, 8] and gpu.sessions == 4 and gpu.up_window_s == 60.0
    assert gpu.handoff_mib == [64.0, 1024.0]
    dry = of("--device", "cpu", "--out", "x")
    assert (dry.preset, dry.resolution, dry.batches) == ("tiny", None, [1, 2])
    with pytest.raises(ValueError, match="--resolution"):
        of("--resolution", "65x64", "--out", "x")


def test_the_table_has_a_row_per_step():
    report = {
        "device": "cuda",
        "preset": "wan-1.3b",
        "date": "today",
        "seconds": 1.0,
        "steps": [
            {"name": "sdpa", "ok": True, "seconds": 0.5, "what": "-", "masked_ms": 2.0},
            {"name": "handoff", "ok": True, "seconds": 0.1, "what": "-", "skipped": "no GPU"},
            {"name": "up", "ok": False, "seconds": 0.2, "what": "-", "error": "a | b"},
        ],
    }
    rows = markdown(report).splitlines()
    assert "| sdpa | yes | 0.5 | masked_ms: 2.0 |" in rows
    assert "| handoff | skipped | 0.1 | skipped: no GPU |" in rows
    assert "| up | **no** | 0.2 | error: a / b |" in rows


def test_the_steps_limits_keep_the_check_under_eight_minutes_on_a_gpu():
    from tools.gpucheck import STEPS

    assert sum(step.limit_cuda_s for step in STEPS) < 8 * 60
    assert [step.name for step in STEPS] == list(FIGURES)  # in order of value
