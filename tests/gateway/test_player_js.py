"""The playground's pure helpers (``static/player.js``) under Node: the texts it shows and
how it paces the frames it draws. Skipped without Node."""

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
    script = f"const player = require({json.dumps(str(PLAYER))});\n{body}"
    out = subprocess.run([NODE, "-e", script], capture_output=True, text=True, timeout=30,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_ack_texts_never_say_a_close_is_unconfirmed():
    texts = run_js("""
        console.log(JSON.stringify([
          player.ackText({control: "close", confirmed: true, next_seq: null, last_seq: 41}),
          player.ackText({control: "close", confirmed: true, next_seq: null, last_seq: -1}),
          player.ackText({control: "prompt", confirmed: true, next_seq: 14}),
          player.ackText({control: "pause", confirmed: false, next_seq: null}),
        ]));""")
    assert texts == ["closed after seq 41", "closed", "done, from seq 14",
                     "accepted; the worker has not confirmed it yet"]


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
    return [(b[0] - a[0], a[1]) for a, b in zip(draws, draws[1:], strict=False)
            if a[0] - start >= 1.0]


@pytest.mark.parametrize("skew", [0.0, -3.7, 42.0])  # the page's clock against the server's
def test_paced_playback_has_no_gap_with_chunks_on_time(skew):
    result = run_js(SIMULATE + f"""
        const r = simulate({{period: 1.25, counts: [9, 12], early: 1.0, late: 0.15,
                             seconds: 30, skew: {skew}, lateChunk: -1}});
        console.log(JSON.stringify(r));""")
    draws, order = result["draws"], result["order"]
    assert order == sorted(order)  # every frame, in order, none twice
    gaps = gaps_after_first_second(draws)
    assert len(gaps) > 250
    worst = max(gap / nominal for gap, nominal in gaps)
    assert worst <= 1.2, worst  # the bar is 2x the nominal interval; a 5 ms tick adds the rest
    # 9 frames in the first chunk, 12 after, each chunk 1.25 s long: 7.2 and 9.6 fps
    assert {round(1 / nominal, 1) for _, nominal in draws} == {7.2, 9.6}


def test_a_late_chunk_leaves_one_gap_then_playback_is_back_to_back():
    result = run_js(SIMULATE + """
        const r = simulate({period: 1.25, counts: [12], early: 0.0, late: 0.05, seconds: 20,
                            skew: 0, lateChunk: 6});
        console.log(JSON.stringify(r));""")
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
