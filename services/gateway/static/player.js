// TurboServe playground: what needs no page. Pure functions of the messages, loaded before
// playground.js in the page, and by tests under Node (module.exports at the end).
"use strict";

// The line the event log shows for a control's ack. A close has no next seq: nothing follows
// it. Any other control says from which seq it holds once the worker confirms it, and only
// "accepted" before.
function ackText(msg) {
  if (msg.control === "close") {
    return msg.last_seq >= 0 ? `closed after seq ${msg.last_seq}` : "closed";
  }
  if (!msg.confirmed) return "accepted; the worker has not confirmed it yet";
  return msg.next_seq === null || msg.next_seq === undefined
    ? "done" : `done, from seq ${msg.next_seq}`;
}

// Playback pacing. Each chunk lasts as long as its frames at its own fps (the worker makes
// fps = frames / chunk period: a chunk carries as much video as its period, however many frames
// it has). A chunk is due at `timing.due_at` (server clock): done by then, the viewer has it in
// time. So each chunk is scheduled to start at its due time, moved onto this page's clock, plus
// a small jitter buffer for delivery and decoding: chunks on time then play back to back, with
// no gap, and only a chunk that was late (or a pause) leaves one.
//
// The server clock is moved onto this page's by `offset`, the smallest (arrival - done_at) seen
// lately: the clocks' skew plus the fastest delivery. Without timing (or on a clock that makes
// no sense) a chunk simply follows the one before, after the jitter buffer.
const JITTER_S = 0.25;
const MAX_BUFFERED_S = 3; // beyond this much video ahead, the oldest frames go (near live)
const OFFSET_WINDOW = 16; // chunks the offset estimate looks back over

class FramePacer {
  constructor({ jitterS = JITTER_S, maxBufferedS = MAX_BUFFERED_S } = {}) {
    this.jitterS = jitterS;
    this.maxBufferedS = maxBufferedS;
    this.queue = []; // {item, at, durationS}: frames to draw, `at` on this page's clock (s)
    this.endS = -Infinity; // when the last queued frame ends
    this.offsets = [];
    this.lastIntervalS = null; // the nominal interval of the frame drawn last
  }

  // A chunk's decoded frames (`items`, opaque), its fps and timing, at `nowS` (this page's
  // clock, seconds). Returns the frames dropped to stay near the live edge (to release).
  add(items, fps, timing, nowS) {
    const durationS = 1 / (fps > 0 ? fps : 16);
    let startS = nowS + this.jitterS;
    if (timing && Number.isFinite(timing.due_at) && Number.isFinite(timing.done_at)) {
      this.offsets.push(nowS - timing.done_at);
      if (this.offsets.length > OFFSET_WINDOW) this.offsets.shift();
      const scheduled = timing.due_at + Math.min(...this.offsets) + this.jitterS;
      // A late chunk (the worker's, or a slow delivery) starts after the jitter buffer, as a
      // first one does: the worker's next due times follow its lateness, so the chunks after
      // it play back to back with it (one stall, not a stall and then a second, shorter one).
      // One scheduled inside the one before follows it.
      if (Math.abs(scheduled - nowS) < 60) startS = scheduled >= nowS ? scheduled : nowS + this.jitterS;
    }
    startS = Math.max(startS, this.endS);
    items.forEach((item, i) => this.queue.push({ item, at: startS + i * durationS, durationS }));
    this.endS = startS + items.length * durationS;
    // Too far behind the live edge (a backlog arrived at once): the oldest frames go, and
    // the rest move up by as much, so that the page plays what is newest soon.
    const dropped = [];
    const excessS = this.endS - nowS - this.maxBufferedS;
    if (excessS > 0) {
      let cutS = 0;
      while (this.queue.length && cutS < excessS) {
        const frame = this.queue.shift();
        cutS += frame.durationS;
        dropped.push(frame.item);
      }
      for (const frame of this.queue) frame.at -= cutS;
      this.endS -= cutS;
    }
    return dropped;
  }

  // What to draw at `nowS`: {draw: the frame due now or null, skipped: frames whose time
  // passed unseen (to release), waitS: when to ask again}.
  next(nowS) {
    let draw = null;
    const skipped = [];
    while (this.queue.length && this.queue[0].at <= nowS) {
      const frame = this.queue.shift();
      if (draw !== null) skipped.push(draw.item);
      draw = frame;
    }
    if (draw !== null) this.lastIntervalS = draw.durationS;
    const waitS = this.queue.length ? Math.max(0, this.queue[0].at - nowS) : 0.05;
    return { draw: draw && draw.item, skipped, waitS };
  }

  // Frames waiting, and how many seconds of video they hold.
  bufferedS(nowS) {
    return this.queue.length ? Math.max(0, this.endS - nowS) : 0;
  }

  clear() {
    const items = this.queue.map((f) => f.item);
    this.queue = [];
    this.endS = -Infinity;
    this.offsets = [];
    return items;
  }
}

if (typeof module !== "undefined") module.exports = { ackText, FramePacer, JITTER_S };
