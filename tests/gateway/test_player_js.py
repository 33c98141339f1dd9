"""The playground's pure helpers (``static/player.js``) under Node: the texts it shows, how it
paces the frames it draws and what it decides around the video it plays through Media Source
Extensions. Skipped without Node."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

PLAYER = Path(__file__).resolve().parents[2] / "services" / "gateway" / "static" / "player.js"
NODE = shutil.which("node")

pytestmark = pytest.mark.skipif(NODE is None, reason="no node to run the page's script")


def run_js(body: str) -> object:
    """Run ``body`` with ``player`` bound to player.js's exports; its last line prints JSON."""
    assert NODE is not None  # the module is skipped without it
    script = f"const player = require({json.dumps(str(PLAYER))});\n{body}"
    out = subprocess.run(
        [NODE, "-e", script], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_ack_texts_never_say_a_close_is_unconfirmed():
    texts = run_js("""
        console.log(JSON.stringify([
          player.ackText({control: "close", confirmed: true, next_seq: null, last_seq: 41}),
          player.ackText({control: "close", confirmed: true, next_seq: null, last_seq: -1}),
          player.ackText({control: "prompt", confirmed: true, next_seq: 14}),
          player.ackText({control: "pause", confirmed: false, next_seq: null}),
        ]));""")
    assert texts == [
        "closed after seq 41",
        "closed",
        "done, from seq 14",
        "accepted; the worker has not confirmed it yet",
    ]


# A simulated viewer: chunks of the worker's period arrive with a delivery jitter (and some
# done early, as a worker ahead of its due time does); the page asks the pacer for a frame
# every 5 ms. Prints the draw times and each frame's own interval.
SIMULATE = """
function simulate({period, counts, early, late, seconds, skew, lateChunk}) {
  const pacer = new player.FramePacer();
  let seed = 7;
  const rand = () => (seed = (seed * 16807) % 2147483647) / 2147483647;
  const arrivals = [];
  let due = 1000 + period;
  for (let k = 0; due < 1000 + seconds; k++) {
    const n = counts[Math.min(k, counts.length - 1)];
    let done = due - rand() * early;  // done ahead of its due time, by up to `early`
    if (k === lateChunk) done = due + 0.6;  // a chunk the worker made late
    const arrive = done + 0.005 + rand() * late + skew;  // delivery and decoding
    arrivals.push({k, n, fps: n / period, due, done, arrive});
    due = Math.max(due, done) + period;
  }
  arrivals.sort((a, b) => a.arrive - b.arrive);
  const draws = [], order = [];
  let next = 0;
  for (let now = 1000 + skew; now < 1000 + seconds + skew; now += 0.005) {
    while (next < arrivals.length && arrivals[next].arrive <= now) {
      const c = arrivals[next++];
      const items = Array.from({length: c.n}, (_, i) => [c.k, i]);
      pacer.add(items, c.fps, {due_at: c.due, done_at: c.done}, now);
    }
    const {draw, skipped} = pacer.next(now);
    if (skipped.length) throw new Error("skipped " + JSON.stringify(skipped));
    if (draw) { draws.push([now, pacer.lastIntervalS]); order.push(draw); }
  }
  return {draws, order};
}
"""


def gaps_after_first_second(draws: list[list[float]]) -> list[tuple[float, float]]:
    """(gap, nominal interval of the frame before it) between consecutive draws, after the
    first second of playback."""
    start = draws[0][0]
    return [
        (b[0] - a[0], a[1]) for a, b in zip(draws, draws[1:], strict=False) if a[0] - start >= 1.0
    ]


@pytest.mark.parametrize("skew", [0.0, -3.7, 42.0])  # the page's clock against the server's
def test_paced_playback_has_no_gap_with_chunks_on_time(skew):
    result = run_js(
        SIMULATE
        + f"""
        const r = simulate({{period: 1.25, counts: [9, 12], early: 1.0, late: 0.15,
                             seconds: 30, skew: {skew}, lateChunk: -1}});
        console.log(JSON.stringify(r));"""
    )
    draws, order = result["draws"], result["order"]
    assert order == sorted(order)  # every frame, in order, none twice
    gaps = gaps_after_first_second(draws)
    assert len(gaps) > 250
    worst = max(gap / nominal for gap, nominal in gaps)
    assert worst <= 1.2, worst  # the bar is 2x the nominal interval; a 5 ms tick adds the rest
    # 9 frames in the first chunk, 12 after, each chunk 1.25 s long: 7.2 and 9.6 fps
    assert {round(1 / nominal, 1) for _, nominal in draws} == {7.2, 9.6}


def test_a_late_chunk_leaves_one_gap_then_playback_is_back_to_back():
    result = run_js(
        SIMULATE
        + """
        const r = simulate({period: 1.25, counts: [12], early: 0.0, late: 0.05, seconds: 20,
                            skew: 0, lateChunk: 6});
        console.log(JSON.stringify(r));"""
    )
    gaps = gaps_after_first_second(result["draws"])
    stalls = [gap for gap, nominal in gaps if gap > 2 * nominal]
    assert len(stalls) == 1 and 0.5 < stalls[0] < 0.9  # the late chunk's 0.6 s, once


def test_without_timing_chunks_follow_each_other_and_the_backlog_is_bounded():
    result = run_js("""
        const pacer = new player.FramePacer({jitterS: 0.25, maxBufferedS: 3});
        const first = pacer.add([1, 2, 3, 4], 8, null, 100.0);
        const second = pacer.add([5, 6, 7, 8], 8, null, 100.1);
        const early = pacer.next(100.2);
        const at = pacer.next(100.25);
        const dropped = pacer.add(Array.from({length: 40}, (_, i) => 100 + i), 8, null, 100.3);
        console.log(JSON.stringify({first, second, early: early.draw, at: at.draw,
                                    wait: at.waitS, dropped: dropped.length,
                                    buffered: pacer.bufferedS(100.3)}));""")
    assert result["first"] == [] and result["second"] == []
    assert result["early"] is None and result["at"] == 1  # after the jitter buffer
    assert abs(result["wait"] - 0.125) < 1e-9  # then 1/8 s apart
    assert result["dropped"] > 0 and result["buffered"] <= 3.0 + 1e-9


# Media Source Extensions playback (?format=fmp4): the pure decisions around the <video>.


def test_video_plays_only_a_codec_the_browser_says_it_supports():
    result = run_js("""
        const ms = {isTypeSupported: (mime) => mime === 'video/mp4; codecs="avc1.42C01E"'};
        console.log(JSON.stringify([
          player.playableAsVideo('video/mp4; codecs="avc1.42C01E"', ms),
          player.playableAsVideo('video/mp4; codecs="avc1.640028"', ms),
          player.playableAsVideo('video/mp4; codecs="avc1.42C01E"', undefined),
          player.playableAsVideo("", ms),
        ]));""")
    assert result == [True, False, False, False]


def test_playback_starts_after_the_jitter_buffer_and_waits_for_an_early_chunks_due_time():
    result = run_js("""
        console.log(JSON.stringify([
          player.startDelayS({due_at: 10.0, done_at: 10.3}, 0.25),  // late: the jitter only
          player.startDelayS({due_at: 10.0, done_at: 9.4}, 0.25),   // 0.6 s early
          player.startDelayS({due_at: 100.0, done_at: 10.0}, 0.25), // a nonsense clock: capped
          player.startDelayS(null, 0.25),
        ]));""")
    assert [round(x, 6) for x in result] == [0.25, 0.85, 3.25, 0.25]


def test_the_playhead_joins_at_the_first_fragment_jumps_gaps_and_backlogs():
    result = run_js("""
        const opts = {chunkS: 1.25, jitterS: 0.25};
        console.log(JSON.stringify({
          join: player.liveEdgeSeek([[37.5, 38.75]], 0, opts),
          empty: player.liveEdgeSeek([], 0, opts),
          playing: player.liveEdgeSeek([[37.5, 40.0]], 38.2, opts),
          // a frame's rounding short of the range counts as in it
          rounding: player.liveEdgeSeek([[37.5, 40.0]], 37.45, opts),
          // a lag skip left a gap: at the end of the first range, on to the next
          gapEnd: player.liveEdgeSeek([[37.5, 40.0], [45.0, 46.25]], 39.95, opts),
          gapMid: player.liveEdgeSeek([[37.5, 40.0], [45.0, 46.25]], 39.0, opts),
          inGap: player.liveEdgeSeek([[37.5, 40.0], [45.0, 46.25]], 41.0, opts),
          // a backlog that came at once after a reconnect: near the live edge
          backlog: player.liveEdgeSeek([[37.5, 50.0]], 38.0, opts),
          backlogAhead: player.liveEdgeSeek([[37.5, 38.75], [40.0, 50.0]], 39.0, opts),
          past: player.liveEdgeSeek([[37.5, 38.75]], 39.0, opts),
        }));""")
    assert result == {
        "join": 37.5,
        "empty": None,
        "playing": None,
        "rounding": None,
        "gapEnd": 45.0,
        "gapMid": None,
        "inGap": 45.0,
        "backlog": 48.5,
        "backlogAhead": 48.5,
        "past": None,
    }


def test_played_video_is_trimmed_and_a_played_fragment_is_not_appended_again():
    result = run_js("""
        console.log(JSON.stringify({
          young: player.trimRange([[30, 36]], 34.5, 4),
          old: player.trimRange([[30, 36]], 35.5, 4),
          none: player.trimRange([], 35.5, 4),
          played: player.isPlayed(30, 1.25, 31.25),
          playing: player.isPlayed(30, 1.25, 31.0),
          unknown: player.isPlayed(undefined, 1.25, 31.0),
        }));""")
    assert result == {
        "young": None,
        "old": [30, 31.5],
        "none": None,
        "played": True,
        "playing": False,
        "unknown": False,
    }


# A SourceBuffer stand-in: each operation takes until `finish()` fires its "updateend".
FAKE_BUFFER = """
class FakeBuffer {
  constructor({failOn} = {}) { this.updating = false; this.log = []; this.listeners = []; this.failOn = failOn; }
  addEventListener(kind, fn) { if (kind === "updateend") this.listeners.push(fn); }
  appendBuffer(bytes) {
    if (this.updating) throw new Error("InvalidStateError: updating");
    if (bytes === this.failOn) throw new Error("QuotaExceededError");
    this.updating = true; this.log.push(["append", bytes]);
  }
  remove(start, end) {
    if (this.updating) throw new Error("InvalidStateError: updating");
    this.updating = true; this.log.push(["remove", start, end]);
  }
  changeType(mime) { this.log.push(["changeType", mime]); }
  finish() { this.updating = false; for (const fn of this.listeners) fn(); }
}
"""


def test_the_append_queue_runs_one_operation_at_a_time_in_order():
    result = run_js(
        FAKE_BUFFER
        + """
        const buffer = new FakeBuffer();
        const errors = [];
        const queue = new player.AppendQueue(buffer, "video/mp4; a", (e) => errors.push(String(e)));
        queue.append("f1", "video/mp4; a");
        queue.append("f2", "video/mp4; a");
        queue.remove(0, 10);
        queue.remove(0, 12);  // one removal waits at a time
        queue.append("f3", "video/mp4; b");  // another codec string: changeType first
        const busy = queue.busy;
        while (buffer.updating) buffer.finish();
        console.log(JSON.stringify({log: buffer.log, errors, busy, idle: !queue.busy,
                                    appended: queue.appended}));"""
    )
    assert result == {
        "log": [
            ["append", "f1"],
            ["append", "f2"],
            ["remove", 0, 10],
            ["changeType", "video/mp4; b"],
            ["append", "f3"],
        ],
        "errors": [],
        "busy": True,
        "idle": True,
        "appended": 3,
    }


def test_an_append_the_buffer_refuses_stops_the_queue_and_says_why():
    result = run_js(
        FAKE_BUFFER
        + """
        const buffer = new FakeBuffer({failOn: "f2"});
        const errors = [];
        const queue = new player.AppendQueue(buffer, "m", (e) => errors.push(String(e)));
        queue.append("f1", "m");
        queue.append("f2", "m");
        queue.append("f3", "m");
        buffer.finish();
        queue.append("f4", "m");
        console.log(JSON.stringify({log: buffer.log, errors, pending: queue.pending.length}));"""
    )
    assert result == {
        "log": [["append", "f1"]],
        "errors": ["Error: QuotaExceededError"],
        "pending": 0,
    }
