from __future__ import annotations

import argparse
import json

import pytest

from services.gpu_worker.telemetry import describe, device_report
from tools.bench.worker import _fill_table, build_profile, register


def test_fill_table_interpolates_and_is_monotone():
    assert _fill_table({1: 10.0, 4: 40.0}) == [10.0, 20.0, 30.0, 40.0]
    assert _fill_table({1: 10.0, 2: 9.0}) == [10.0, 10.0]
    assert _fill_table({2: 12.0, 3: 15.0}) == [12.0, 12.0, 15.0]


def test_bench_worker_writes_results_and_a_profile(tmp_path, capsys):
    out, profile_path = tmp_path / "bench.json", tmp_path / "profile.json"
    # Only this module's parser: other services' CLIs are not under test here.
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="target", required=True))
    args = parser.parse_args(
        [
            "worker",
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--batch",
            "1,2",
            "--chunks",
            "1",
            "--warmup",
            "0",
            "--json",
            str(out),
            "--profile-out",
            str(profile_path),
        ]
    )
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert report["preset"] == "tiny" and report["device"] == "cpu"
    assert [row["batch"] for row in report["results"]] == [1, 2]
    for row in report["results"]:
        assert row["chunk_ms_p50"] > 0
        assert abs(row["sessions_per_s"] - row["batch"] * 1000 / row["chunk_ms_p50"]) < 1e-2
        assert 0 < row["pass_ms_min"] <= row["pass_ms_p50"] <= row["pass_ms_max"]
        assert row["pass_chunk_ms_p50"] > 0
    assert report["passes_per_chunk"] == 5
    assert report["state_bytes"] > 0 and report["suspend_ms"] >= 0 and report["resume_ms"] >= 0
    profile = json.loads(profile_path.read_text())
    assert len(profile["chunk_ms"]) == 2
    assert profile["state_bytes_per_session"] == report["state_bytes"]
    assert "batch" in capsys.readouterr().out


def test_profile_loads_in_the_scheduler_when_present(tmp_path):
    report = {
        "preset": "tiny",
        "device": "cpu",
        "state_bytes": 1000,
        "suspend_ms": 0.5,
        "resume_ms": 0.5,
        "video_frames_per_chunk": 12,
        "weights_bytes": 10,
        "results": [{"batch": 1, "chunk_ms_p50": 20.0}, {"batch": 4, "chunk_ms_p50": 50.0}],
        "telemetry": {"name": "cpu", "mem_total_bytes": 10**9},
    }
    profile = build_profile(report)
    assert profile["chunk_ms"] == [20.0, 30.0, 40.0, 50.0]
    assert profile["deadline_ms"] == 750.0
    try:
        from shared.profile import load_profile
    except ImportError:
        return
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile))
    loaded = load_profile(path)
    assert loaded.chunk_ms(3) == 40.0 and loaded.capacity == 4


def test_cpu_telemetry_says_so():
    import torch

    report = device_report(torch.device("cpu"))
    assert report["mode"] == "cpu" and report["util_percent"] is None
    assert "no GPU" in describe(torch.device("cpu"))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--preset", "nope"], "unknown preset 'nope'"),
        (["--chunks", "0"], "--chunks must be >= 1"),
        (["--warmup", "-1"], "--warmup must be >= 0"),
        (["--batch", "0"], "--batch needs batch sizes >= 1"),
        (["--batch", "x"], "--batch must be comma-separated integers"),
        (["--batch", ","], "--batch needs batch sizes >= 1"),
        (["--checkpoint", "/nonexistent/ckpt.safetensors"], "not found"),
        (["--device", "tpu"], "--device must be auto, cpu, cuda or cuda:N"),
    ],
)
def test_bench_worker_refuses_bad_options_in_one_line(extra, message, capsys):
    from tools.cli import main

    code = main(
        [
            "bench",
            "worker",
            "--device",
            "cpu",
            "--chunks",
            "1",
            "--warmup",
            "0",
            "--batch",
            "1",
            *extra,
        ]
    )
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.startswith("turboserve bench worker: ") and message in captured.err
    assert "Traceback" not in captured.err and "chunk ms" not in captured.out


def test_bench_worker_without_a_gpu_says_so(monkeypatch, capsys):
    import torch

    from tools.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "worker", "--device", "cuda", "--batch", "1", "--chunks", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("turboserve bench worker: ") and "no CUDA GPU" in err


def test_bench_worker_refuses_a_file_that_is_not_a_checkpoint(tmp_path, capsys):
    from tools.cli import main

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    code = main(
        [
            "bench",
            "worker",
            "--device",
            "cpu",
            "--batch",
            "1",
            "--chunks",
            "1",
            "--checkpoint",
            str(bad),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("turboserve bench worker: ") and "bad.safetensors" in err
