"""`turboserve bench gateway` runs end to end at a small size and refuses bad options in one
line (its figures are for the table it prints, not for asserts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def bench(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tools.cli", "bench", "gateway", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )


@pytest.mark.parametrize(
    "args",
    [
        ["--clients", "0"],
        ["--sessions", "9", "--clients", "3"],
        ["--size", "big"],
        ["--period", "0"],
        ["--frames", "100"],
    ],
)
def test_bad_options_are_one_line_errors(args):
    proc = bench(*args)
    assert proc.returncode == 2
    assert proc.stderr.startswith("turboserve bench gateway: ") and proc.stderr.count("\n") == 1


def test_small_run_prints_a_table_and_writes_json(infra, tmp_path):
    env = {
        **os.environ,
        "TURBOSERVE_NATS_URL": infra.nats_url,
        "TURBOSERVE_REDIS_URL": infra.redis_url,
    }
    out = tmp_path / "gw.json"
    proc = bench(
        "--clients",
        "6",
        "--sessions",
        "3",
        "--seconds",
        "2",
        "--warmup",
        "0.5",
        "--period",
        "0.25",
        "--json",
        str(out),
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "| clients | sessions | events | p50 ms | p99 ms |" in proc.stdout
    result = json.loads(out.read_text())
    assert result["clients"] == 6 and result["sessions"] == 3
    assert 0 <= result["delivery_ms_p50"] <= result["delivery_ms_p99"] <= result["delivery_ms_max"]
    assert result["events"] > 0 and result["lags"] == 0
