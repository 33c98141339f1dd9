"""`turboserve bench stream` runs end to end at a small size (both kinds of frames, the three
HTTP formats and WebRTC through a real gateway on the real NATS and Redis, WebRTC to loopback
aiortc viewers) and refuses bad options in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def bench(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tools.cli", "bench", "stream", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.mark.parametrize(
    "args",
    [
        ["--viewers", "0"],
        ["--sessions", "9", "--viewers", "3"],
        ["--size", "big"],
        ["--kinds", "noise"],
        ["--period", "0"],
        ["--webrtc-viewers", "0"],
    ],
)
def test_bad_options_are_one_line_errors(args):
    proc = bench(*args)
    assert proc.returncode == 2
    assert proc.stderr.startswith("turboserve bench stream: ") and proc.stderr.count("\n") == 1


def test_small_run_writes_each_format_for_each_kind_of_frames(infra, tmp_path):
    env = {
        **os.environ,
        "TURBOSERVE_NATS_URL": infra.nats_url,
        "TURBOSERVE_REDIS_URL": infra.redis_url,
    }
    out = tmp_path / "stream.json"
    proc = bench(
        "--viewers",
        "4",
        "--sessions",
        "2",
        "--seconds",
        "1.5",
        "--warmup",
        "0.5",
        "--size",
        "64x96",
        "--chunks",
        "2",
        "--encode-runs",
        "3",
        "--webrtc-viewers",
        "3",
        "--json",
        str(out),
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "delivery p99" in proc.stdout and "webrtc" in proc.stdout
    assert "3 for webrtc" in proc.stdout
    result = json.loads(out.read_text())
    assert set(result["frames"]) == {"standin", "gradient", "textured"}
    assert result["webrtc_viewers"] == 3 and "3 loopback aiortc viewers" in result["webrtc"]
    for side in result["frames"].values():
        rtc = side["webrtc"]
        assert rtc is not None, "the webrtc entry is missing"
        assert rtc["bytes_per_s"] > 0 and 0 < rtc["encode_ms_p50"] <= rtc["encode_ms_p99"]
        assert rtc["delivery_ms_p99"] is not None and rtc["delivery_ms_p99"] >= 0
        assert rtc["viewers"] == 3 and rtc["lags"] == 0 and rtc["frames_decoded"] > 0
        assert rtc["chunks_received"] >= 3  # each viewer's first frame of at least one chunk
        for fmt in ("jpeg_sse", "fmp4_sse", "fmp4_ws"):
            r = side[fmt]
            assert r["bytes_per_s"] > 0 and 0 < r["encode_ms_p50"] <= r["encode_ms_p99"]
            assert r["delivery_ms_p99"] is not None and r["delivery_ms_p99"] >= 0
            assert r["viewers"] == 4 and r["lags"] == 0
        # what a session puts on NATS: its fragments alone, the same whatever its viewers take
        assert 0 < side["nats_bytes_per_s"] < side["jpeg_sse"]["bytes_per_s"]
