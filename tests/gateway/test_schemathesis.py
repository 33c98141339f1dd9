"""schemathesis against /openapi.json of the gateway in-process on the real NATS and Redis: no
5xx, and answers that match the document (status codes, content types, bodies, headers).

Two checks are left out on purpose: ``use_after_free`` (a closed session stays readable, as
``terminated``, until the registry lets it expire) and ``positive_data_acceptance`` (a plain GET
of the WebSocket route is valid by the schema, yet it is no upgrade: 400 is the answer).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from tests.gateway.conftest import API_KEY, run_gateway

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ST = Path(sys.executable).parent / "st"


@pytest.mark.skipif(not ST.exists(), reason="schemathesis is not installed (pip install '.[test]')")
async def test_schemathesis_finds_no_server_error(gw_env, nats_client, redis_client, tmp_path):
    # No worker runs here: /readyz's 503 without one (documented) would read as a server error.
    settings = {
        "control_wait_s": 0.2,
        "rate_per_key_s": 10_000.0,
        "rate_burst": 10_000,
        "max_sessions_per_key": 100_000,
        "ready_without_workers": True,
    }
    async with run_gateway(gw_env, **settings) as g:
        proc = await asyncio.create_subprocess_exec(
            str(ST),
            "run",
            f"{g.url}/openapi.json",
            "--checks",
            "all",
            "--exclude-checks",
            "use_after_free,positive_data_acceptance",
            "--max-examples",
            "15",
            "--seed",
            "21",
            "--request-timeout",
            "5",
            "--header",
            f"Authorization: Bearer {API_KEY}",
            "--no-color",
            "--report-dir",
            str(tmp_path),
            "--generation-database",
            "none",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            cwd=tmp_path,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=240)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-6000:]
    assert "passed" in text and "Selected: 16/16" in text
