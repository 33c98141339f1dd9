"""What `turboserve ctl status` prints, as a table and as JSON."""

from __future__ import annotations

import orjson

from tools.ctl import format_status, status_json

STATUS = {
    "workers": [
        {
            "id": "w-1",
            "status": "ready",
            "alive": True,
            "kind": "H20",
            "emulated": True,
            "capacity": 12,
            "waiting": 0,
            "steps": 3,
            "full_steps": 4,
            "chunk_ms": {1: 420.0, 2: 491.0, 10: 1059.0},
            "sessions": [{"id": "s1", "state": "executing", "last_seq": 6, "epoch": 1}],
        }
    ],
    "pending": [],
    "scheduler": {
        "leader": "sched-a",
        "rho_hat": 0.7,
        "updated_at": 1796068113.73,
        "profiles": {
            "H20": {
                "name": "h20-longlive-1.3b-nvlink",
                "chunk_ms": [420.0],
                "sources": {"chunk_ms": "a long paragraph"},
            }
        },
    },
}


def test_json_keeps_the_chunk_times_by_batch():
    printed = orjson.loads(status_json(STATUS))
    assert printed["workers"][0]["chunk_ms"] == {"1": 420.0, "2": 491.0, "10": 1059.0}
    assert printed["scheduler"]["profiles"]["H20"]["sources"]  # --json has everything


def test_table_orders_batches_and_names_profiles_without_printing_them():
    text = format_status(STATUS)
    assert "1:420 2:491 10:1059" in text
    assert "  3/4     0 1:420" in text  # 3 of its 4 denoising steps, no chunk unpublished
    assert "s1" in text and "seq 6" in text
    assert "profiles=(H20: h20-longlive-1.3b-nvlink)" in text
    assert "a long paragraph" not in text and "rho_hat=0.7" in text
