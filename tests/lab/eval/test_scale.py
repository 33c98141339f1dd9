"""The evaluation at scale: a trace at scale N is N copies superposed, each shifted by a seeded
0-40 s offset; `sim evaluate --scale 1,2` reports every figure with its scale, and the gap to
the clairvoyant at the service level at each."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from lab.sim import synth
from lab.sim.catalog import load_trace, scale_of
from lab.sim.traceio import make_trace, write_trace
from tools.cli import main

PROFILE = "h20-longlive-1.3b-nvlink"


@pytest.fixture(scope="module")
def base():
    return synth.generate(synth.spec("bursty", seed=11, duration_s=300.0), name="base")


def test_a_trace_at_scale_n_is_n_shifted_copies(base):
    big = synth.scaled(base, 3, seed=5)
    assert big.name == "base_x3" and scale_of(big.name) == 3 and big.duration == base.duration
    offsets = np.random.default_rng(5).uniform(0, synth.SCALE_OFFSET_MAX_S, size=3)
    # Sessions that would arrive after the end, shifted, are cut.
    assert big.sessions == sum(
        1
        for off in offsets
        for e in base.events
        if e.event == "arrive" and round(e.t + off, 3) < base.duration
    )
    assert 2.5 * base.sessions < big.sessions <= 3 * base.sessions
    arrivals = [e.session_id for e in big.events if e.event == "arrive"]
    assert len(set(arrivals)) == len(arrivals)  # ids unique across copies
    # A valid trace: every session's lifecycle holds (make_trace validates it), in time order.
    again = make_trace("again", [(e.t, e.session_id, e.event) for e in big.events])
    assert again.events == big.events
    first = base.events[0]
    for copy, offset in enumerate(offsets):
        mine = [e for e in big.events if e.session_id.startswith(f"c{copy}-")]
        assert mine[0].session_id == f"c{copy}-{first.session_id}"
        assert mine[0].t == pytest.approx(first.t + offset, abs=1e-3)
        # Each copy is the base trace shifted by its offset, cut at the end.
        kept = [
            (round(e.t + offset, 3), e.event)
            for e in base.events
            if round(e.t + offset, 3) < base.duration
        ]
        assert [(e.t, e.event) for e in mine if e.t < base.duration] == kept
        counts = Counter(e.event for e in mine)
        assert counts["depart"] == counts["arrive"]  # everyone leaves, at the end at the latest
    assert 0 < min(offsets) and max(offsets) < synth.SCALE_OFFSET_MAX_S


def test_the_same_seed_gives_the_same_trace_and_scale_1_is_the_trace(base):
    assert synth.scaled(base, 2, seed=1) == synth.scaled(base, 2, seed=1)
    assert synth.scaled(base, 2, seed=1).events != synth.scaled(base, 2, seed=2).events
    assert synth.scaled(base, 1) is base
    with pytest.raises(ValueError, match="scale must be >= 1"):
        synth.scaled(base, 0)


def test_a_builtin_trace_at_scale_is_loaded_by_name():
    trace = load_trace("calm_x2")
    assert trace.name == "calm_x2"
    assert trace == synth.scaled(load_trace("calm"), 2)
    assert load_trace("calm_x2") == trace  # deterministic: the built-in seed
    with pytest.raises(FileNotFoundError, match="at scale N: <name>_xN"):
        load_trace("nothing_x2")


@pytest.fixture(scope="module")
def scaled_eval(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    traces = root / "traces"
    traces.mkdir()
    write_trace(
        synth.generate(synth.spec("flash_crowd", seed=3, duration_s=150.0), name="tiny"),
        traces / "tiny.csv.gz",
    )
    out, md = root / "eval.json", root / "eval.md"
    code = main(
        [
            "sim",
            "evaluate",
            "--traces",
            str(traces),
            "--quick",
            "--jobs",
            "1",
            "--profiles",
            PROFILE,
            "--placement-instances",
            "5",
            "--scale",
            "1,2",
            "--json",
            str(out),
            "--markdown",
            str(md),
        ]
    )
    assert code == 0
    return json.loads(out.read_text()), md.read_text()


@pytest.mark.slow
def test_each_scale_is_evaluated_and_says_its_scale(scaled_eval):
    doc, _ = scaled_eval
    assert doc["scale"] == 1 and doc["summary"]["scale"] == 1 and doc["config"]["scale"] == 1
    assert set(doc["by_scale"]) == {"1", "2"}
    two = doc["by_scale"]["2"]["by_profile"][PROFILE]
    assert two["summary"]["scale"] == 2 and two["config"]["scale"] == 2
    assert set(two["traces"]) == {"tiny_x2"}
    # The placement gap depends on no trace: measured once, reported at each scale.
    assert two["summary"]["placement_gap_to_oracle_pct"]["instances"] == 5
    one = doc["by_scale"]["1"]["by_profile"][PROFILE]
    assert one["summary"] == doc["summary"]
    # Twice the sessions cost more GPU-hours at the adaptive point.
    assert (
        two["traces"]["tiny_x2"]["turboserve"]["cost_gpu_hours"]
        > one["traces"]["tiny"]["turboserve"]["cost_gpu_hours"]
    )


@pytest.mark.slow
def test_the_gap_to_the_clairvoyant_at_99_percent_at_each_scale(scaled_eval):
    doc, md = scaled_eval
    for entry in doc["by_scale"].values():
        run = entry["by_profile"][PROFILE]
        block = run["summary"]["gap_to_clairvoyant_at_slo_pct"]
        for name, t in run["traces"].items():
            v = t["service_level"]
            ours = v["turboserve"]
            theirs = v["rivals"]["clairvoyant"]
            gap = 100 * (ours["cost_gpu_hours"] / theirs["cost_gpu_hours"] - 1)
            assert v["gap_to_clairvoyant_at_slo_pct"] == pytest.approx(gap, abs=1e-3)
            both = ours["reached"] and theirs["reached"]
            assert block["per_trace"][name] == (pytest.approx(gap, abs=1e-3) if both else None)
        values = [x for x in block["per_trace"].values() if x is not None]
        assert block["traces_averaged"] == len(values)
        assert block["avg"] == (
            pytest.approx(sum(values) / len(values), abs=1e-3) if values else None
        )
    # Every heading of the report says its scale, and the gap is tabled by scale.
    assert "## Summary (scale 1;" in md and "## Summary (scale 2;" in md
    assert (
        "## Cost to serve 99% of chunk periods on time (stall-adjusted), per trace (scale 2)" in md
    )
    assert "## Gap to the clairvoyant at 99% of chunk periods on time, by scale" in md
    assert "| tiny_x2 " in md


@pytest.mark.parametrize("scale", ["0", "a", "1,1", ""])
def test_a_bad_scale_is_a_one_line_error(scale, tmp_path, capsys):
    assert main(["sim", "evaluate", "--traces", str(tmp_path), "--scale", scale]) == 2
    err = capsys.readouterr().err
    assert err.startswith("turboserve sim evaluate: --scale") and "Traceback" not in err
