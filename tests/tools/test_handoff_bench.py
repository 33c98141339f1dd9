"""``turboserve bench migration`` end to end, small: two worker processes, real NATS/Redis."""

from __future__ import annotations

import json

import pytest

from tools.cli import main

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_bench_migration_writes_the_documented_json(infra, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TURBOSERVE_NATS_URL", infra.nats_url)
    monkeypatch.setenv("TURBOSERVE_REDIS_URL", infra.redis_url)
    out = tmp_path / "migration.json"
    assert (
        main(["bench", "migration", "--sizes", "0.25,2", "--repeats", "2", "--json", str(out)]) == 0
    )
    report = json.loads(out.read_text())
    assert [r["state_bytes"] for r in report["results"]] == [256 * 1024, 2 << 20]
    for row in report["results"]:
        for key in ("handoff_ms_p50", "transfer_gbps", "raw_copy_gbps", "fixed_ms_p50"):
            assert row[key] > 0, key
        assert row["handoffs"] == 2 and row["transport"] == "gloo"
    assert report["first_use_ms"] > 0 and len(report["first_use_ms_each"]) == 2
    assert "handoff ms" in capsys.readouterr().out
