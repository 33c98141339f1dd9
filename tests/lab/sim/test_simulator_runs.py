"""The simulator with the real core policies: determinism, the CLI, and the headline check."""

from __future__ import annotations

import json
import math
import re

import pytest

from lab.sim import synth
from lab.sim.catalog import TRACE_DIR, load_trace
from lab.sim.simulator import simulate, warm_start_gpus
from lab.sim.traceio import read_trace, write_trace
from tools.cli import main

# Live policies that `sim evaluate` does not sweep yet (the staffing autoscaler is read by
# lab.eval.candidates until it is chosen): `sim run --policy all` runs them without a cost at 99%.
NOT_SWEPT = {"turboserve_staffing"}
STATIC = ("round_robin", "least_loaded", "memory_aware")


@pytest.fixture(scope="module")
def short_trace():
    return synth.generate(synth.spec("bursty", duration_s=300.0))


def _fingerprint(r):
    return (
        r.cost_gpu_seconds,
        r.latencies_ms,
        r.migrations,
        r.scale_events,
        r.peak_gpus,
        r.timeline,
    )


def test_runs_are_deterministic(short_trace):
    a = simulate(short_trace, "turboserve", rho_hat=0.6)
    b = simulate(short_trace, "turboserve", rho_hat=0.6)
    assert a.chunks > 1000
    assert _fingerprint(a) == _fingerprint(b)


def test_parameters_change_the_outcome(short_trace):
    low = simulate(short_trace, "turboserve", rho_hat=0.4)
    high = simulate(short_trace, "turboserve", rho_hat=0.9)
    # A lower target utilisation holds more GPUs and runs smaller batches: first chunks come
    # sooner and fewer chunks are late.
    assert low.cost_gpu_seconds > high.cost_gpu_seconds
    assert low.latency()["p99"] < high.latency()["p99"]
    assert low.stall_adjusted_attainment > high.stall_adjusted_attainment


def test_static_pool_costs_exactly_gpus_times_duration(short_trace):
    r = simulate(short_trace, "round_robin", gpus=3)
    assert r.cost_gpu_seconds == pytest.approx(3 * short_trace.duration)
    assert r.migrations == 0 and r.scale_events == 0 and r.peak_gpus == 3


def test_boot_delay_is_paid(short_trace):
    fast = simulate(short_trace, "turboserve", rho_hat=0.6, boot_delay_s=0.0)
    slow = simulate(short_trace, "turboserve", rho_hat=0.6, boot_delay_s=120.0)
    assert slow.latency()["max"] > fast.latency()["max"]


def test_autoscalers_start_warm_unless_told_otherwise(short_trace, tmp_path):
    """A warm trace against static pools that are READY at t=0: autoscalers start with the pool
    warm_start_gpus gives (and keep it for one boot delay) instead of one GPU."""
    from shared.profile import load_profile

    k = load_profile().capacity
    expected = warm_start_gpus(short_trace, k, 30.0)
    assert expected == math.ceil(short_trace.initial_active(30.0) / (k * 0.7)) > 1
    warm = simulate(short_trace, "turboserve", keep_chunk_times=True)
    cold = simulate(short_trace, "turboserve", keep_chunk_times=True, warm_start=False)
    assert warm.params["initial_gpus"] == expected and "initial_gpus" not in cold.params
    assert warm.timeline[0][1] == expected and cold.timeline[0][1] == 1

    def late_in_first_minute(r):
        return sum(
            1
            for t, lat in zip(r.chunk_times_s, r.latencies_ms, strict=True)
            if t < 60 and lat > r.deadline_ms
        )

    assert late_in_first_minute(warm) < late_in_first_minute(cold)
    # An explicit pool wins; static pools never get one.
    assert simulate(short_trace, "turboserve", gpus=2).params["gpus"] == 2
    assert "initial_gpus" not in simulate(short_trace, "least_loaded", gpus=3).params
    out = tmp_path / "cold.json"
    assert main(["sim", "run", "--trace", "bursty", "--cold-start", "--json", str(out)]) == 0
    assert "initial_gpus" not in json.loads(out.read_text())["params"]


def test_shipped_traces_are_the_generated_ones():
    for name in synth.BUILTIN_NAMES:
        shipped = read_trace(TRACE_DIR / f"{name}.csv.gz")
        assert shipped.events == synth.builtin_trace(name).events, name
        assert shipped.duration >= 1800


def test_cli_traces_and_run(tmp_path, capsys):
    assert main(["sim", "traces", "--out", str(tmp_path / "tr"), "--duration", "120"]) == 0
    files = sorted(p.name for p in (tmp_path / "tr").iterdir())
    assert files == sorted(f"{n}.csv.gz" for n in synth.BUILTIN_NAMES)
    out = tmp_path / "r.json"
    code = main(
        [
            "sim",
            "run",
            "--trace",
            str(tmp_path / "tr" / "calm.csv.gz"),
            "--policy",
            "turboserve",
            "--rho-hat",
            "0.7",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    doc = json.loads(out.read_text())
    for key in (
        "policy",
        "trace",
        "cost_gpu_seconds",
        "cost_usd",
        "latency_ms",
        "deadline_attainment",
        "migrations",
        "scale_events",
        "peak_gpus",
        "decision_ms",
        "chunks",
    ):
        assert key in doc, key
    assert set(doc["latency_ms"]) == {"p50", "p99", "max"}
    assert set(doc["decision_ms"]) == {"p50", "p99", "max"}
    assert doc["policy"] == "turboserve" and doc["trace"] == "calm"
    assert doc["params"]["rho_hat"] == 0.7
    assert "| turboserve |" in capsys.readouterr().out


def test_cli_static_policy_takes_gpus(tmp_path):
    out = tmp_path / "s.json"
    assert (
        main(
            [
                "sim",
                "run",
                "--trace",
                "calm",
                "--policy",
                "memory_aware",
                "--gpus",
                "5",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    assert doc["cost_gpu_seconds"] == pytest.approx(5 * 1800.0)


def _service_at_cost(trace, policy, cost):
    """A static baseline's stall-adjusted attainment, linearly interpolated between the GPU
    counts around ``cost``."""
    g = cost / trace.duration
    lo, hi = max(1, math.floor(g)), max(1, math.ceil(g))
    a_lo = simulate(trace, policy, gpus=lo).stall_adjusted_attainment
    if hi == lo:
        return a_lo
    a_hi = simulate(trace, policy, gpus=hi).stall_adjusted_attainment
    return a_lo + (a_hi - a_lo) * (g - lo)


# Known losses (docs/evaluation.md, "Robustness"): where load swings as fast as a GPU boots
# (chaotic) or sits still while sessions churn (churny), a static pool of turboserve's cost
# serves slightly more periods on time. Strict: a win there must update the docs.
_KNOWN_LOSSES = {
    "chaotic": "regimes of 20-90 s, about a boot delay: the pool follows them (236 scale "
    "events) and serves 98.60% of periods for 5.60 GPU-h; 11 static GPUs serve 99.59% for 5.50",
    "churny": "steady load, sessions flip every few seconds: the volatility level moves "
    "across levels 0-6, whose settings differ, and the pool flaps (90 scale events): 99.18% "
    "for 4.40 GPU-h; 8 static GPUs serve 99.98% for 4.00",
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=_KNOWN_LOSSES[n]))
        if n in _KNOWN_LOSSES
        else n
        for n in synth.BUILTIN_NAMES
    ],
)
def test_turboserve_serves_better_than_static_baselines_at_matched_cost(name):
    """The measure of service: the share of chunk periods served on time (stall-adjusted),
    against each static pool of the same cost."""
    trace = load_trace(name)
    ours = simulate(trace, "turboserve")
    for policy in STATIC:
        theirs = _service_at_cost(trace, policy, ours.cost_gpu_seconds)
        assert ours.stall_adjusted_attainment >= theirs, (
            name,
            policy,
            ours.stall_adjusted_attainment,
            theirs,
        )


def test_cli_all_policies_on_one_trace(tmp_path, capsys):
    path = tmp_path / "short.csv.gz"
    write_trace(synth.generate(synth.spec("steps", duration_s=240.0)), path)
    out = tmp_path / "all.json"
    assert main(["sim", "run", "--trace", str(path), "--policy", "all", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    names = [row["policy"] for row in doc["runs"]]
    assert names[0] == "turboserve"
    assert {"round_robin", "least_loaded", "memory_aware", "no_migration", "no_autoscale"} <= set(
        names
    )
    # Static pools cost what turboserve cost: every figure interpolated between the GPU
    # counts around its mean GPU count.
    ours = doc["runs"][0]["cost_gpu_seconds"]
    mean = ours / 240.0
    for row in doc["runs"]:
        if row["policy"] in STATIC:
            assert row["cost_gpu_seconds"] == pytest.approx(ours, rel=1e-6)
            lo, hi = row["interpolated_between_gpus"]
            assert lo <= mean <= hi and hi - lo <= 1
    table = capsys.readouterr().out
    assert table.count("\n| ") >= 2 * len(names)  # the runs, then the cost at 99%
    assert "interpolated between" in table
    # The latency columns say they are lateness (mostly 0).
    assert "| late p50 ms | late p99 ms |" in table
    # With --policy all, each policy's cost to serve 99% of periods comes with the runs.
    assert "cost to serve 99% of chunk periods on time" in table
    for row in doc["runs"]:
        entry = row["cost_at_slo"]
        if row["policy"] in NOT_SWEPT:  # the evaluation has no sweep of it: the table says so
            lines = [ln for ln in table.splitlines() if "not swept by the evaluation" in ln]
            assert entry is None and any(ln.startswith(f"| {row['policy']} ") for ln in lines)
            continue
        assert entry["runs"] >= 2 and entry["cost_gpu_hours"] > 0, row["policy"]
        cell = f"{entry['cost_gpu_hours']:.2f}" if entry["reached"] else "not reached (best"
        assert f"| {row['policy']} " in table and cell in table
    assert "gap to the clairvoyant (our cost over its, minus 1): " in table


@pytest.fixture(scope="module")
def small_trace_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("small")
    write_trace(
        synth.generate(synth.spec("bursty", seed=7, duration_s=180.0), name="small"),
        folder / "small.csv.gz",
    )
    return folder


def test_sim_run_gives_the_cost_at_99_percent_that_sim_evaluate_gives(
    small_trace_dir, tmp_path, capsys
):
    """The figure `sim run` prints for a policy is the one `sim evaluate` reports for that
    trace and policy: the same sweep, the same extension, the same reading."""
    trace = small_trace_dir / "small.csv.gz"
    policies = ("turboserve", "clairvoyant", "least_loaded", "memory_aware")
    run_json = tmp_path / "run.json"
    assert (
        main(
            [
                "sim",
                "run",
                "--trace",
                str(trace),
                "--policy",
                ",".join(policies),
                "--at-slo",
                "--json",
                str(run_json),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    rows = {row["policy"]: row for row in json.loads(run_json.read_text())["runs"]}
    assert tuple(rows) == policies
    eval_json = tmp_path / "eval.json"
    assert (
        main(
            [
                "sim",
                "evaluate",
                "--traces",
                str(small_trace_dir),
                "--profiles",
                "h20-longlive-1.3b-nvlink",
                "--placement-instances",
                "5",
                "--jobs",
                "1",
                "--json",
                str(eval_json),
            ]
        )
        == 0
    )
    level = json.loads(eval_json.read_text())["traces"]["small"]["service_level"]
    expected = {
        "turboserve": level["turboserve"],
        "clairvoyant": level["rivals"]["clairvoyant"],
        "least_loaded": level["static"]["least_loaded"],
        "memory_aware": level["static"]["memory_aware"],
    }
    for policy, entry in expected.items():
        got = rows[policy]["cost_at_slo"]
        assert got["cost_gpu_hours"] == entry["cost_gpu_hours"], policy
        assert got["reached"] == entry["reached"], policy
    # Best-fit packing fills each GPU to K and misses 99% here even at twice the GPUs the peak
    # needs: printed as not reached, with the sweep's best, never as a cost.
    assert expected["memory_aware"]["reached"] is False
    best = 100 * expected["memory_aware"]["best_attainment"]
    assert re.search(rf"\| memory_aware +\| not reached \(best {best:.1f}% at", printed)
    gap = 100 * (
        expected["turboserve"]["cost_gpu_hours"] / expected["clairvoyant"]["cost_gpu_hours"] - 1
    )
    assert f"gap to the clairvoyant (our cost over its, minus 1): {gap:+.1f}%" in printed
    assert level["gap_to_clairvoyant_at_slo_pct"] == pytest.approx(gap, abs=1e-3)


def test_one_policy_points_to_the_flag_for_the_cost_at_99_percent(
    small_trace_dir, tmp_path, capsys
):
    out = tmp_path / "one.json"
    assert (
        main(["sim", "run", "--trace", str(small_trace_dir / "small.csv.gz"), "--json", str(out)])
        == 0
    )
    printed = capsys.readouterr().out
    assert "cost_at_slo" not in json.loads(out.read_text())
    assert "cost to serve 99% of periods" in printed and "--at-slo" in printed
    assert (
        main(["sim", "run", "--trace", str(small_trace_dir / "small.csv.gz"), "--jobs", "0"]) == 2
    )
    assert "--jobs must be >= 1" in capsys.readouterr().err
    assert (
        main(["sim", "run", "--trace", str(small_trace_dir / "small.csv.gz"), "--policy", ","]) == 2
    )
    assert "--policy needs a policy name" in capsys.readouterr().err


def test_unknown_trace_name_lists_the_builtins():
    with pytest.raises(FileNotFoundError, match="built-in: calm, diurnal"):
        load_trace("no_such_trace")


def test_cli_bad_trace_row_is_one_line_naming_it(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("t,session_id,event\n0,a,arrive\n1,a,jump\n")
    assert main(["sim", "run", "--trace", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.csv:3: unknown event 'jump'" in err
    assert main(["sim", "run", "--trace", "calm", "--policy", "nope"]) == 2
    assert "unknown policy 'nope'" in capsys.readouterr().err
