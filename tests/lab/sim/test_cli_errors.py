"""Bad input on the command line is one line `turboserve <cmd>: <message>` and exit status 2,
never a traceback."""

from __future__ import annotations

import gzip
import json

import pytest

from tools.cli import main

GOOD = "t,session_id,event\n0,a,arrive\n5,a,depart\n"


@pytest.fixture
def good(tmp_path):
    path = tmp_path / "good.csv"
    path.write_text(GOOD)
    return path


def _fails(capsys, argv, prefix, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(prefix), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    return err


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--rho-hat", "2"], "rho-hat must be in (0, 1], got 2"),
        (["--rho-hat", "0"], "rho-hat must be in (0, 1]"),
        (["--gpus", "-2"], "--gpus must be >= 0, got -2"),
        (["--boot-delay", "-1"], "--boot-delay must be"),
        (["--param", "foo=1"], "does not take foo"),
        (["--param", "eta=-1"], "must be >= 0"),
        (["--policy", "round_robin", "--gpus", "-2"], "--gpus must be >= 0"),
    ],
)
def test_sim_run_bad_values(good, capsys, extra, needle):
    _fails(capsys, ["sim", "run", "--trace", str(good), *extra], "turboserve sim run: ", needle)


def test_sim_run_static_policy_rejects_autoscaling_knobs_instead_of_dropping_them(good, capsys):
    _fails(
        capsys,
        ["sim", "run", "--trace", str(good), "--policy", "round_robin", "--rho-hat", "0.5"],
        "turboserve sim run: ",
        "does not take rho_hat",
    )
    _fails(
        capsys,
        [
            "sim",
            "run",
            "--trace",
            str(good),
            "--policy",
            "least_loaded",
            "--gpus",
            "2",
            "--param",
            "foo=1",
        ],
        "turboserve sim run: ",
        "does not take foo",
    )
    _fails(
        capsys,
        ["sim", "run", "--trace", str(good), "--policy", "memory_aware", "--delta", "0.1"],
        "turboserve sim run: ",
        "does not take delta",
    )


def test_sim_run_static_policy_still_takes_what_it_accepts(good, capsys):
    assert (
        main(
            ["sim", "run", "--trace", str(good), "--policy", "no_autoscale", "--param", "eta=0.05"]
        )
        == 0
    )


def _corrupt(tmp_path):
    p = tmp_path / "corrupt.csv.gz"
    p.write_bytes(b"this is not gzip data at all\n")
    return p, "not a valid gzip file"


def _truncated(tmp_path):
    p = tmp_path / "trunc.csv.gz"
    p.write_bytes(gzip.compress((GOOD * 50).encode())[:40])
    return p, "truncated gzip"


def _binary(tmp_path):
    p = tmp_path / "bin.csv"
    p.write_bytes(b"\xff\xfe\x00\x81\x90binary")
    return p, "not UTF-8"


@pytest.mark.parametrize("make", [_corrupt, _truncated, _binary])
def test_sim_run_unreadable_trace_files_name_the_file(tmp_path, capsys, make):
    path, needle = make(tmp_path)
    _fails(capsys, ["sim", "run", "--trace", str(path)], "turboserve sim run: ", str(path), needle)


def test_read_trace_wraps_decode_errors_as_trace_errors(tmp_path):
    from lab.sim.traceio import TraceError, read_trace

    for make in (_corrupt, _truncated, _binary):
        path, needle = make(tmp_path)
        with pytest.raises(TraceError, match=needle) as info:
            read_trace(path)
        assert info.value.source == str(path)


def test_binary_bytes_late_in_a_file_name_the_line_near_them(tmp_path):
    from lab.sim.traceio import TraceError, read_trace

    path = tmp_path / "late.csv"
    rows = "".join(f"{i},s{i},arrive\n" for i in range(5000))
    path.write_bytes(("t,session_id,event\n" + rows).encode() + b"\xff\xff\n")
    with pytest.raises(TraceError, match="at or after line") as info:
        read_trace(path)
    assert str(path) in str(info.value)


def test_sim_evaluate_with_one_bad_csv_in_the_folder(tmp_path, capsys):
    folder = tmp_path / "traces"
    folder.mkdir()
    (folder / "a_good.csv").write_text(GOOD)
    (folder / "b_bad.csv").write_text("t,session_id,event\n0,a,arrive\n1,a,jump\n")
    _fails(
        capsys,
        ["sim", "evaluate", "--traces", str(folder), "--quick"],
        "turboserve sim evaluate: ",
        "b_bad.csv:3",
        "unknown event 'jump'",
    )
    (folder / "b_bad.csv").write_bytes(b"\xff\xfe\x00")
    _fails(
        capsys,
        ["sim", "evaluate", "--traces", str(folder), "--quick"],
        "turboserve sim evaluate: ",
        "b_bad.csv",
        "not UTF-8",
    )


@pytest.fixture
def bad_profile(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"name": 3')
    return path


def test_sim_profile_bad_profile(bad_profile, capsys):
    _fails(
        capsys,
        ["sim", "profile", "--profile", str(bad_profile), "--check", "eval"],
        "turboserve sim profile: ",
        "bad.json",
        "not valid JSON",
    )
    _fails(
        capsys,
        ["sim", "profile", "--profile", str(bad_profile), "--quick"],
        "turboserve sim profile: ",
        "bad.json",
    )


def test_bench_scheduler_bad_profile(bad_profile, capsys):
    _fails(
        capsys,
        ["bench", "scheduler", "--profile", str(bad_profile), "--gpus", "4", "--steps", "5"],
        "turboserve bench scheduler: ",
        "bad.json",
        "not valid JSON",
    )
    _fails(
        capsys,
        ["bench", "scheduler", "--gpus", "x"],
        "turboserve bench scheduler: ",
        "--gpus must be",
    )


@pytest.mark.parametrize("flag", ["--idle-reserve", "--peak-rho"])
@pytest.mark.parametrize(
    "value, needle",
    [("x", "numbers separated by commas"), ("0,1.5", "must be in [0, 1]"), (",", "must be in")],
)
def test_sim_profile_bad_share_list(capsys, flag, value, needle):
    _fails(
        capsys, ["sim", "profile", "--quick", flag, value], "turboserve sim profile: ", flag, needle
    )


@pytest.mark.parametrize(
    "fault, needle",
    [
        ("idle_reserve=-1", "0 <= idle_reserve <= 1"),
        ("idle_reserve=x", "could not convert"),
        ("peak_rho=2", "0 <= peak_rho <= 1"),
        ("json", "not valid JSON"),
    ],
)
def test_sim_profile_check_with_a_bad_table_is_one_line(tmp_path, capsys, fault, needle):
    from services.scheduler.shipped import DEFAULT_TABLE_PATH

    doc = json.loads(DEFAULT_TABLE_PATH.read_text())
    path = tmp_path / "t.json"
    if fault == "json":
        path.write_text("{")
    else:
        key, value = fault.split("=")
        doc["levels"][3][key] = value if value == "x" else float(value)
        path.write_text(json.dumps(doc))
    _fails(
        capsys,
        ["sim", "profile", "--check", "eval", "--out", str(path)],
        "turboserve sim profile: ",
        "t.json",
        needle,
    )
