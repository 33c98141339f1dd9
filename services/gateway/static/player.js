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


// Video playback through Media Source Extensions (`?format=fmp4`). Every chunk comes as a
// self-contained fragmented MP4 (init segment + one fragment) whose timestamps sit on the
// session's timeline (`start_s` = seq x period), so the fragments are appended as they come
// to one SourceBuffer in "segments" mode and the <video> element plays them at their own pace.
// What the page decides around it is below: whether the browser can play the codec, when to
// start, where the playhead should be (join, gaps, backlogs) and which played video to drop.
const GAP_TOLERANCE_S = 0.1; // closer than this to a range counts as in it (frame rounding)
const KEEP_BEHIND_S = 4; // played video kept in the SourceBuffer; older goes
const MAX_START_WAIT_S = 3; // the most a first chunk done early waits for its due time

// Whether a fragment with this MIME type (`video/mp4; codecs="avc1..."`) plays here. `mediaSource`
// is the page's MediaSource constructor (undefined where MSE is missing).
function playableAsVideo(mime, mediaSource) {
  if (!mediaSource || typeof mediaSource.isTypeSupported !== "function" || !mime) return false;
  return mediaSource.isTypeSupported(mime) === true;
}

// How long after the first fragment arrives playback starts: the jitter buffer, plus as long as
// the chunk was done ahead of its due time (the next chunk may only come at its own due time).
// The canvas pacer waits the same, from the same timing.
function startDelayS(timing, jitterS = JITTER_S) {
  let earlyS = 0;
  if (timing && Number.isFinite(timing.due_at) && Number.isFinite(timing.done_at)) {
    earlyS = Math.min(Math.max(0, timing.due_at - timing.done_at), MAX_START_WAIT_S);
  }
  return earlyS + jitterS;
}

// Where the playhead should go, from the buffered ranges ([[start, end], ...] in order, seconds on
// the session's timeline), the playhead and the chunk length. Returns the time to seek to, or
// null to leave it. The playhead goes
// - to the first range ahead of it when it is in none (joining: the video starts at 0 and the
//   session's first chunk at seq x period; after a gap: a lag skip, a chunk that came as JPEG);
// - over the gap to the next range when it reached its range's end and another range follows;
// - near the live edge when more than `maxAheadS` of video waits ahead (a backlog that came at
//   once, after a reconnect): `chunkS + jitterS` before the end, as just after a chunk arrives.
function liveEdgeSeek(ranges, currentTime, { chunkS, jitterS = JITTER_S, maxAheadS } = {}) {
  if (!ranges.length) return null;
  const chunk = chunkS > 0 ? chunkS : 1;
  const limit = maxAheadS > 0 ? maxAheadS : Math.max(3, 3 * chunk);
  const nearEdge = (end) => end - Math.min(chunk + jitterS, limit);
  const here = ranges.findIndex(([s, e]) => s - GAP_TOLERANCE_S <= currentTime && currentTime < e);
  if (here < 0) {
    const next = ranges.find(([s]) => s > currentTime);
    if (!next) return null; // the playhead is past all that came: wait for more
    const last = ranges[ranges.length - 1];
    return last[1] - next[0] > limit ? Math.max(next[0], nearEdge(last[1])) : next[0];
  }
  const [, end] = ranges[here];
  if (end - currentTime > limit) return nearEdge(end);
  const following = ranges[here + 1];
  if (following && end - currentTime < GAP_TOLERANCE_S) return following[0];
  return null;
}

// The played video to drop: [start, end) to remove, or null. Everything more than `keepS`
// behind the playhead goes, once there is at least a second of it (fewer, larger removals).
function trimRange(ranges, currentTime, keepS = KEEP_BEHIND_S) {
  if (!ranges.length) return null;
  const cut = currentTime - keepS;
  return ranges[0][0] < cut - 1 ? [ranges[0][0], cut] : null;
}

// A fragment that ends before the playhead was played already (a chunk sent again): not appended.
function isPlayed(startS, durationS, currentTime) {
  return Number.isFinite(startS) && Number.isFinite(durationS) && startS + durationS <= currentTime;
}

// A SourceBuffer takes one append or remove at a time: operations wait here until the one before
// ended ("updateend"). A fragment whose MIME type differs from the buffer's switches the buffer
// with changeType where the browser has it. An operation that throws (a closed MediaSource, a
// full buffer) is handed to `onError`, and the queue stops: the page decides what follows.
class AppendQueue {
  constructor(buffer, mime, onError = () => {}) {
    this.buffer = buffer;
    this.mime = mime;
    this.onError = onError;
    this.pending = [];
    this.failed = null;
    this.appended = 0;
    buffer.addEventListener("updateend", () => this.pump());
  }

  append(bytes, mime) {
    if (this.failed) return;
    this.pending.push({ kind: "append", bytes, mime });
    this.pump();
  }

  // One removal waits at a time: a second asks for no more than the first.
  remove(start, end) {
    if (this.failed || this.pending.some((op) => op.kind === "remove")) return;
    this.pending.push({ kind: "remove", start, end });
    this.pump();
  }

  get busy() {
    return this.buffer.updating || this.pending.length > 0;
  }

  pump() {
    if (this.failed || this.buffer.updating || !this.pending.length) return;
    const op = this.pending.shift();
    try {
      if (op.kind === "remove") {
        this.buffer.remove(op.start, op.end);
        return;
      }
      if (op.mime && op.mime !== this.mime && typeof this.buffer.changeType === "function") {
        this.buffer.changeType(op.mime);
        this.mime = op.mime;
      }
      this.buffer.appendBuffer(op.bytes);
      this.appended += 1;
    } catch (err) {
      this.failed = err;
      this.pending = [];
      this.onError(err);
    }
  }
}

if (typeof module !== "undefined") {
  module.exports = {
    ackText, FramePacer, JITTER_S, playableAsVideo, startDelayS, liveEdgeSeek, trimRange,
    isPlayed, AppendQueue, GAP_TOLERANCE_S, KEEP_BEHIND_S,
  };
}
