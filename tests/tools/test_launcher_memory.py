"""``turboserve up`` refuses a CPU pool that cannot fit in this host's memory, before it
starts anything."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services.gpu_worker.engine.memory import cpu_pool_shortfall, host_available_bytes
from shared.settings import WorkerSettings
from tools.launcher import _cpu_pool_shortfall, _cpu_workers_that_fit, has_gpu


def test_the_pool_is_sized_against_available_memory():
    small = WorkerSettings.from_env({"TURBOSERVE_MAX_SESSIONS": "2"})
    assert cpu_pool_shortfall(1, small, "") == ""
    huge = WorkerSettings.from_env(
        {"TURBOSERVE_MAX_SESSIONS": "100000", "TURBOSERVE_RESOLUTION": "480x832"}
    )
    text = cpu_pool_shortfall(3, huge, "")
    assert "3 CPU worker(s) of 100000 session(s) of tiny at 480x832 need" in text
    assert "available" in text and "--workers" in text
    # A bound on decodes per pass is counted: far less is needed per worker.
    bounded = WorkerSettings.from_env(
        {"TURBOSERVE_MAX_SESSIONS": "8", "TURBOSERVE_MAX_DECODES_PER_PASS": "1"}
    )
    assert cpu_pool_shortfall(1, bounded, "") == ""
    assert cpu_pool_shortfall(0, huge, "") == ""  # a pool that starts empty
    assert host_available_bytes() > 0


@pytest.mark.parametrize("sessions", ["2", "12", "24", "48", "400"])
def test_the_ceiling_up_lowers_to_is_the_most_workers_that_fit(sessions):
    keys = {
        "TURBOSERVE_MAX_SESSIONS": sessions,
        "TURBOSERVE_RESOLUTION": "480x832",
        "TURBOSERVE_EMULATE": "",
    }
    if _cpu_pool_shortfall(1, keys):
        return  # not even one fits: up refuses before it asks for a ceiling
    by_count = max(n for n in range(1, 9) if not _cpu_pool_shortfall(n, keys))
    assert _cpu_workers_that_fit(1, 8, keys) == by_count


@pytest.mark.slow
def test_up_refuses_a_cpu_pool_that_cannot_fit(tmp_path):
    if has_gpu():
        return  # the preflight is for CPU pools
    env = {
        **os.environ,
        "TURBOSERVE_STATE_DIR": str(tmp_path),
        "TURBOSERVE_MAX_SESSIONS": "100000",
        "TURBOSERVE_RESOLUTION": "480x832",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "tools.cli", "up", "--workers", "2", "--emulate", "none"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "turboserve up: 2 CPU worker(s) of 100000 session(s)" in proc.stderr
