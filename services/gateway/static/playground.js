// TurboServe playground: start a session, watch it over the WebSocket, steer it.
// Protocol (see docs/gateway.md): binary messages are chunks (4-byte big-endian header length,
// JSON header, then the chunk: with ?format=fmp4 one fragmented MP4, played by the <video>
// element through Media Source Extensions (video.js); with ?format=jpeg, JPEG frames back to
// back (the gateway makes them from the chunk's video), drawn on the canvas); text messages
// are JSON (state, lag, end, ack, error).
// The page asks for fmp4 unless the format picker (or #format=jpeg in the address) says jpeg,
// and falls back to jpeg where the browser cannot play the fragments' codec.
// Camera mode (the input picker, or #input=camera): a video-to-video session. The camera
// (getUserMedia) goes to the gateway over WebRTC, on a sendrecv video transceiver whose other
// direction brings the restyled video back; the controls and text messages use the peer's
// data channel instead of the WebSocket.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "turboserve.apiKey";
// What the state line says after each lifecycle notice (a prompt notice changes no state).
const STATE_SHOWN = {
  placed: "playing", resumed: "playing", migrated: "playing (migrated)",
  restarted: "playing (restarted)", suspended: "suspended",
};

const ui = {
  start: $("start"), prompt: $("prompt"), seed: $("seed"), apiKey: $("api-key"),
  startError: $("start-error"), controlError: $("control-error"), sessionId: $("session-id"),
  format: $("format"), screen: $("screen"), video: $("video"), buffer: $("buffer"), newPrompt: $("new-prompt"), sendPrompt: $("send-prompt"),
  input: $("input"), strength: $("strength"), newStrength: $("new-strength"), rtcVideo: $("rtc-video"), preview: $("camera-preview"),
  pause: $("pause"), resume: $("resume"), close: $("close"), state: $("state"), seq: $("seq"),
  latency: $("latency"), delivery: $("delivery"), gen: $("gen"), framesDrawn: $("frames-drawn"),
  chart: $("latency-chart"), log: $("log"),
};

let session = null;      // {id, token, ws_url}
let socket = null;
let peer = null;         // camera mode: {pc, channel, stream}
// Camera mode's figures (frames sent from the camera, restyled frames decoded), for the page
// and for the browser tests; the session, so a test can watch it from outside.
const cameraStats = { framesSent: 0, framesDecoded: 0, camera: null };
window.turboserveCamera = cameraStats;
let lastSeq = -1;
let ended = false;
let controlId = 0;
let framesDrawn = 0;
let decoding = Promise.resolve();
let streamFormat = "fmp4"; // what this session's socket asks for
// The <video> side; null where the browser has no Media Source Extensions.
const video = typeof MediaSource === "function" ? new MseVideo(ui.video, (err) => fallBackToJpeg(String(err))) : null;
window.turboserveVideo = video && video.stats;
const pacer = new FramePacer();  // decoded frames, each drawn at its time (player.js)
// Draw times (performance.now(), ms) and each frame's nominal interval: what the browser
// tests read to hold the pacing to its bar.
const drawStats = { times: [], intervals: [] };
window.turboservePlayback = drawStats;
const history = [];      // recent chunks: {latency, delivery}

function fromHash(name) {
  const m = new RegExp(`(?:^|[#&])${name}=([^&]+)`).exec(location.hash);
  return m ? decodeURIComponent(m[1]) : null;
}

ui.apiKey.value = fromHash("key") || localStorage.getItem(KEY_STORE) || "";
if (fromHash("format") === "jpeg" || fromHash("format") === "fmp4") ui.format.value = fromHash("format");
if (fromHash("input") === "camera") ui.input.value = "camera";

function log(kind, text) {
  const li = document.createElement("li");
  const k = document.createElement("span");
  k.className = "kind";
  k.textContent = kind;
  li.append(k, document.createTextNode(" " + text));
  ui.log.prepend(li);
  while (ui.log.children.length > 200) ui.log.lastChild.remove();
}

function setControls(enabled) {
  for (const el of [ui.newPrompt, ui.newStrength, ui.sendPrompt, ui.pause, ui.resume, ui.close]) el.disabled = !enabled;
}

function errorText(body, status) {
  if (body && body.error) return `${body.error.code}: ${body.error.message}`;
  return `HTTP ${status}`;
}

async function startSession() {
  ui.startError.textContent = "";
  const body = { prompt: ui.prompt.value };
  if (ui.seed.value !== "") body.seed = Number(ui.seed.value);
  const camera = ui.input.value === "camera";
  if (camera) {
    body.input = "video";
    if (ui.strength.value !== "") body.strength = Number(ui.strength.value);
  }
  const headers = { "Content-Type": "application/json" };
  const key = ui.apiKey.value.trim();
  if (key) {
    headers.Authorization = "Bearer " + key;
    localStorage.setItem(KEY_STORE, key);
  }
  ui.start.disabled = true;
  try {
    const resp = await fetch("/v1/sessions", { method: "POST", headers, body: JSON.stringify(body) });
    const data = await resp.json().catch(() => null);
    if (resp.status !== 201) {
      ui.startError.textContent = errorText(data, resp.status);
      ui.start.disabled = false;
      return;
    }
    closeSocket();
    session = data;
    window.turboserveSession = { id: data.id, token: data.token };
    lastSeq = -1;
    ended = false;
    for (const bitmap of pacer.clear()) bitmap.close();
    streamFormat = ui.format.value === "fmp4" && video ? "fmp4" : "jpeg";
    if (ui.format.value === "fmp4" && !video) log("format", "no Media Source Extensions here: JPEG frames");
    if (video) video.reset();
    showSurface(streamFormat === "fmp4" ? "video" : "canvas");
    ui.sessionId.textContent = session.id;
    ui.state.textContent = session.state;
    log("created", `${session.id.slice(0, 8)}: ${session.prompt}${camera ? ` (camera, strength ${session.strength})` : ""}`);
    ui.newStrength.hidden = !camera;
    if (camera) await startCamera();
    else connect();
    ui.start.disabled = false;
  } catch (err) {
    ui.startError.textContent = String(err);
    ui.start.disabled = false;
  }
}

function socketUrl() {
  const url = new URL(session.ws_url, location.href);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  url.searchParams.set("token", session.token);
  url.searchParams.set("format", streamFormat);
  if (lastSeq >= 0) url.searchParams.set("last_event_id", String(lastSeq));
  return url.toString();
}

function connect() {
  const ws = new WebSocket(socketUrl());
  ws.binaryType = "arraybuffer";
  socket = ws;
  ws.onopen = () => setControls(true);
  ws.onmessage = (ev) => {
    if (typeof ev.data === "string") onText(JSON.parse(ev.data));
    // Chunks decode one after another so that their frames keep their order.
    else decoding = decoding.then(() => onChunk(ev.data)).catch((err) => log("error", String(err)));
  };
  ws.onclose = () => {
    if (socket !== ws) return;
    setControls(false);
    if (!ended) {
      log("socket", "closed; reconnecting");
      setTimeout(() => { if (!ended && socket === ws) connect(); }, 1000);
    }
  };
}

// The fragments cannot play here (a codec the browser lacks, a SourceBuffer that broke): the
// same session goes on as JPEG frames on the canvas, from the chunk after the last one taken.
function fallBackToJpeg(why) {
  if (streamFormat === "jpeg" || !session) return;
  streamFormat = "jpeg";
  log("format", `video cannot play (${why}): JPEG frames`);
  showSurface("canvas");
  if (socket) {
    closeSocket();
    connect();
  }
}

function showSurface(which) {
  ui.video.hidden = which !== "video";
  ui.screen.hidden = which !== "canvas";
  ui.rtcVideo.hidden = which !== "rtc";
}

// Camera mode: the camera to the gateway and the restyled video back, on one peer connection.
async function startCamera() {
  const stream = await navigator.mediaDevices.getUserMedia({ video: { width: 640, height: 480 }, audio: false });
  ui.preview.srcObject = stream;
  ui.preview.hidden = false;
  const pc = new RTCPeerConnection({ iceServers: [] });
  pc.addTransceiver(stream.getVideoTracks()[0], { direction: "sendrecv", streams: [stream] });
  const channel = pc.createDataChannel("control");
  peer = { pc, channel, stream };
  channel.onopen = () => setControls(true);
  channel.onclose = () => { if (peer && peer.channel === channel) setControls(false); };
  channel.onmessage = (ev) => onText(JSON.parse(ev.data));
  pc.ontrack = (ev) => {
    ui.rtcVideo.srcObject = new MediaStream([ev.track]);
    showSurface("rtc");
  };
  await pc.setLocalDescription(await pc.createOffer());
  await new Promise((resolve) => { // the whole offer at once: the gateway takes no trickle
    if (pc.iceGatheringState === "complete") resolve();
    pc.addEventListener("icegatheringstatechange", () => { if (pc.iceGatheringState === "complete") resolve(); });
    setTimeout(resolve, 5000);
  });
  const resp = await fetch(`/v1/sessions/${session.id}/webrtc`, {
    method: "POST",
    headers: { Authorization: "Bearer " + session.token, "Content-Type": "application/json" },
    body: JSON.stringify({ type: "offer", sdp: pc.localDescription.sdp }),
  });
  const answer = await resp.json().catch(() => null);
  if (resp.status !== 200) {
    ui.startError.textContent = errorText(answer, resp.status);
    stopCamera();
    return;
  }
  cameraStats.camera = answer.camera;
  log("camera", answer.camera ? `sending, ${answer.video.codec} back` : "the gateway does not take this session's camera");
  await pc.setRemoteDescription({ type: "answer", sdp: answer.sdp });
}

function stopCamera() {
  if (!peer) return;
  const { pc, stream } = peer;
  peer = null;
  for (const track of stream.getTracks()) track.stop();
  pc.close();
  ui.preview.hidden = true;
  setControls(false);
}

async function showCameraStats() {
  if (!peer) return;
  const stats = await peer.pc.getStats();
  stats.forEach((s) => {
    if (s.kind !== "video") return;
    if (s.type === "outbound-rtp") cameraStats.framesSent = s.framesSent || 0;
    if (s.type === "inbound-rtp") cameraStats.framesDecoded = s.framesDecoded || 0;
  });
  ui.framesDrawn.textContent = String(cameraStats.framesDecoded);
  ui.buffer.textContent = `${cameraStats.framesSent} sent`;
}

function showFrameCount() {
  ui.framesDrawn.textContent = String(framesDrawn + (video ? video.framesShown() : 0));
}

function closeSocket() {
  stopCamera();
  if (socket) {
    const ws = socket;
    socket = null;
    ws.close();
  }
}

async function onChunk(buffer) {
  const view = new DataView(buffer);
  const headerLen = view.getUint32(0);
  const header = JSON.parse(new TextDecoder().decode(new Uint8Array(buffer, 4, headerLen)));
  let offset = 4 + headerLen;
  const received = Date.now() / 1000;
  if (header.encoding === "fmp4" && !playableAsVideo(header.mime, window.MediaSource)) {
    fallBackToJpeg(`no ${header.mime} in this browser`); // the chunk comes again, as JPEG
    return;
  }
  if (streamFormat === "jpeg" && header.encoding === "fmp4") return; // the old socket's last
  lastSeq = Math.max(lastSeq, header.seq);
  const t = header.timing;
  const delivery = Math.max(0, (received - t.done_at) * 1000);
  ui.seq.textContent = header.seq;
  ui.latency.textContent = t.latency_ms.toFixed(0);
  ui.delivery.textContent = delivery.toFixed(0);
  ui.gen.textContent = `${t.gen_ms.toFixed(0)} (${t.batch})`;
  history.push({ latency: t.latency_ms, delivery });
  if (history.length > 120) history.shift();
  drawChart();
  if (header.encoding === "fmp4") {
    ui.video.style.aspectRatio = `${header.width} / ${header.height}`;
    await video.add(header, new Uint8Array(buffer, offset, header.fragment_size));
    showSurface("video");
    return;
  }
  // JPEG frames: the stream's format.
  showSurface("canvas");
  if (ui.screen.width !== header.width || ui.screen.height !== header.height) {
    ui.screen.width = header.width;
    ui.screen.height = header.height;
    ui.screen.style.aspectRatio = `${header.width} / ${header.height}`;
  }
  const decoded = [];
  for (const size of header.frame_sizes) {
    const blob = new Blob([new Uint8Array(buffer, offset, size)], { type: "image/jpeg" });
    offset += size;
    decoded.push(createImageBitmap(blob));
  }
  const bitmaps = await Promise.all(decoded);
  for (const old of pacer.add(bitmaps, header.fps, t, Date.now() / 1000)) old.close();
  wakePlayback();
}

function onText(msg) {
  switch (msg.type) {
    case "state":
      if (msg.kind in STATE_SHOWN) ui.state.textContent = STATE_SHOWN[msg.kind];
      log("state", `${msg.kind} on ${msg.worker_id} from seq ${msg.next_seq}${msg.detail ? " (" + msg.detail + ")" : ""}`);
      break;
    case "lag":
      log("lag", `skipped ${msg.skipped} chunks (${msg.first_skipped}-${msg.last_skipped})`);
      break;
    case "end":
      ended = msg.reason !== "gateway_shutdown";
      ui.state.textContent = ended ? "closed" : ui.state.textContent;
      log("end", `${msg.reason} after seq ${msg.last_seq}`);
      if (ended) setControls(false);
      if (peer) { // camera mode: a gateway going away is left for another, with a new offer
        stopCamera();
        if (!ended) setTimeout(() => { if (session && !peer) startCamera().catch((err) => log("error", String(err))); }, 1000);
      }
      break;
    case "ack": {
      log(msg.control, ackText(msg));
      if (msg.control === "pause") ui.state.textContent = "paused";
      if (msg.control === "resume") ui.state.textContent = "playing";
      break;
    }
    case "error":
      ui.controlError.textContent = errorText(msg, 0);
      log("error", `${msg.control || "message"}: ${msg.error.code}`);
      break;
    default:
      log("?", JSON.stringify(msg));
  }
}

function send(type, extra) {
  const line = peer ? peer.channel : socket;
  if (!line || line.readyState !== (peer ? "open" : WebSocket.OPEN)) return;
  ui.controlError.textContent = "";
  controlId += 1;
  line.send(JSON.stringify({ type, id: controlId, ...extra }));
}

// Playback: each frame at the time the pacer gives it (its chunk's due time plus a jitter
// buffer, then 1/fps apart), on a timer (works in background tabs and headless browsers,
// unlike requestAnimationFrame). A new chunk wakes the timer early.
let playTimer = null;

function playLoop() {
  playTimer = null;
  const { draw, skipped, waitS } = pacer.next(Date.now() / 1000);
  for (const bitmap of skipped) bitmap.close();
  if (draw) {
    const ctx = ui.screen.getContext("2d");
    ctx.drawImage(draw, 0, 0, ui.screen.width, ui.screen.height);
    draw.close();
    framesDrawn += 1;
    showFrameCount();
    drawStats.times.push(performance.now());
    drawStats.intervals.push(pacer.lastIntervalS * 1000);
    if (drawStats.times.length > 4000) {
      drawStats.times.shift();
      drawStats.intervals.shift();
    }
  }
  playTimer = setTimeout(playLoop, Math.max(1, waitS * 1000));
}

// The video's figures, a few times a second.
function showVideoStats() {
  if (peer) {
    showCameraStats().catch(() => {});
  } else if (video && !ui.video.hidden) {
    showFrameCount();
    ui.buffer.textContent = `${video.aheadS().toFixed(1)} s`;
  } else {
    ui.buffer.textContent = streamFormat === "jpeg" && session ? `${pacer.bufferedS(Date.now() / 1000).toFixed(1)} s (JPEG)` : "-";
  }
}

function wakePlayback() {
  if (playTimer !== null) clearTimeout(playTimer);
  playLoop();
}

function drawChart() {
  const c = ui.chart;
  const ctx = c.getContext("2d");
  const w = c.width, h = c.height;
  ctx.clearRect(0, 0, w, h);
  if (history.length < 2) return;
  const top = Math.max(50, ...history.map((p) => Math.max(p.latency, p.delivery))) * 1.1;
  const series = [["latency", "#f5a524"], ["delivery", "#4fa3ff"]];
  for (const [field, color] of series) {
    ctx.strokeStyle = color;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    history.forEach((p, i) => {
      const x = (i / (history.length - 1)) * w;
      const y = h - (p[field] / top) * (h - 14);
      if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
    });
    ctx.stroke();
  }
  ctx.fillStyle = "#8a94a3";
  ctx.font = "10px sans-serif";
  ctx.fillText(`ms (max ${top.toFixed(0)}): chunk latency (orange), delivery (blue)`, 4, 10);
}

ui.start.addEventListener("click", startSession);
ui.sendPrompt.addEventListener("click", () => {
  const prompt = ui.newPrompt.value.trim();
  const change = prompt ? { prompt } : {};
  if (peer && ui.newStrength.value !== "") change.strength = Number(ui.newStrength.value);
  if (Object.keys(change).length) send("prompt", change);
});
ui.newPrompt.addEventListener("keydown", (ev) => { if (ev.key === "Enter") ui.sendPrompt.click(); });
ui.pause.addEventListener("click", () => send("pause"));
ui.resume.addEventListener("click", () => send("resume"));
ui.close.addEventListener("click", () => send("close"));
setControls(false);
showSurface(ui.format.value === "fmp4" && video ? "video" : "canvas");
playLoop();
setInterval(showVideoStats, 250);
