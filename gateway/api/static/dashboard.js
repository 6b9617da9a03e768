// The /dashboard page: no build step, no external code. Charts are inline SVG.
// The key lives in sessionStorage (this tab only) and travels in the Authorization header.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "switchyard.key";
const DAY = 86400;
let session = null; // {key, admin, tenant}
let timer = null;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(c));
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function fmt(n) {
  if (n === null || n === undefined) return "-";
  const a = Math.abs(n);
  if (a >= 1e9) return (n / 1e9).toFixed(1) + "G";
  if (a >= 1e6) return (n / 1e6).toFixed(1) + "M";
  if (a >= 1e4) return (n / 1e3).toFixed(1) + "k";
  return String(Math.round(n * 100) / 100);
}

// A label cut to `width` (SVG user units) with an ellipsis; the whole of it goes in a <title>.
// Measured once the chart is in the page; before that (a hidden page) nothing is cut.
function fitLabel(text, width) {
  const full = text.textContent;
  if (text.getComputedTextLength() <= width) return;
  let lo = 0, hi = full.length - 1; // the longest prefix that fits with the ellipsis
  while (lo < hi) {
    const mid = Math.ceil((lo + hi) / 2);
    text.textContent = full.slice(0, mid) + "\u2026";
    if (text.getComputedTextLength() <= width) lo = mid; else hi = mid - 1;
  }
  text.textContent = full.slice(0, lo) + "\u2026";
  text.append(svg("title", {}, full));
}

async function api(path) {
  const r = await fetch(path, { headers: { authorization: "Bearer " + session.key } });
  if (r.status === 401) throw Object.assign(new Error("the key was refused"), { status: 401 });
  if (!r.ok) throw new Error(path + ": HTTP " + r.status);
  return r.json();
}

// -- charts --------------------------------------------------------------------------------

function stackedBars(target, labels, series, colors) {
  // series: [{name, values}] stacked per label.
  const totals = labels.map((_, i) => series.reduce((s, x) => s + x.values[i], 0));
  const max = Math.max(1, ...totals);
  // The left margin holds the longest axis label (7 units a character at 11px is generous).
  const W = 460, H = 200, B = 28, T = 8;
  const L = 10 + 7 * Math.max(...[0, 1, 2, 3, 4].map((g) => fmt(max * g / 4).length));
  const bw = (W - L - 8) / Math.max(1, labels.length);
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img",
                            "data-bars": String(totals.filter((t) => t > 0).length) });
  for (let g = 0; g <= 4; g++) {
    const y = T + (H - B - T) * (1 - g / 4);
    root.append(svg("line", { x1: L, x2: W, y1: y, y2: y, stroke: "#e3e6ee" }));
    root.append(svg("text", { x: L - 4, y: y + 4, "text-anchor": "end" }, fmt(max * g / 4)));
  }
  const xLabels = [];
  labels.forEach((label, i) => {
    let y = H - B;
    series.forEach((s, k) => {
      const h = (H - B - T) * s.values[i] / max;
      if (h > 0) {
        y -= h;
        const rect = svg("rect", { x: L + i * bw + 2, y, width: Math.max(1, bw - 4), height: h,
                                   fill: colors[k], class: "bar" });
        rect.append(svg("title", {}, `${label} ${s.name}: ${s.values[i]}`));
        root.append(rect);
      }
    });
    if (labels.length <= 8 || i % 2 === (labels.length - 1) % 2) {
      const text = svg("text", { x: L + i * bw + bw / 2, y: H - 10, "text-anchor": "middle" },
                       label);
      xLabels.push(text);
      root.append(text);
    }
  });
  // Every other label shows when there are many: each may take two bars' width.
  const room = (labels.length <= 8 ? bw : 2 * bw) - 4;
  const legend = el("div", { class: "legend" });
  series.forEach((s, k) => {
    const sw = el("b"); sw.style.background = colors[k];
    legend.append(sw, s.name);
  });
  target.replaceChildren(root, legend);
  for (const text of xLabels) fitLabel(text, room);
}

const COLORS = ["#2f6fed", "#f29d38", "#2e9d5b"];

function dayChart(rows, endS) {
  const first = Math.floor(endS / DAY) - 13;
  const days = [...Array(14).keys()].map((i) => (first + i) * DAY);
  const by = new Map(rows.map((r) => [r.day, r]));
  const labels = days.map((d) => new Date(d * 1000).toISOString().slice(5, 10));
  const pick = (f) => days.map((d) => (by.get(d) || {})[f] || 0);
  stackedBars($("chart-day"), labels, [
    { name: "prompt", values: pick("prompt_tokens") },
    { name: "completion", values: pick("completion_tokens") },
  ], COLORS);
}

function modelChart(rows) {
  stackedBars($("chart-model"), rows.map((r) => r.model), [
    { name: "prompt", values: rows.map((r) => r.prompt_tokens) },
    { name: "completion", values: rows.map((r) => r.completion_tokens) },
  ], COLORS);
}

// -- tables --------------------------------------------------------------------------------

// kinds: a class per column: "num" (right-aligned, never wraps), "name" (an id or name: wraps
// anywhere, so a long one cannot widen its card), "time" (never wraps) or "".
function table(target, headers, rows, kinds) {
  const cls = (i) => (kinds[i] ? { class: kinds[i] } : {});
  const head = el("tr", {}, ...headers.map((h, i) =>
    el("th", kinds[i] === "num" ? { class: "num" } : {}, h)));
  const body = rows.map((r) => el("tr", {}, ...r.map((c, i) =>
    el("td", cls(i), c instanceof Node ? c : String(c)))));
  target.replaceChildren(head, ...body);
}

function limits(doc) {
  const L = doc.limits || {};
  const rows = [
    ["tokens per minute", L.tokens_per_minute, doc.tokens_this_minute],
    ["tokens per day", L.tokens_per_day, doc.tokens_today],
    ["requests per minute", L.requests_per_minute, doc.requests_this_minute],
    ["concurrent requests", L.max_concurrent, doc.concurrent_requests],
    ["context per request", L.max_context, null],
  ].map(([name, limit, used]) => {
    const meter = el("div", { class: "meter" });
    const bar = el("div");
    const share = limit ? Math.min(1, (used || 0) / limit) : 0;
    bar.style.width = (share * 100).toFixed(1) + "%";
    if (share > 0.8) bar.classList.add("high");
    meter.append(bar);
    const remaining = limit == null ? "unlimited" : used == null ? "-" : fmt(limit - used);
    // The bar sits under the limit's name: a column of its own would not fit a phone.
    return [used == null ? name : el("div", {}, name, meter), limit == null ? "none" : fmt(limit),
            used == null ? "-" : fmt(used), remaining];
  });
  table($("limits"), ["limit", "value", "used", "remaining"], rows, ["", "num", "num", "num"]);
}

function recent(lines) {
  table($("recent"), ["time (UTC)", "model", "route", "status", "prompt", "cached",
                      "completion", "latency ms", "key id"],
        lines.map((r) => [new Date(r.time * 1000).toISOString().slice(5, 19).replace("T", " "),
                          r.model, r.route, r.status, r.prompt_tokens, r.cached_tokens,
                          r.completion_tokens, r.latency_ms, r.key_id]),
        ["time", "name", "name", "num", "num", "num", "num", "num", "name"]);
}

function fleet(doc) {
  const s = (v) => (v == null ? "-" : v < 1 ? (v * 1000).toFixed(0) + " ms"
    : v.toFixed(v < 10 ? 2 : 1) + " s");
  table($("fleet"), ["pool", "queue", "TTFT p50", "TTFT p99", "tokens/s", "replicas ready"],
        Object.entries(doc).map(([name, p]) => [name, fmt(p.waiting), s(p.ttft_p50_s),
          s(p.ttft_p99_s), fmt(p.tokens_per_s), `${p.ready_replicas} / ${p.workers.length}`]),
        ["name", "num", "num", "num", "num", "num"]);
}

// -- loading -------------------------------------------------------------------------------

async function loadTenant() {
  const now = Date.now() / 1000;
  const start = Math.floor(now / DAY - 13) * DAY;
  if (session.admin) {
    const t = encodeURIComponent($("tenant-select").value);
    const q = `/admin/usage?tenant=${t}`;
    const [days, models, cur] = await Promise.all([
      api(`${q}&group_by=day&start=${start}`), api(`${q}&group_by=model&start=${now - 7 * DAY}`),
      api(`${q}&group_by=model&recent=20&start=${now - 3600}`)]);
    dayChart(days.data, now);
    modelChart(models.data);
    const c = cur.current[$("tenant-select").value] || {};
    limits(c);
    recent((cur.recent || {})[$("tenant-select").value] || []);
    fleet(await api("/admin/fleet"));
  } else {
    const [days, models] = await Promise.all([
      api(`/v1/usage?group_by=day&start=${start}&recent=20`),
      api(`/v1/usage?group_by=model&start=${now - 7 * DAY}&recent=0`)]);
    dayChart(days.data, now);
    modelChart(models.data);
    limits(days);
    recent(days.recent);
  }
  document.body.dataset.loaded = String(Date.now());
}

async function signIn(key) {
  session = { key, admin: false };
  try {
    const doc = await api("/v1/usage?recent=0&group_by=model");
    session.tenant = doc.tenant_id;
  } catch (err) {
    if (err.status !== 401) throw err;
    const doc = await api("/admin/usage?group_by=model"); // 401 again: a wrong key
    session.admin = true;
    const select = $("tenant-select");
    select.replaceChildren(...Object.keys(doc.current).map((t) => el("option", { value: t }, t)));
    $("tenant-pick").hidden = false;
    $("fleet-section").hidden = false;
  }
  sessionStorage.setItem(STORE, key);
  $("who").textContent = session.admin ? "admin" : "tenant " + session.tenant;
  $("signin").hidden = true;
  $("app").hidden = false;
  await loadTenant();
  timer = setInterval(() => loadTenant().catch(show), 3000);
}

function show(err) {
  $("signin-error").textContent = err.message;
  if (err.status === 401) signOut(err.message);
}

function signOut(message) {
  clearInterval(timer);
  sessionStorage.removeItem(STORE);
  session = null;
  $("app").hidden = true;
  $("signin").hidden = false;
  $("signin-error").textContent = message || "";
}

$("signin-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const key = $("key").value.trim();
  $("key").value = "";
  signIn(key).catch((err) => signOut(err.status === 401 ? "the key was refused" : err.message));
});
$("signout").addEventListener("click", () => signOut());
$("tenant-select").addEventListener("change", () => loadTenant().catch(show));
if (sessionStorage.getItem(STORE)) signIn(sessionStorage.getItem(STORE)).catch(show);
