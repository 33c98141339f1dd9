"""Trace reading and writing: round trips, and bad rows that name their line."""

from __future__ import annotations

import gzip

import pytest

from lab.sim import synth
from lab.sim.traceio import TraceError, make_trace, read_trace, write_trace

GOOD = "t,session_id,event\n0.0,a,arrive\n0.5,b,arrive\n1.25,a,idle\n2,a,active\n3,a,depart\n"


def _write(tmp_path, text: str, name: str = "x.csv"):
    p = tmp_path / name
    if name.endswith(".gz"):
        p.write_bytes(gzip.compress(text.encode()))
    else:
        p.write_text(text)
    return p


@pytest.mark.parametrize("name", ["t.csv", "t.csv.gz"])
def test_round_trip_plain_and_gzip(tmp_path, name):
    trace = make_trace(
        "t",
        [
            (0.0, "a", "arrive"),
            (0.5, "b", "arrive"),
            (1.25, "a", "idle"),
            (2.0, "a", "active"),
            (3.0, "a", "depart"),
        ],
    )
    path = write_trace(trace, tmp_path / name)
    back = read_trace(path)
    assert back.events == trace.events
    assert back.name == "t"
    assert back.duration == 3.0


def test_synthetic_trace_round_trips_exactly(tmp_path):
    trace = synth.generate(synth.spec("bursty", duration_s=120.0))
    back = read_trace(write_trace(trace, tmp_path / "b.csv.gz"))
    assert back.events == trace.events


def test_gzip_output_is_byte_identical_for_the_same_trace(tmp_path):
    trace = synth.generate(synth.spec("calm", duration_s=60.0))
    a = write_trace(trace, tmp_path / "a.csv.gz").read_bytes()
    b = write_trace(trace, tmp_path / "b.csv.gz").read_bytes()
    assert a == b


def test_reads_plain_text(tmp_path):
    tr = read_trace(_write(tmp_path, GOOD))
    assert [e.event for e in tr.events] == ["arrive", "arrive", "idle", "active", "depart"]
    assert tr.active_counts() == [(0.0, 1), (0.5, 2), (1.25, 1), (2.0, 2), (3.0, 1)]


@pytest.mark.parametrize(
    ("row", "needle"),
    [
        ("x,a,active", "not a number"),
        ("-1,a,active", ">= 0"),
        ("nan,a,active", "finite"),
        ("0.1,a,active", "goes backwards"),
        ("1.5,,active", "empty session_id"),
        ("1.5,a,wake", "unknown event"),
        ("1.5,a", "expected 3 fields"),
        ("1.5,a,arrive", "arrives twice"),
        ("1.5,zz,idle", "before its arrive"),
        ("1.5,b,active", "already active"),
    ],
)
def test_bad_row_names_its_line(tmp_path, row, needle):
    # The bad row is line 4: header, two good rows, then it.
    text = "t,session_id,event\n0.0,a,arrive\n0.5,b,arrive\n" + row + "\n"
    with pytest.raises(TraceError) as info:
        read_trace(_write(tmp_path, text, "bad.csv.gz"))
    assert info.value.line == 4
    assert needle in info.value.reason
    assert "bad.csv.gz:4:" in str(info.value)


def test_event_after_depart_is_an_error(tmp_path):
    text = "t,session_id,event\n0,a,arrive\n1,a,depart\n2,a,active\n"
    with pytest.raises(TraceError, match=r":4: 'active' for session 'a' after its depart"):
        read_trace(_write(tmp_path, text))


def test_bad_header(tmp_path):
    with pytest.raises(TraceError) as info:
        read_trace(_write(tmp_path, "time,id,kind\n0,a,arrive\n"))
    assert info.value.line == 1


def _lifetimes(trace):
    starts: dict[str, float] = {}
    lives = []
    for e in trace.events:
        if e.event == "arrive":
            starts[e.session_id] = e.t
        elif e.event == "depart":
            lives.append(e.t - starts[e.session_id])
    return lives


def test_builtin_traces_match_the_papers_description():
    for trace in synth.builtin_traces():
        if trace.name == "churny":
            continue  # not the paper's workload: see the next test
        counts = [n for t, n in trace.active_counts() if t > 60]
        assert trace.duration >= 1800
        assert min(counts) <= 25, trace.name  # about a dozen at the quiet times
        assert max(counts) >= 100, trace.name  # over a hundred at the peak
        lives = _lifetimes(trace)
        assert min(lives) < 5 and max(lives) > 120, trace.name
        assert any(e.event == "idle" for e in trace.events)


def test_churny_is_steady_load_made_of_short_flipping_sessions():
    trace = synth.builtin_trace("churny")
    counts = [n for t, n in trace.active_counts() if 60 < t < trace.duration - 1]
    assert 30 <= min(counts) and max(counts) <= 100  # near-constant: about 60, never a surge
    lives = sorted(_lifetimes(trace))
    assert lives[len(lives) // 2] < 20  # many short sessions (median 12 s)
    flips = sum(1 for e in trace.events if e.event in ("idle", "active"))
    assert trace.sessions > 10_000 and flips > 2 * trace.sessions  # frequent flips


def test_generation_is_deterministic_and_seeded():
    a = synth.generate(synth.spec("chaotic", duration_s=300.0))
    b = synth.generate(synth.spec("chaotic", duration_s=300.0))
    c = synth.generate(synth.spec("chaotic", seed=7, duration_s=300.0))
    assert a.events == b.events
    assert a.events != c.events


def test_training_traces_use_other_seeds_than_the_evaluation():
    train = synth.training_traces(duration_s=120.0, variants=1)
    evaluation = {
        name: synth.generate(synth.spec(name, duration_s=120.0)) for name in synth.BUILTIN_NAMES
    }
    assert len(train) == len(synth.BUILTIN_NAMES)
    for tr in train:
        shape = tr.name.removeprefix("train_").rsplit("_", 1)[0]
        assert tr.events != evaluation[shape].events


def _relative_churn(trace) -> float:
    """Mean |change of active sessions| per 10 s, over the mean active count (after 1 min)."""
    counts = trace.active_counts()
    samples = []
    i = 0
    for k in range(6, int(trace.duration // 10)):
        while i + 1 < len(counts) and counts[i + 1][0] <= 10.0 * k:
            i += 1
        samples.append(counts[i][1])
    steps = [abs(b - a) for a, b in zip(samples, samples[1:], strict=False)]
    return (sum(steps) / len(steps)) / (sum(samples) / len(samples))


def test_traces_range_from_calm_to_very_bursty():
    churn = {t.name: _relative_churn(t) for t in synth.builtin_traces()}
    ranked = sorted(churn, key=churn.get)
    assert ranked[0] == "calm", churn
    assert set(ranked[-2:]) == {"bursty", "chaotic"}, churn
    assert churn["chaotic"] > 1.4 * churn["calm"], churn
