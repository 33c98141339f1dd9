"""``turboserve bench migration``: its options, its summary of the reports, the raw copy."""

from __future__ import annotations

import pytest

from shared.wire import MigrationReport
from tools.bench.migration import (
    MIB,
    _options,
    _summarise,
    print_table,
    raw_copy_gbps,
)
from tools.cli import build_parser
from tools.report import BenchUsageError


def options(*argv):
    return _options(build_parser().parse_args(["bench", "migration", *argv]))


def test_defaults():
    got = options()
    assert got["sizes_mib"] == [1.0, 64.0, 256.0] and got["devices"] == ["cpu", "cpu"]
    assert got["transport"] == "auto" and got["checksum"]  # as the worker runs
    assert not options("--no-checksum")["checksum"]


@pytest.mark.parametrize(
    ("argv", "fault"),
    [
        (["--sizes", "0"], "sizes > 0"),
        (["--sizes", "1,x"], "MiB numbers"),
        (["--sizes", ","], "sizes > 0"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--layers", "0"], "--layers must be >= 1"),
        (["--transport", "rdma"], "--transport must be"),
        (["--devices", "cpu"], "two devices"),
        (["--device", "tpu"], "cpu or cuda"),
    ],
)
def test_bad_options_are_one_line_errors(argv, fault):
    with pytest.raises(BenchUsageError, match=fault):
        options(*argv)


def test_cuda_without_a_gpu_is_refused():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(BenchUsageError, match="no CUDA GPU"):
        options("--device", "cuda")


def report(total, offer, transfer, commit, nbytes=64 * MIB):
    return MigrationReport(
        session_id="s",
        src="a",
        dst="b",
        ok=True,
        nbytes=nbytes,
        transport="gloo",
        total_ms=total,
        offer_ms=offer,
        transfer_ms=transfer,
        commit_ms=commit,
    )


def test_summary_and_bars():
    done = [report(40, 1, 32, 1), report(30, 1, 16, 2), report(50, 2, 64, 1)]
    row = _summarise(done, raw_gbps=4.0)
    assert row["state_bytes"] == 64 * MIB and row["handoff_ms_p50"] == 40
    assert row["transfer_ms_p50"] == 32 and row["fixed_ms_p50"] == 3
    assert row["transfer_gbps"] == pytest.approx(64 * MIB / 0.032 / 1e9, rel=1e-3)
    assert row["bandwidth_ratio"] == pytest.approx(row["transfer_gbps"] / 4.0, abs=1e-3)
    assert row["meets_fixed_bar"] and row["meets_bandwidth_bar"]
    slow = _summarise([report(400, 4, 320, 4)], raw_gbps=4.0)
    assert not slow["meets_fixed_bar"] and not slow["meets_bandwidth_bar"]
    small = _summarise([report(4, 1, 1, 1, nbytes=MIB)], raw_gbps=4.0)
    assert "meets_bandwidth_bar" not in small  # the bandwidth bar starts at 64 MiB


def test_table_prints_every_row(capsys):
    rows = [_summarise([report(40, 1, 32, 1)], 4.0), _summarise([report(4, 1, 1, 1, MIB)], 4.0)]
    print_table(
        {
            "results": rows,
            "devices": ["cpu", "cpu"],
            "transport": "gloo",
            "repeats": 1,
            "first_use_ms": 12.5,
            "first_use_ms_each": [12.5, 3.0],
        }
    )
    out = capsys.readouterr().out
    assert "| 64 |" in out and "| 1 |" in out and "first use" in out and "12.5" in out


def test_raw_copy_measures_a_bandwidth():
    assert raw_copy_gbps(MIB, repeats=2) > 0
