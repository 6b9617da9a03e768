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

// Money, in the usage document's `currency` (an ISO 4217 code). An amount the gateway did not
// send (one that predates pricing, or a budget it does not keep) reads as a dash.
const NONE = "\u2014";

function money(n, currency) {
  if (typeof n !== "number" || !Number.isFinite(n)) return NONE;
  const a = Math.abs(n);
  // The currency's own decimals (cents; none for yen), except that an amount under 1 the
  // cents would round keeps two significant digits ($0.016, not $0.02); from 10k up, compact.
  const cents = a >= 1 || Math.round(a * 100) / 100 === Number(a.toPrecision(2));
  const opts = a >= 1e4 ? { notation: "compact", maximumFractionDigits: 1 }
    : cents ? {} : { maximumSignificantDigits: 2 };
  try {
    return new Intl.NumberFormat("en-US", { ...opts, style: "currency", currency }).format(n);
  } catch (err) { // no currency, or not a code Intl knows: the number, then the code
    const plain = cents ? { minimumFractionDigits: 2, maximumFractionDigits: 2 } : {};
    return new Intl.NumberFormat("en-US", { ...plain, ...opts }).format(n)
      + (currency ? " " + currency : "");
  }
}

// Whether a usage document carries money: the gateway prices requests once it sends these.
function priced(doc) {
  return typeof doc.currency === "string" || (doc.data || []).some((r) => "cost" in r);
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

function stackedBars(target, labels, series, colors, format = fmt) {
  // series: [{name, values}] stacked per label; `format` writes an amount (axis, tooltips).
  const totals = labels.map((_, i) => series.reduce((s, x) => s + x.values[i], 0));
  const max = Math.max(...totals) || 1; // money may be all under 1
  // The left margin holds the longest axis label (7 units a character at 11px is generous).
  const W = 460, H = 200, B = 28, T = 8;
  const L = 10 + 7 * Math.max(...[0, 1, 2, 3, 4].map((g) => format(max * g / 4).length));
  const bw = (W - L - 8) / Math.max(1, labels.length);
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img",
                            "data-bars": String(totals.filter((t) => t > 0).length) });
  for (let g = 0; g <= 4; g++) {
    const y = T + (H - B - T) * (1 - g / 4);
    root.append(svg("line", { x1: L, x2: W, y1: y, y2: y, stroke: "#e3e6ee" }));
    root.append(svg("text", { x: L - 4, y: y + 4, "text-anchor": "end" }, format(max * g / 4)));
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
        rect.append(svg("title", {}, `${label} ${s.name}: ${format(s.values[i])}`));
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

const COLORS = ["#2f6fed", "#f29d38", "#2e9d5b", "#8e5cd9", "#c8362f", "#17a2b8"];

// The stacks of each chart: a name and the row's amount.
const TOKENS = [["prompt", (r) => r.prompt_tokens], ["completion", (r) => r.completion_tokens]];
// A day's spend: what `auto` requests cost, and the rest (a model named in the request).
// Not per model: an escalated request's auto_cost counts under the pool that answered, its
// cost under each pool it ran on.
const SPEND_BY_DAY = [["model named", (r) => Math.max(0, (r.cost || 0) - (r.auto_cost || 0))],
                      ["auto", (r) => r.auto_cost || 0]];
const SPEND = [["spend", (r) => r.cost]];

function dayChart(target, rows, endS, stacks, format) {
  const first = Math.floor(endS / DAY) - 13;
  const days = [...Array(14).keys()].map((i) => (first + i) * DAY);
  const by = new Map(rows.map((r) => [r.day, r]));
  const labels = days.map((d) => new Date(d * 1000).toISOString().slice(5, 10));
  stackedBars(target, labels, stacks.map(([name, f]) => (
    { name, values: days.map((d) => (by.has(d) ? f(by.get(d)) || 0 : 0)) })), COLORS, format);
}

function modelChart(target, rows, stacks, format) {
  stackedBars(target, rows.map((r) => r.model), stacks.map(([name, f]) => (
    { name, values: rows.map((r) => f(r) || 0) })), COLORS, format);
}

// Tokens and, where the gateway prices requests, money: per day and per model.
function charts(days, models, endS) {
  dayChart($("chart-day"), days.data, endS, TOKENS, fmt);
  modelChart($("chart-model"), models.data, TOKENS, fmt);
  const cur = (n) => money(n, days.currency || models.currency);
  $("spend-day-section").hidden = !priced(days);
  if (priced(days)) dayChart($("chart-spend-day"), days.data, endS, SPEND_BY_DAY, cur);
  $("spend-model-section").hidden = !priced(models);
  if (priced(models)) modelChart($("chart-spend-model"), models.data, SPEND, cur);
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

// A bar of `share` (0..1, clamped); `cls` colours it ("warn", "high"); a tick at `markAt`.
function meter(share, cls, markAt) {
  const node = el("div", { class: "meter" });
  const bar = el("div");
  bar.style.width = (Math.min(1, Math.max(0, share)) * 100).toFixed(1) + "%";
  if (cls) bar.classList.add(cls);
  node.append(bar);
  if (markAt != null) {
    const tick = el("i");
    tick.style.left = `min(${(Math.max(0, markAt) * 100).toFixed(1)}%, 100% - 2px)`;
    node.append(tick);
  }
  return node;
}

const PERIODS = { day: "spend today", month: "spend this month" };

// The budget as a row of the limits table: its bar runs to the hard limit (the soft one where
// there is no hard one), with a tick at the soft limit.
function budgetRow(b, currency) {
  const cur = (n) => money(n, currency);
  const label = b.period === "rolling" ? `spend, last ${b.window_days ?? "?"} days`
    : PERIODS[b.period] || "spend";
  const spent = b.spent || 0;
  const scale = b.hard || b.soft;
  const name = el("div", { "data-testid": "budget" }, label);
  if (scale) {
    const share = spent / scale;
    const soft = b.hard && b.soft != null ? b.soft / b.hard : null;
    const cls = share >= 1 ? "high" : soft != null && share >= soft ? "warn" : "";
    name.append(meter(share, cls, soft));
  }
  const remaining = b.hard == null ? "unlimited"
    : cur(typeof b.remaining === "number" ? b.remaining : b.hard - spent);
  return [name, b.hard == null ? "none" : cur(b.hard), cur(b.spent), remaining];
}

function budgetNote(b, currency) {
  const note = $("budget-note");
  note.hidden = !b;
  if (!b) return;
  const parts = [];
  if (b.soft != null) parts.push(`soft limit ${money(b.soft, currency)}`);
  if (b.spend_target != null) parts.push(`spend target ${money(b.spend_target, currency)}`);
  if (b.resets_at) {
    const at = new Date(b.resets_at * 1000).toISOString().slice(5, 16).replace("T", " ");
    parts.push(`resets ${at} UTC`);
  }
  note.textContent = parts.join(" \u00b7 ");
  note.hidden = !parts.length;
}

// `budget`: the usage document's budget (null or absent: the tenant has none, or the gateway
// keeps none), its amounts in `currency`.
function limits(doc, budget, currency) {
  const L = doc.limits || {};
  const rows = [
    ["tokens per minute", L.tokens_per_minute, doc.tokens_this_minute],
    ["tokens per day", L.tokens_per_day, doc.tokens_today],
    ["requests per minute", L.requests_per_minute, doc.requests_this_minute],
    ["concurrent requests", L.max_concurrent, doc.concurrent_requests],
    ["context per request", L.max_context, null],
  ].map(([name, limit, used]) => {
    const share = limit ? (used || 0) / limit : 0;
    const remaining = limit == null ? "unlimited" : used == null ? "-" : fmt(limit - used);
    // The bar sits under the limit's name: a column of its own would not fit a phone.
    return [used == null ? name : el("div", {}, name, meter(share, share > 0.8 ? "high" : "")),
            limit == null ? "none" : fmt(limit), used == null ? "-" : fmt(used), remaining];
  });
  if (budget) rows.unshift(budgetRow(budget, currency));
  table($("limits"), ["limit", "value", "used", "remaining"], rows, ["", "num", "num", "num"]);
  budgetNote(budget, currency);
}

// -- routing -------------------------------------------------------------------------------

const pct = (x) => (x * 100).toFixed(x > 0 && x < 0.1 ? 1 : 0) + "%";
const count = (n) => (typeof n === "number" ? fmt(n) : NONE);

function sum(rows, field) {
  const have = rows.filter((r) => typeof r[field] === "number");
  return have.length ? have.reduce((s, r) => s + r[field], 0) : null;
}

// `model: auto` over the rows of a group_by=model document: how its requests split between the
// pools, how many escalated or overflowed, and what they cost against all-large and
// all-small (the document's `savings`, else the rows' sums). Hidden for a gateway that
// predates these fields.
function routing(doc) {
  const rows = (doc.data || []).filter((r) => typeof r.auto_requests === "number");
  $("routing-section").hidden = !rows.length && !("savings" in doc);
  const total = sum(rows, "auto_requests") || 0;
  if (!total) {
    $("routing").replaceChildren(el("div", { class: "note" }, "No auto requests in the last 7 days."));
    return;
  }
  const served = rows.filter((r) => r.auto_requests > 0);
  const split = el("div", { class: "split", "data-testid": "routing-split" });
  const legend = el("div", { class: "legend" });
  served.forEach((r, k) => {
    const share = r.auto_requests / total;
    const part = el("span", { title: `${r.model}: ${pct(share)}` });
    part.style.width = (share * 100).toFixed(2) + "%";
    part.style.background = COLORS[k % COLORS.length];
    const swatch = el("b");
    swatch.style.background = part.style.background;
    split.append(part);
    legend.append(el("span", {}, swatch, `${r.model} ${pct(share)}`));
  });
  // Each pool's share is in the legend: four columns fit the narrowest card (400 px).
  const counts = el("table", { "data-testid": "routing-table" });
  table(counts, ["pool", "requests", "escalated", "overflowed"], [
    ...served.map((r) => [r.model, fmt(r.auto_requests), count(r.auto_escalated),
                          count(r.auto_overflowed)]),
    ["total", fmt(total), count(sum(rows, "auto_escalated")), count(sum(rows, "auto_overflowed"))],
  ], ["name", "num", "num", "num"]);
  $("routing").replaceChildren(split, legend, el("div", { class: "scroll" }, counts),
                               ...autoCost(doc, rows));
}

function autoCost(doc, rows) {
  const s = doc.savings || {};
  const pick = (v, field) => (typeof v === "number" ? v : sum(rows, field));
  const ways = [
    ["as routed", pick(s.spent, "auto_cost")],
    ["all on the large pool", pick(s.all_large, "auto_cost_if_all_large")],
    ["all on the small pool", pick(s.all_small, "auto_cost_if_all_small")],
  ];
  if (ways.every(([, v]) => v == null)) return [];
  const max = Math.max(...ways.map(([, v]) => v || 0));
  const cost = el("table", { "data-testid": "routing-cost" });
  table(cost, ["auto requests cost", "amount"], ways.map(([name, v]) => [
    el("div", {}, name, meter(max > 0 ? (v || 0) / max : 0, name === "as routed" ? "" : "warn")),
    money(v, doc.currency)]), ["", "num"]);
  const [[, routed], [, large]] = ways;
  const out = [el("h3", {}, "What auto cost"), cost];
  if (routed != null && large) {
    const saved = large - routed;
    out.push(el("div", { class: "note", "data-testid": "routing-saved" },
                `${saved >= 0 ? "saved" : "cost"} ${money(Math.abs(saved), doc.currency)} `
                + `(${pct(Math.abs(saved) / large)}) against all on the large pool`));
  }
  return out;
}

// A cost column where the gateway prices requests (its lines carry `cost`).
function recent(lines, currency) {
  const priced = lines.some((r) => "cost" in r);
  const cost = (r) => (priced ? [money(r.cost, currency)] : []);
  table($("recent"), ["time (UTC)", "model", "route", "status", "prompt", "cached",
                      "completion", ...(priced ? ["cost"] : []), "latency ms", "key id"],
        lines.map((r) => [new Date(r.time * 1000).toISOString().slice(5, 19).replace("T", " "),
                          r.model, r.route, r.status, r.prompt_tokens, r.cached_tokens,
                          r.completion_tokens, ...cost(r), r.latency_ms, r.key_id]),
        ["time", "name", "name", "num", "num", "num", "num", ...(priced ? ["num"] : []), "num",
         "name"]);
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
    const tenant = $("tenant-select").value;
    const q = `/admin/usage?tenant=${encodeURIComponent(tenant)}`;
    const [days, models, cur] = await Promise.all([
      api(`${q}&group_by=day&start=${start}`), api(`${q}&group_by=model&start=${now - 7 * DAY}`),
      api(`${q}&group_by=model&recent=20&start=${now - 3600}`)]);
    charts(days, models, now);
    const c = cur.current[tenant] || {};
    limits(c, c.budget !== undefined ? c.budget : cur.budget, cur.currency);
    routing(models);
    recent((cur.recent || {})[tenant] || [], cur.currency);
    fleet(await api("/admin/fleet"));
  } else {
    const [days, models] = await Promise.all([
      api(`/v1/usage?group_by=day&start=${start}&recent=20`),
      api(`/v1/usage?group_by=model&start=${now - 7 * DAY}&recent=0`)]);
    charts(days, models, now);
    limits(days, days.budget, days.currency);
    routing(models);
    recent(days.recent, days.currency);
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
