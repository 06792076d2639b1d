// Conveyor's live lifecycle dashboard. One EventSource: a snapshot of the in-flight requests, then each
// transition as it happens (the gateway fans its one reader of the lifecycle feed out to every page), and the
// workers' figures once a second. The table is virtualised: only the rows on screen exist in the DOM, so a
// thousand requests in flight cost no more to draw than thirty.
"use strict";

const ROW_H = 24, OVERSCAN = 10, ENDED_KEEP_S = 30, ROWS_REFRESH_MS = 2000;
const ENDED = "ended";  // the filter of every request that ended in the last ENDED_KEEP_S  // ROW_H: as in dashboard.css
const $ = (id) => document.getElementById(id);
const S = { rows: new Map(), order: [], dirty: true, offset: 0, filter: "", selected: null, config: null,
  terminal: new Set(), states: [], workers: {}, live: false };

const now = () => Date.now() / 1000 + S.offset;  // Redis's clock, which every timestamp here comes from
const fmtS = (s) => (s == null || isNaN(s)) ? "" : s < 1 ? `${Math.round(s * 1000)} ms` : s < 120 ? `${s.toFixed(1)} s` : `${Math.round(s / 60)} min`;
const esc = (v) => String(v ?? "").replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));
const stateTag = (st) => `<span class="state" style="background:var(--${esc(st)})">${esc(st)}</span>`;

async function api(path, opts = {}) {
  const r = await fetch(path, { credentials: "same-origin", ...opts });
  const body = r.status === 204 ? null : await r.json();
  if (!r.ok) throw Object.assign(new Error(body?.error?.message || r.statusText), { status: r.status });
  return body;
}

// ---- login: the key goes once in a header to /dashboard/login, which keeps it in an HttpOnly cookie for
// /dashboard only. Never in the address: a link with a key would plant it in whoever opens it.
function showLogin(message) {
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  $("login-key").focus();
  $("login").onsubmit = async (e) => {
    e.preventDefault();
    try {
      await api("/dashboard/login", { method: "POST", headers: { Authorization: `Bearer ${$("login-key").value}` } });
      location.reload();
    } catch (err) {
      $("login-error").textContent = err.message;
    }
  };
}

// ---- rows: the snapshot, then one feed record per transition
function applySnapshot(snap) {
  S.offset = snap.at - Date.now() / 1000;
  S.rows = new Map(snap.rows.map((r) => [r.rid, r]));
  S.dirty = true;
}

// A conversation session's move (rec.session set; from/to are the session's states): shown on its turn's row,
// which keeps its own request state (the turn COMPLETED, its session PAUSED).
function applySessionRecord(rec) {
  const row = S.rows.get(rec.rid);
  if (!row || rec.at < (row.sessionSince || 0)) return;  // a turn this page never showed, or an older move
  Object.assign(row, { session: `${rec.session} ${rec.to}`, sessionSince: rec.at });
  S.dirty = true;
}

function applyRecord(rec) {
  if (rec.session) return applySessionRecord(rec);
  let row = S.rows.get(rec.rid);
  if (!row) {
    if (S.terminal.has(rec.to)) return;  // ended before this page knew it: nothing to show in the live table
    row = { rid: rec.rid, created: rec.from === "" ? rec.at : null, prompt: null, output: 0, cached: null,
      worker: "", attempt: 0, since: 0 };
    S.rows.set(rec.rid, row);
    S.rowsSoon = true;  // its prompt length and tokens: fetched with the next quick refresh
  }
  if (rec.at < row.since) return;  // older than what the snapshot already showed
  Object.assign(row, { state: rec.to, since: rec.at, reason: rec.reason, by: rec.service });
  if (rec.worker) Object.assign(row, { worker: rec.worker, attempt: rec.attempt });
  if (S.terminal.has(rec.to)) { row.endedAt = rec.at; S.rowsSoon = true; }
  S.dirty = true;
  if (S.selected === rec.rid) loadDetail(rec.rid);
}

function visibleOrder() {
  const t = now();
  for (const [rid, r] of S.rows) if (r.endedAt && t - r.endedAt > ENDED_KEEP_S) S.rows.delete(rid);
  const all = [...S.rows.values()];
  // Default: the requests in flight, oldest first; ended ones (kept a while) only under their own filters,
  // latest first.
  const keep = !S.filter ? (r) => !r.endedAt : S.filter === ENDED ? (r) => r.endedAt : (r) => r.state === S.filter;
  const shown = all.filter(keep);
  if (S.filter === ENDED || S.terminal.has(S.filter)) shown.sort((a, b) => b.endedAt - a.endedAt);
  else shown.sort((a, b) => (a.created ?? a.since) - (b.created ?? b.since));
  return shown;
}

// ---- the virtualised table: a spacer as tall as every row, the DOM holding only those on screen
function renderTable() {
  if (S.dirty) { S.order = visibleOrder(); S.dirty = false; renderCounts(); }
  const sc = $("scroller"), t = now();
  $("spacer").style.height = `${S.order.length * ROW_H}px`;
  const first = Math.max(0, Math.floor(sc.scrollTop / ROW_H) - OVERSCAN);
  const last = Math.min(S.order.length, Math.ceil((sc.scrollTop + sc.clientHeight) / ROW_H) + OVERSCAN);
  const html = [];
  for (let i = first; i < last; i++) {
    const r = S.order[i];
    html.push(`<div class="row${r.endedAt ? " ended" : ""}${S.selected === r.rid ? " sel" : ""}" data-rid="${esc(r.rid)}">` +
      `<span>${esc(r.rid)}</span><span>${stateTag(r.state)}</span><span>${fmtS(t - r.since)}</span>` +
      `<span>${r.created ? fmtS(t - r.created) : ""}</span><span>${r.prompt ?? ""}</span><span>${r.output ?? ""}</span>` +
      `<span>${r.cached ?? ""}</span><span>${esc(r.worker)}</span><span>${r.attempt || ""}</span>` +
      `<span class="session">${esc(r.session || "")}</span></div>`);
  }
  const rows = $("rows");
  rows.style.transform = `translateY(${first * ROW_H}px)`;
  rows.innerHTML = html.join("");
  $("shown").textContent = `${S.order.length} shown · ${S.rows.size} known`;
}

function renderCounts() {
  const counts = {};
  for (const r of S.rows.values()) if (!r.endedAt) counts[r.state] = (counts[r.state] || 0) + 1;
  $("counts").innerHTML = S.states.filter((s) => !S.terminal.has(s)).map((s) =>
    `<span class="count${S.filter === s ? " active" : ""}" data-state="${s}" style="border-color:var(--${s})">${s}<b>${counts[s] || 0}</b></span>`).join("");
  S.counts = counts;
}

// The token counts: of the rows on screen (output grows), and of every row whose prompt or cached count is not
// known yet, wherever it is.
// The feed carries transitions, not tokens. Not only the rows on screen: with a thousand requests in flight
// about fifty end a second, so the list slides past a fixed scroll position and a new row may be on screen for
// under a second; asked only while on screen, it would come into view blank again and again.
async function refreshRows() {
  // One at a time: on a busy gateway an answer can take longer than the interval, and overlapping requests
  // would queue up in the browser and arrive later and later.
  if (S.refreshing) return;
  S.refreshing = true;
  S.rowsSoon = false;
  S.lastRows = Date.now();
  const sc = $("scroller"), first = Math.floor(sc.scrollTop / ROW_H);
  const onScreen = S.order.slice(first, first + Math.ceil(sc.clientHeight / ROW_H) + 1).map((r) => r.rid);
  const ids = new Set(onScreen);
  for (const r of S.rows.values()) {
    if (ids.size >= S.config.max_row_ids) break;
    if ((r.prompt == null || r.cached == null) && !r.endedAt) ids.add(r.rid);  // not tokenized or not prefilled yet
  }
  try {
    if (!ids.size) return;
    const { rows } = await api(`/dashboard/api/rows?ids=${[...ids].join(",")}`);
    for (const r of rows) {
      const row = S.rows.get(r.rid);
      if (row) Object.assign(row, { prompt: r.prompt, output: r.output, cached: r.cached, created: r.created ?? row.created });
      if (r.prompt == null || r.cached == null) S.rowsSoon = true;  // not tokenized or prefilled yet: ask again soon
    }
  } catch (e) { console.warn("rows refresh failed", e); } finally { S.refreshing = false; }
}

// ---- charts: the states counted here, the workers' figures from their heartbeats
const css = (v) => getComputedStyle(document.documentElement).getPropertyValue(v).trim();
let charts;
function makeCharts() {
  charts = {
    states: new LiveChart($("chart-states"), ["QUEUED", "PREFILLING", "DECODING", "PREEMPTED"].map((s) => ({ name: s, color: css(`--${s}`) }))),
    run: new LiveChart($("chart-run"), [{ name: "running", color: "#34d399" }, { name: "waiting", color: "#f5b942" }]),
    kv: new LiveChart($("chart-kv"), [{ name: "used", color: "#60a5fa" }, { name: "cached", color: "#a78bfa" }, { name: "free", color: "#6b7280" }]),
    step: new LiveChart($("chart-step"), [{ name: "step ms", color: "#22d3ee" }, { name: "preempt", color: "#fb923c" }]),
    sessions: new LiveChart($("chart-sessions"), [{ name: "paused", color: "#34d399" }, { name: "swapped", color: "#a78bfa" }]),
  };
}

function onWorkers(w) {
  S.workers = w.workers;
  const ws = Object.values(w.workers), sum = (k) => ws.reduce((a, x) => a + (x[k] || 0), 0);
  const t = now(), c = S.counts || {};
  charts.states.push(t, ["QUEUED", "PREFILLING", "DECODING", "PREEMPTED"].map((s) => c[s] || 0));
  charts.run.push(t, [sum("running"), sum("waiting")]);
  charts.kv.push(t, [sum("total_blocks") - sum("free_blocks"), sum("cached_blocks"), sum("free_blocks")]);
  const step = ws.length ? 1000 * sum("step_time_s") / ws.length : 0;
  charts.step.push(t, [step, sum("preemptions")]);
  charts.sessions.push(t, [sum("sessions_paused"), sum("sessions_swapped")]);
  Object.values(charts).forEach((ch) => ch.draw());
  $("workers").innerHTML = Object.entries(w.workers).map(([id, x]) =>
    `<span class="worker">${esc(id)} · running <b>${x.running}</b> · waiting <b>${x.waiting}</b> · KV <b>${x.total_blocks - x.free_blocks}</b>/${x.total_blocks} (cached ${x.cached_blocks}) · step <b>${fmtS(x.step_time_s)}</b> · preemptions <b>${x.preemptions}</b> · sessions <b class="sessions">${x.sessions_paused || 0}</b> paused (${x.session_blocks_paused || 0} blocks), ${x.sessions_swapped || 0} swapped</span>`).join("") || "no live worker";
}

// ---- one request: its timeline, timings, layers, trace link, cancel
async function loadDetail(rid) {
  let d;
  try { d = await api(`/dashboard/api/requests/${rid}`); } catch (e) { $("detail-state").textContent = String(e.message); return; }
  if (S.selected !== rid) return;
  $("detail").hidden = false;
  $("detail-id").textContent = rid;
  $("detail-state").innerHTML = stateTag(d.state);
  $("detail-cancel").disabled = S.terminal.has(d.state);
  const trace = $("detail-trace");
  trace.hidden = !d.trace_url;
  trace.href = d.trace_url || "#";
  renderTimeline(d.history, d.state);
  const iv = d.intervals || {};
  $("timings").innerHTML = [["TTFT", iv.ttft], ["TPOT", iv.tpot], ["ITL p50", iv.itl_p50], ["ITL max", iv.itl_max],
    ["end to end", iv.e2e], ["queue wait", iv.queue_wait], ["engine TTFT", iv.engine_ttft], ["prefill", iv.prefill_time],
    ["decode", iv.decode_time]].map(([k, v]) => `<tr><td>${k}</td><td>${v == null ? "—" : fmtS(v)}</td></tr>`).join("");
  $("layers").innerHTML = ["meta", "input", "exec", "kv", "output"].map((l) =>
    `<details${l === "meta" ? " open" : ""}><summary>${l}</summary><pre>${esc(JSON.stringify(d[l], null, 1))}</pre></details>`).join("");
}

function renderTimeline(history, state) {
  if (!history.length) { $("timeline").innerHTML = ""; return; }
  const t0 = history[0].t, ended = S.terminal.has(state), tEnd = ended ? history[history.length - 1].t : now();
  const span = Math.max(tEnd - t0, 1e-3);
  $("timeline").innerHTML = history.map((h, i) => {
    const end = i + 1 < history.length ? history[i + 1].t : tEnd, left = (h.t - t0) / span * 100;
    const width = Math.max((end - h.t) / span * 100, 0.4);
    const why = h.reason ? ` (${esc(h.reason)})` : "";
    return `<div class="bar" title="${esc(h.state)} by ${esc(h.service)}${why}">` +
      `<div class="fill" style="left:${left}%;width:${width}%;background:var(--${esc(h.state)})"></div>` +
      `<span class="label">${esc(h.state)} · ${fmtS(end - h.t)} · by ${esc(h.service)}${why}</span></div>`;
  }).join("");
}

async function cancelSelected() {
  const rid = S.selected;
  if (!rid) return;
  $("detail-cancel").disabled = true;
  try { await api(`/dashboard/api/requests/${rid}`, { method: "DELETE" }); } catch (e) { alert(e.message); }
  loadDetail(rid);
}

// ---- wiring
function connect() {
  const es = new EventSource("/dashboard/api/events");
  es.addEventListener("snapshot", (e) => { applySnapshot(JSON.parse(e.data)); setLive(true); });
  es.addEventListener("feed", (e) => JSON.parse(e.data).forEach(applyRecord));
  es.addEventListener("workers", (e) => onWorkers(JSON.parse(e.data)));
  es.onerror = () => setLive(false);  // EventSource reconnects by itself, and gets a fresh snapshot
}

function setLive(on) {
  S.live = on;
  $("conn").className = `conn ${on ? "on" : "off"}`;
  $("conn").textContent = on ? "live" : "reconnecting…";
}

async function main() {
  try {
    S.config = await api("/dashboard/api/config");
  } catch (err) {
    if (err.status === 401) return showLogin();
    throw err;
  }
  S.states = S.config.states;
  S.terminal = new Set(S.config.terminal);
  $("who").textContent = S.config.admin ? "admin key: every request" : "";
  const live = S.states.filter((s) => !S.terminal.has(s)), ended = S.states.filter((s) => S.terminal.has(s));
  $("filter").innerHTML += live.map((s) => `<option value="${s}">${s}</option>`).join("") +
    `<option value="${ENDED}">ended, last ${ENDED_KEEP_S} s</option>` +
    ended.map((s) => `<option value="${s}">${s} (last ${ENDED_KEEP_S} s)</option>`).join("");
  $("filter").onchange = (e) => { S.filter = e.target.value; S.dirty = true; };
  $("counts").onclick = (e) => {
    const st = e.target.closest(".count")?.dataset.state;
    if (st) { S.filter = S.filter === st ? "" : st; $("filter").value = S.filter; S.dirty = true; }
  };
  // mousedown, not click: the rows are redrawn twice a second, and a click needs the same element under both
  // halves of it.
  $("rows").onmousedown = (e) => {
    const rid = e.target.closest(".row")?.dataset.rid;
    if (rid) { S.selected = rid; S.dirty = true; loadDetail(rid); }
  };
  $("detail-close").onclick = () => { S.selected = null; $("detail").hidden = true; };
  $("detail-cancel").onclick = cancelSelected;
  makeCharts();
  connect();
  // Draw at most once a frame whatever the rate of transitions; the times in state tick with it.
  let lastTick = 0;
  const frame = (ts) => { if (S.dirty || ts - lastTick > 500) { lastTick = ts; renderTable(); } requestAnimationFrame(frame); };
  requestAnimationFrame(frame);
  $("scroller").addEventListener("scroll", () => renderTable(), { passive: true });
  // Token counts of the rows on screen: every ROWS_REFRESH_MS, sooner when a row appeared or ended.
  setInterval(() => { if (S.rowsSoon || Date.now() - (S.lastRows || 0) >= ROWS_REFRESH_MS) refreshRows(); }, 300);
}
main();
