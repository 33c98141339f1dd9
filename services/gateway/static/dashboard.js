// TurboServe dashboard: polls GET /v1/cluster (operator key) once a second and draws it.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "turboserve.operatorKey";
const POLL_MS = 1000;

const keyInput = $("operator-key");
let timer = null;
let seenEvents = new Set();

function keyFromHash() {
  const m = /(?:^|[#&])key=([^&]+)/.exec(location.hash);
  return m ? decodeURIComponent(m[1]) : null;
}

keyInput.value = keyFromHash() || localStorage.getItem(KEY_STORE) || "";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function fmt(value, digits = 2) {
  return value === null || value === undefined ? "-" : Number(value).toFixed(digits);
}

function statusBadge(w) {
  const cls = !w.alive ? "bad" : w.status === "ready" ? (w.keeping_pace ? "ok" : "warn") : "warn";
  const text = w.status === "lost" ? "lost" : !w.alive ? "silent"
    : w.keeping_pace ? w.status : `${w.status}, behind`;
  return el("span", { class: `badge ${cls}` }, text);
}

async function closeSession(id) {
  const resp = await fetch(`/v1/sessions/${id}`, {
    method: "DELETE", headers: { Authorization: "Bearer " + keyInput.value.trim() },
  });
  if (!resp.ok) $("error").textContent = `closing ${id}: HTTP ${resp.status}`;
  poll();
}

function workerCard(w, target) {
  const load = w.load;
  const bar = el("div", { class: "bar" });
  if (load !== null) {
    const fill = el("div", { class: "fill" + (target !== null && load > target ? " over" : "") });
    fill.style.width = `${Math.min(100, load * 100)}%`;
    bar.append(fill);
  }
  if (target !== null) {
    const mark = el("div", { class: "target", title: `target ${fmt(target)}` });
    mark.style.left = `${Math.min(100, target * 100)}%`;
    bar.append(mark);
  }
  const sessions = el("ul", { class: "sessions" });
  for (const s of w.sessions) {
    const close = el("button", { class: "danger", title: "close this session" }, "close");
    close.addEventListener("click", () => closeSession(s.id));
    sessions.append(el("li", { "data-session": s.id },
      el("span", { class: "mono" }, s.id.slice(0, 12), s.suspended ? " (suspended)" : ""), close));
  }
  const kind = w.emulated ? `${w.gpu_kind} (emulated ${w.emulated})` : w.gpu_kind;
  // The quality budget: shown while the worker runs fewer than its full denoising steps.
  const steps = w.steps && w.full_steps && w.steps < w.full_steps
    ? `; ${w.steps}/${w.full_steps} denoising steps` : "";
  return el("div", { class: "card", "data-worker": w.id },
    el("h3", {}, el("span", { class: "mono" }, w.id), statusBadge(w)),
    el("div", { class: "muted" },
      `${kind} on ${w.device}; ${w.sessions.length}/${w.capacity} sessions${steps}`),
    bar,
    el("div", { class: "muted" },
      `load ${fmt(load)} vs target ${fmt(target)}; worst latency 10 s: ${fmt(w.worst_latency_ms, 0)} ms`),
    sessions);
}

function drawLatency(points) {
  const c = $("latency-chart");
  const ctx = c.getContext("2d");
  const w = c.width, h = c.height;
  ctx.clearRect(0, 0, w, h);
  const now = Date.now() / 1000;
  const span = 300;
  const top = Math.max(50, ...points.map((p) => p[1])) * 1.1;
  ctx.strokeStyle = "#2a313b";
  ctx.fillStyle = "#8a94a3";
  ctx.font = "11px sans-serif";
  for (const frac of [0, 0.5, 1]) {
    const y = h - frac * (h - 16);
    ctx.beginPath(); ctx.moveTo(0, y); ctx.lineTo(w, y); ctx.stroke();
    ctx.fillText(`${(frac * top).toFixed(0)} ms`, 4, y - 2);
  }
  if (!points.length) return;
  ctx.strokeStyle = "#f5a524";
  ctx.lineWidth = 2;
  ctx.beginPath();
  points.forEach(([t, ms], i) => {
    const x = Math.max(0, (1 - (now - t) / span) * w);
    const y = h - (ms / top) * (h - 16);
    if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
  });
  ctx.stroke();
}

function describe(ev) {
  const rest = Object.entries(ev).filter(([k]) => k !== "kind" && k !== "at")
    .map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`).join(" ");
  return rest;
}

function render(c) {
  const target = c.target;
  const sessions = c.workers.reduce((n, w) => n + w.sessions.length, 0);
  $("n-workers").textContent = c.workers.filter((w) => w.alive).length;
  $("n-sessions").textContent = sessions;
  $("n-pending").textContent = c.pending.length;
  $("pool").textContent = c.pool ? `${c.pool.min_workers} / ${c.pool.max_workers}` : "-";
  $("target").textContent = fmt(target);
  const sched = c.scheduler || {};
  $("gpus").textContent = sched.gpus ?? "-";
  $("rho-max").textContent = fmt(sched.rho_max);
  $("updated").textContent = new Date(c.at * 1000).toLocaleTimeString();
  $("workers").replaceChildren(...c.workers.map((w) => workerCard(w, target)));
  if (!c.workers.length) $("workers").append(el("p", { class: "muted" }, "no worker yet"));
  drawLatency(c.latency);
  const list = $("events");
  const items = [];
  const fresh = new Set();
  for (const ev of c.events) {
    const id = `${ev.at}:${ev.kind}:${describe(ev)}`;
    fresh.add(id);
    const li = el("li", {}, el("span", { class: "kind" }, ev.kind),
      ` ${new Date(ev.at * 1000).toLocaleTimeString()} ${describe(ev)}`);
    if (seenEvents.size && !seenEvents.has(id)) li.className = "new";
    items.push(li);
  }
  seenEvents = fresh;
  list.replaceChildren(...items);
  if (!items.length) list.append(el("li", { class: "muted" }, "none yet"));
}

async function poll() {
  const key = keyInput.value.trim();
  try {
    const resp = await fetch("/v1/cluster", { headers: { Authorization: "Bearer " + key } });
    const body = await resp.json().catch(() => null);
    if (!resp.ok) {
      $("error").textContent = body && body.error ? `${body.error.code}: ${body.error.message}` : `HTTP ${resp.status}`;
      return;
    }
    $("error").textContent = "";
    render(body);
  } catch (err) {
    $("error").textContent = String(err);
  }
}

function start() {
  localStorage.setItem(KEY_STORE, keyInput.value.trim());
  if (timer) clearInterval(timer);
  poll();
  timer = setInterval(poll, POLL_MS);
}

$("connect").addEventListener("click", start);
if (keyInput.value) start();
