// TurboServe playground: the <video> element fed through Media Source Extensions, for streams
// asked with ?format=fmp4. The decisions (when to start, where the playhead goes, what to
// trim) are player.js's pure functions; this file only wires them to the DOM.
"use strict";

const VIDEO_TICK_MS = 50;
const VIDEO_SAMPLES_KEPT = 6000; // 5 minutes of (time, currentTime) at one per tick

class MseVideo {
  // `onFail(error)`: the browser refused a fragment or the SourceBuffer broke; the page falls
  // back to JPEG frames.
  constructor(video, onFail) {
    this.video = video;
    this.onFail = onFail;
    // What the browser tests read: (performance.now() ms, currentTime s) once a tick from the
    // start of playback, the seeks the page made ([ms, from, to]), how many fragments went in
    // and how often playback ran dry and waited for its jitter buffer again.
    this.stats = { samples: [], seeks: [], appended: 0, rebuffers: 0 };
    this.source = null;
    this.url = null;
    video.addEventListener("waiting", () => this.starved());
    video.addEventListener("error", () => {
      if (this.source) this.fail(new Error(`video error ${video.error && video.error.code}: ${video.error && video.error.message}`));
    });
    this.reset();
    this.tick();
  }

  // A fresh MediaSource for a new session.
  reset() {
    const oldUrl = this.url;
    this.source = new MediaSource();
    this.url = URL.createObjectURL(this.source);
    const source = this.source;
    this.opened = new Promise((resolve) => source.addEventListener("sourceopen", resolve, { once: true }));
    this.video.src = this.url;
    if (oldUrl) URL.revokeObjectURL(oldUrl);
    this.queue = null;
    this.chunkS = 0;
    this.playAt = null;
    this.playAsked = false;
    this.started = false;
    this.failed = false;
    this.stats.samples.length = 0;
    this.stats.seeks.length = 0;
    this.stats.appended = 0;
    this.stats.rebuffers = 0;
  }

  // One chunk's fragment (`bytes`, a Uint8Array) with its header (mime, start_s, duration_s,
  // timing).
  async add(header, bytes) {
    const source = this.source;
    await this.opened;
    if (source !== this.source || this.failed) return; // a new session started meanwhile
    if (!this.queue) {
      let buffer;
      try {
        buffer = source.addSourceBuffer(header.mime);
        buffer.mode = "segments"; // the fragments' own timestamps place them
      } catch (err) {
        this.fail(err);
        return;
      }
      buffer.addEventListener("error", () => this.fail(new Error("the SourceBuffer refused a fragment")));
      this.queue = new AppendQueue(buffer, header.mime, (err) => this.fail(err));
    }
    if (isPlayed(header.start_s, header.duration_s, this.video.currentTime)) return;
    this.chunkS = header.duration_s;
    this.queue.append(bytes, header.mime);
    this.stats.appended += 1;
    if (this.playAt === null) this.playAt = performance.now() / 1000 + startDelayS(header.timing);
  }

  // Playback ran out of video (a late chunk, a paused session): it waits for the next fragment
  // and the jitter buffer again, as at the start, so that the chunks after it have their margin
  // back instead of each arriving just as the video runs dry. Not at a gap with video after it
  // (the playhead jumps it) nor while seeking.
  starved() {
    const v = this.video;
    if (!this.playAsked || v.seeking || this.failed || !this.queue) return;
    const t = v.currentTime;
    if (this.aheadS() > GAP_TOLERANCE_S || this.ranges().some(([start]) => start > t)) return;
    v.pause();
    this.playAsked = false;
    this.playAt = null;
    this.stats.rebuffers += 1;
  }

  fail(err) {
    if (this.failed) return;
    this.failed = true;
    this.onFail(err);
  }

  ranges() {
    const buffered = this.queue.buffer.buffered;
    const out = [];
    for (let i = 0; i < buffered.length; i++) out.push([buffered.start(i), buffered.end(i)]);
    return out;
  }

  // Seconds of video ahead of the playhead in its range (0 when none).
  aheadS() {
    if (!this.queue || this.failed) return 0;
    const t = this.video.currentTime;
    const range = this.ranges().find(([s, e]) => s - GAP_TOLERANCE_S <= t && t < e);
    return range ? range[1] - t : 0;
  }

  // Frames the element has shown (decoded and not dropped).
  framesShown() {
    const q = this.video.getVideoPlaybackQuality ? this.video.getVideoPlaybackQuality() : null;
    return q ? Math.max(0, q.totalVideoFrames - q.droppedVideoFrames) : 0;
  }

  tick() {
    const now = performance.now();
    const v = this.video;
    if (this.queue && !this.failed && this.source.readyState === "open") this.steer(now);
    const samples = this.stats.samples;
    if (this.started) samples.push([now, v.currentTime]);
    if (samples.length > VIDEO_SAMPLES_KEPT) samples.splice(0, samples.length - VIDEO_SAMPLES_KEPT);
    setTimeout(() => this.tick(), VIDEO_TICK_MS);
  }

  steer(now) {
    const v = this.video;
    const ranges = this.ranges();
    if (!v.seeking) {
      const to = liveEdgeSeek(ranges, v.currentTime, { chunkS: this.chunkS });
      if (to !== null) {
        this.stats.seeks.push([now, v.currentTime, to]);
        v.currentTime = to;
      }
    }
    const cut = trimRange(ranges, v.currentTime);
    if (cut && !this.queue.busy) this.queue.remove(cut[0], cut[1]);
    if (!this.playAsked && ranges.length && this.playAt !== null && now / 1000 >= this.playAt) {
      this.playAsked = true;
      this.started = true;
      const source = this.source;
      v.play().catch((err) => { if (source === this.source) this.fail(err); });
    }
  }
}
