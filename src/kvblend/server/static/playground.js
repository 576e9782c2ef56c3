// kvblend playground: asks one question over some documents by blend and by full prefill,
// side by side, and shows which document tokens the blend recomputed ("kvblend": {"explain": true}).
// Public API only; the API key lives in this tab's sessionStorage. Every URL is relative to the
// page (the server's root, or a reverse proxy's path prefix): "v1/models", never "/v1/models".
"use strict";

const KEY = "kvblend.apiKey";
const $ = (sel, root = document) => root.querySelector(sel);
const $$ = (sel, root = document) => [...root.querySelectorAll(sel)];
const state = { model: null, runs: [], stored: {}, finished: 0, abort: null };

// ----- API ---------------------------------------------------------------------------------
class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

function headers(json) {
  const out = json ? { "Content-Type": "application/json" } : {};
  const key = sessionStorage.getItem(KEY);
  // fetch would throw a TypeError that names no field for a character outside ISO-8859-1: name it here.
  if (key && /[^\x20-\xff]/.test(key)) {
    throw new Error("the API key field holds a character an HTTP header cannot carry (only Latin-1 ones can be "
      + "sent): enter the key again, or Forget it");
  }
  if (key) out.Authorization = "Bearer " + key;
  return out;
}

async function apiError(res) {
  let message = res.statusText;
  try { message = (await res.json()).error.message || message; } catch (_) { /* not JSON */ }
  return new ApiError(res.status, message);
}

async function api(path, body, signal) {
  const init = body === undefined ? { headers: headers(false), signal }
    : { method: "POST", headers: headers(true), body: JSON.stringify(body), signal };
  const res = await fetch(path, init);
  if (!res.ok) throw await apiError(res);
  return res.json();
}

async function* sseData(res) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const line = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      if (line.startsWith("data: ")) yield line.slice(6);
    }
  }
}

function absorb(out, chunk, started, onText) {
  if (chunk.error) throw new ApiError(chunk.error.code, chunk.error.message);
  const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta.content;
  if (delta) {
    if (out.browserTtft === null) out.browserTtft = (performance.now() - started) / 1000;
    out.text += delta;
    onText(out.text);
  }
  const logprobs = chunk.choices && chunk.choices[0] && chunk.choices[0].logprobs;
  if (logprobs && logprobs.content) out.tokens.push(...logprobs.content);
  if (chunk.kvblend) {
    if (chunk.kvblend.explain) out.explain = chunk.kvblend.explain;
    out.kvblend = chunk.kvblend;
  }
  if (chunk.usage) out.usage = chunk.usage;
}

async function streamChat(body, onText, signal) {
  const started = performance.now();
  const res = await fetch("v1/chat/completions", {
    method: "POST", headers: headers(true), signal,
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
  });
  if (!res.ok) throw await apiError(res);
  const out = { text: "", kvblend: null, usage: null, explain: null, browserTtft: null, tokens: [] };
  for await (const data of sseData(res)) {
    if (data === "[DONE]") break;
    absorb(out, JSON.parse(data), started, onText);
  }
  // A body that stops before its last chunk (the server went away, a proxy cut it) has no numbers.
  if (!out.kvblend) throw new Error("the answer's stream ended before it finished (the server closed it)");
  return out;
}

// ----- key, banner, status -----------------------------------------------------------------
function showError(err) {
  const banner = $("#banner");
  const hint = err.status === 401 ? " — this server needs an API key: enter it above." : "";
  banner.textContent = (err.status ? `Error ${err.status}: ` : "Error: ") + err.message + hint;
  banner.hidden = false;
}

function clearError() { $("#banner").hidden = true; }
function status(text) { $("#status").textContent = text; }

function useKey(event) {
  event.preventDefault();
  const key = $("#api-key").value.trim();
  if (key) sessionStorage.setItem(KEY, key); else sessionStorage.removeItem(KEY);
  connect();
}

function forgetKey() {
  sessionStorage.removeItem(KEY);
  $("#api-key").value = "";
  connect();
}

async function connect() {
  clearError();
  try {
    const models = await api("v1/models");
    state.model = models.data[0].id;
    $("#model").textContent = "model: " + state.model;
    await pages.choices.first();
  } catch (err) {
    state.model = null;
    showError(err);
  }
}

// ----- documents ---------------------------------------------------------------------------
function removable(row) {
  const button = document.createElement("button");
  button.type = "button";
  button.textContent = "×";
  button.title = "remove";
  button.setAttribute("aria-label", "Remove this document");
  button.addEventListener("click", () => row.remove());
  return button;
}

function addTextDoc(text = "") {
  const row = document.createElement("div");
  row.className = "doc";
  const area = document.createElement("textarea");
  area.rows = 4;
  area.value = text;
  area.placeholder = "Paste a document";
  area.setAttribute("aria-label", "Document text");
  row.append(area, removable(row));
  $("#docs").append(row);
  return area;
}

function addStoredDoc(id, tokens) {
  const row = document.createElement("div");
  row.className = "doc stored";
  row.dataset.id = id;
  const name = document.createElement("span");
  name.className = "name";
  name.textContent = `stored: ${id} (${tokens} tokens)`;
  row.append(name, removable(row));
  $("#docs").append(row);
}

function documentsField() {
  return $$("#docs .doc").map((row) => row.dataset.id ? { id: row.dataset.id } : $("textarea", row).value.trim())
    .filter((doc) => doc && (doc.id || doc.length));
}

const PAGE = 100;  // stored documents per request: the next page comes on "Load more"

// One listing of the caller's stored documents, a page at a time by the `after` cursor: the Ask
// view's choices and the Store tab's table each keep one. `show(docs, first)` adds a page (`first`:
// the listing started again); a page that arrives after a newer first() is dropped. The button
// `more` asks for the next page; it shows while there is one.
class DocumentPages {
  constructor(show, more) { this.show = show; this.more = more; this.after = null; this.listing = 0; }

  first() {
    $(this.more).hidden = true;  // the next page of the listing before is not this one's
    return this.read(++this.listing, null);
  }

  async next() {
    $(this.more).disabled = true;
    try {
      return await this.read(this.listing, this.after);
    } finally {
      $(this.more).disabled = false;
    }
  }

  async read(listing, after) {  // true when the page was shown
    const docs = await api(`v1/documents?limit=${PAGE}` + (after ? "&after=" + encodeURIComponent(after) : ""));
    if (listing !== this.listing) return false;
    this.after = docs.last_id;
    $(this.more).hidden = !docs.has_more;
    this.show(docs, after === null);
    return true;
  }
}

const pages = {
  choices: new DocumentPages(showChoices, "#more-stored"),  // the Ask view's
  store: new DocumentPages(showStoreDocs, "#more-docs"),
};

async function nextPage(listing) {
  clearError();
  try {
    await listing.next();
  } catch (err) {
    showError(err);
  }
}

function showChoices(docs, first) {
  const select = $("#stored");
  if (first) {
    select.length = 1;
    state.stored = {};
  }
  for (const doc of docs.data) {
    select.add(new Option(`${doc.id} (${doc.tokens} tokens)`, doc.id));
    state.stored[doc.id] = doc;
  }
}

function pickStored() {
  const id = $("#stored").value;
  if (id) addStoredDoc(id, state.stored[id].tokens);
  $("#stored").value = "";
}

async function saveDocs() {
  clearError();
  try {
    const texts = documentsField().filter((doc) => typeof doc === "string");
    for (const text of texts) await api("v1/documents", { text });
    status(`${texts.length} document(s) stored under your key`);
    await pages.choices.first();
  } catch (err) {
    showError(err);
  }
}

function upload() {
  for (const file of $("#upload").files) file.text().then((text) => addTextDoc(text));
  $("#upload").value = "";
}

// ----- requests ----------------------------------------------------------------------------
function kvblendOptions(method, choice) {
  if (method === "full") return { method: "full" };
  const options = { method: "blend", ratio: choice.ratio, explain: true };
  if (choice.strategy === "cacheblend") Object.assign(options, CACHEBLEND);
  return options;
}

const CACHEBLEND = { selection: "deviation", budget: false, sinks: 0, shift: false };

function baseBody() {
  const question = $("#question").value.trim();
  if (!question) throw new Error("ask a question");
  const body = { model: state.model, messages: [{ role: "user", content: question }], temperature: 0,
    max_tokens: Number($("#max-tokens").value) || 32 };
  if ($("#use-retrieval").checked) body.retrieval = { top_k: Number($("#top-k").value) || 3 };
  else body.documents = documentsField();
  if (!body.retrieval && !body.documents.length) throw new Error("add at least one document");
  return body;
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function warm(body, signal) {
  // A document seen for the first time is a miss (computed and stored by that request, or
  // in the background with recompute_misses); send it (1 token) until every document is
  // served from the store.
  for (let attempt = 0; attempt < 8; attempt++) {
    const reply = await api("v1/chat/completions", { ...body, max_tokens: 1, kvblend: { method: "blend" } }, signal);
    if (!reply.kvblend.doc_misses) return;
    status(`storing the documents' KV… (${reply.kvblend.doc_misses} not stored yet)`);
    await sleep(150 * (attempt + 1));
  }
}

async function runOne(method, body, choice, signal) {
  const panel = $(`#answer-${method}`);
  for (const dd of $$("[data-field]", panel)) dd.textContent = "";
  const answer = field(panel, "text");
  answer.textContent = "…";
  answer.setAttribute("aria-busy", "true");  // a screen reader reads the answer once whole, not at every token
  try {
    const asked = { ...body, kvblend: kvblendOptions(method, choice), logprobs: true, top_logprobs: TOP_LOGPROBS };
    const reply = await streamChat(asked,
      (text) => { answer.textContent = text; }, signal);
    showMetrics(panel, reply);
    return reply;
  } finally {
    answer.setAttribute("aria-busy", "false");
  }
}

function clearResults() {
  for (const dd of $$("#answers [data-field]")) dd.textContent = "";
  $("#agreement").textContent = "";
  $("#doc-views").textContent = "";
}

async function run() {
  clearError();
  $("#run").disabled = true;
  state.abort = new AbortController();  // Stop: the server cancels a request whose client left
  const signal = state.abort.signal;
  $("#stop").hidden = false;
  try {
    if (!state.model) await connect();
    if (!state.model) return;
    const body = baseBody();
    // The controls as the run started: they may move while it runs, and the chart keeps what was sent.
    const choice = { ratio: Number($("#ratio").value), strategy: $("#strategy").value };
    clearResults();  // nothing of the run before stays beside this one's, should it fail
    if ($("#warm").checked && body.documents) await warm(body, signal);
    status("blend…");
    const blend = await runOne("blend", body, choice, signal);
    renderExplain(blend.explain);
    status("full prefill…");
    const full = await runOne("full", body, choice, signal);
    record(blend, full, choice);
    showTokenKl(blend, full);
    status("");
  } catch (err) {
    const stopped = signal.aborted;
    status(stopped ? "stopped" : "");
    for (const text of $$('#answers [data-field="text"]')) {
      if (text.textContent === "…") text.textContent = stopped ? "(stopped)" : "(failed)";
    }
    if (!stopped) showError(err);
  } finally {
    state.abort = null;
    $("#stop").hidden = true;
    $("#run").disabled = false;
  }
}

// ----- KL per answer token ----------------------------------------------------------------
const TOP_LOGPROBS = 20;  // the most OpenAI's API (and the server) return per token
const KL_SHOWN = 16;

// KL(full || blend) of the next-token distributions at each answer position where both
// answers had written the same tokens before it (a position after they part is not the
// same context), from the top logprobs each returned: full's top tokens, each at the
// blend's logprob for it, or at the lowest of the blend's list when not in it. Truncated
// to full's top 20, so approximate; a small negative sum is shown as 0.
function tokenKl(blendTokens, fullTokens) {
  const out = [];
  const n = Math.min(blendTokens.length, fullTokens.length);
  for (let i = 0; i < n; i++) {
    const b = blendTokens[i], f = fullTokens[i];
    if (!b.top_logprobs || !f.top_logprobs || !b.top_logprobs.length || !f.top_logprobs.length) break;
    const blendLp = new Map(b.top_logprobs.map((t) => [t.token, t.logprob]));
    const floor = Math.min(...b.top_logprobs.map((t) => t.logprob));
    let kl = 0;
    for (const t of f.top_logprobs) {
      const q = blendLp.has(t.token) ? blendLp.get(t.token) : floor;
      kl += Math.exp(t.logprob) * (t.logprob - q);
    }
    out.push(Math.max(0, kl));
    if (b.token !== f.token) break;  // the answers part here: later positions are other contexts
  }
  return out;
}

function showTokenKl(blend, full) {
  const dd = field($("#answer-blend"), "kl");
  const kls = tokenKl(blend.tokens, full.tokens);
  if (!kls.length) {
    dd.textContent = "n/a (no logprobs in the answers)";
    return;
  }
  const mean = kls.reduce((a, b) => a + b, 0) / kls.length;
  const shown = kls.slice(0, KL_SHOWN).map((x) => x.toFixed(4)).join(" · ") + (kls.length > KL_SHOWN ? " · …" : "");
  dd.textContent = `${shown} (mean ${mean.toFixed(4)} over ${kls.length} token${kls.length === 1 ? "" : "s"})`;
  dd.title = "KL(full ‖ blend) of the next-token distributions, from each answer's top " +
    `${TOP_LOGPROBS} logprobs, at each position both answers reached with the same tokens`;
}

// ----- numbers -----------------------------------------------------------------------------
const field = (root, name) => $(`[data-field="${name}"]`, root);
const ms = (s) => (s * 1000).toFixed(s < 0.1 ? 1 : 0) + " ms";
const pct = (x) => (100 * x).toFixed(1) + " %";

function hitsText(kv) {
  if (kv.method === "full") return "none: full prefill computes every token";
  const hits = Object.entries(kv.doc_hits || {}).map(([tier, n]) => `${tier} ×${n}`);
  const misses = kv.doc_misses ? [`missed ×${kv.doc_misses}`] : [];
  return [...hits, ...misses].join(", ") || "none (no documents reused)";
}

// The blend's own estimate of how much of plain reuse's KV error it left (0: none, 1: all of
// it), and whether it was in the top of its tenant's recent risks and recomputed again.
function riskText(kv) {
  if (kv.risk === undefined || kv.risk === null) {
    return kv.method === "blend" ? "not measured for this blend" : "none: no KV reused";
  }
  const again = kv.escalated ? " · escalated: recomputed again at twice the ratio" : " · not escalated";
  return `${kv.risk.toFixed(3)} of plain reuse's error left${again}`;
}

function showMetrics(panel, reply) {
  const kv = reply.kvblend;
  const browser = reply.browserTtft === null ? "" : ` · ${ms(reply.browserTtft)} in the browser`;
  field(panel, "label").textContent = kv.strategy ? `${kv.method}: ${kv.strategy}` : kv.method;
  field(panel, "ttft").textContent = ms(kv.ttft_s) + browser;
  field(panel, "recompute").textContent = pct(kv.recompute_fraction) + " of the prompt's token-layers";
  field(panel, "hits").textContent = hitsText(kv);
  field(panel, "risk").textContent = riskText(kv);
  const usage = reply.usage;
  field(panel, "cached").textContent = usage
    ? `${usage.prompt_tokens_details.cached_tokens} of ${usage.prompt_tokens}` : "";
}

function words(text) { return text.toLowerCase().match(/[\p{L}\p{N}]+/gu) || []; }

function tokenF1(a, b) {
  const x = words(a), y = words(b);
  if (!x.length || !y.length) return x.length === y.length ? 1 : 0;
  const counts = new Map();
  for (const w of y) counts.set(w, (counts.get(w) || 0) + 1);
  let common = 0;
  for (const w of x) if (counts.get(w) > 0) { common++; counts.set(w, counts.get(w) - 1); }
  if (!common) return 0;
  const p = common / x.length, r = common / y.length;
  return 2 * p * r / (p + r);
}

function record(blend, full, choice) {
  const f1 = tokenF1(blend.text, full.text);
  const run = { ratio: choice.ratio, strategy: choice.strategy, f1,
    ttftBlend: blend.kvblend.ttft_s, ttftFull: full.kvblend.ttft_s };
  const same = (r) => r.ratio === run.ratio && r.strategy === run.strategy;
  state.runs = [...state.runs.filter((r) => !same(r)), run];  // the latest run per ratio and strategy
  state.finished += 1;
  const verdict = blend.text.trim() === full.text.trim() ? "the same answer" : "different answers";
  $("#agreement").textContent = `Answer agreement with full prefill: token F1 ${f1.toFixed(2)} (${verdict}); `
    + `TTFT ${ms(run.ttftBlend)} vs ${ms(run.ttftFull)} (×${(run.ttftFull / run.ttftBlend).toFixed(2)}).`;
  drawChart(state.runs);
}

// ----- document view -----------------------------------------------------------------------
function tokenMaps(doc) {
  const sel = doc.selected || { positions: [], scores: [], by: [] };
  const kept = new Map(sel.positions.map((p, i) => [p, { score: sel.scores[i], by: sel.by[i] }]));
  const reused = new Map(((doc.reused || {}).positions || []).map((p, i) => [p, doc.reused.scores[i]]));
  const dev = doc.deviation || { positions: [], values: [] };
  const deviation = new Map(dev.positions.map((p, i) => [p, dev.values[i]]));
  return { kept, reused, deviation };
}

function maxOf(docs, pick) {
  let top = 0;
  for (const doc of docs) for (const v of pick(doc)) if (v !== null && v > top) top = v;
  return top || 1;
}

function fmt(x) { return x === null || x === undefined ? "n/a" : Number(x).toPrecision(3); }

function tokenSpan(text, at, offset, maps, scale, names) {
  const span = document.createElement("span");
  span.className = "tok";
  span.textContent = text;
  const kept = maps.kept.get(at), dev = maps.deviation.get(at);
  const parts = [`token ${offset + at}`];  // at: in its chunk; named by its place in the document
  if (kept) {
    span.classList.add("kept");
    if (/sink|sample/.test(kept.by)) span.classList.add("forced");
    const alpha = 0.18 + 0.82 * Math.max(0, Math.min(1, (kept.score || 0) / scale.score));
    span.style.backgroundColor = `rgba(217, 72, 15, ${alpha.toFixed(3)})`;
    parts.push(`recomputed, chosen by ${kept.by}`, `${names.score}: ${fmt(kept.score)}`);
  } else if (maps.reused.has(at)) {
    parts.push("reused", `${names.score}: ${fmt(maps.reused.get(at))}`);
  }
  if (dev !== undefined) parts.push(`${names.deviation}: ${fmt(dev)}`);
  if (dev !== undefined && !kept) {
    span.classList.add("measured");
    const alpha = 0.15 + 0.85 * Math.max(0, Math.min(1, (dev || 0) / scale.deviation));
    span.style.textDecorationColor = `rgba(28, 100, 200, ${alpha.toFixed(3)})`;
  }
  span.title = parts.join(" · ");
  return span;
}

function reasonCounts(chunks) {
  const counts = {};
  for (const c of chunks) for (const by of (c.selected || { by: [] }).by) counts[by] = (counts[by] || 0) + 1;
  return Object.entries(counts).map(([by, n]) => `${by} ${n}`).join(" · ");
}

function docHeader(origin, chunks, totalKept) {
  const kept = chunks.reduce((n, c) => n + (c.kept || 0), 0);
  const tokens = chunks.reduce((n, c) => n + c.n_tokens, 0);
  const share = totalKept ? kept / totalKept : 0;
  const head = document.createElement("h3");
  const bar = document.createElement("span");
  bar.className = "share";
  const fill = document.createElement("span");
  fill.style.width = (100 * share).toFixed(1) + "%";
  bar.append(fill);
  const sources = [...new Set(chunks.map((c) => c.source))].join(", ");
  head.append(`Document ${origin + 1}`, bar,
    `${pct(share)} of the recomputed tokens · ${kept} of ${tokens} tokens recomputed · KV: ${sources}`);
  const why = document.createElement("div");
  why.className = "muted";
  why.textContent = reasonCounts(chunks) ? "chosen by: " + reasonCounts(chunks) : "";
  return [head, why];
}

function docView(origin, chunks, totalKept, scale, names) {
  const box = document.createElement("div");
  box.className = "docview";
  const tokens = document.createElement("div");
  tokens.className = "tokens";
  for (const chunk of chunks) {
    const maps = tokenMaps(chunk);
    chunk.tokens.forEach((text, i) => tokens.append(tokenSpan(text, i, chunk.offset || 0, maps, scale, names)));
    if (chunk.truncated) tokens.append(Object.assign(document.createElement("span"),
      { className: "chunk-break", textContent: ` [… ${chunk.n_tokens - chunk.tokens.length} more tokens not shown]` }));
  }
  box.append(...docHeader(origin, chunks, totalKept), tokens);
  return box;
}

function renderExplain(explain) {
  const views = $("#doc-views");
  views.textContent = "";
  if (!explain) return;
  const names = { score: explain.score || "score", deviation: explain.deviation || "deviation" };
  $("#score-name").textContent = names.score;
  $("#deviation-name").textContent = names.deviation;
  const docs = explain.documents;
  const scale = { score: maxOf(docs, (d) => (d.selected || { scores: [] }).scores),
    deviation: maxOf(docs, (d) => (d.deviation || { values: [] }).values) };
  const totalKept = docs.reduce((n, d) => n + (d.kept || 0), 0);
  const groups = new Map();
  for (const doc of docs) groups.set(doc.origin, [...(groups.get(doc.origin) || []), doc]);
  for (const [origin, chunks] of groups) views.append(docView(origin, chunks, totalKept, scale, names));
}

// ----- chart (hand-drawn SVG) --------------------------------------------------------------
const SVG = "http://www.w3.org/2000/svg";
const BOX = { left: 56, right: 560, top: 20, bottom: 220 };

function svg(tag, attrs, text) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

function axes(chart, maxMs) {
  const { left, right, top, bottom } = BOX;
  chart.append(svg("line", { x1: left, y1: bottom, x2: right, y2: bottom, stroke: "#999" }),
    svg("line", { x1: left, y1: top, x2: left, y2: bottom, stroke: "#999" }),
    svg("line", { x1: right, y1: top, x2: right, y2: bottom, stroke: "#999" }));
  for (let i = 0; i <= 4; i++) {
    const y = bottom - (bottom - top) * i / 4, x = left + (right - left) * i / 4;
    chart.append(svg("text", { x: left - 6, y: y + 4, "text-anchor": "end" }, (maxMs * i / 4).toFixed(0)),
      svg("text", { x: right + 6, y: y + 4 }, (i / 4).toFixed(2)),
      svg("text", { x, y: bottom + 14, "text-anchor": "middle" }, (i / 4).toFixed(2)));
  }
  chart.append(svg("text", { x: (left + right) / 2, y: bottom + 30, "text-anchor": "middle" }, "recompute ratio"),
    svg("text", { x: 4, y: top - 8 }, "TTFT ms"), svg("text", { x: right - 30, y: top - 8 }, "agreement F1"));
}

function series(chart, points, color, shape) {
  const sorted = [...points].sort((a, b) => a[0] - b[0]);
  if (sorted.length > 1) {
    chart.append(svg("polyline", { points: sorted.map((p) => p.join(",")).join(" "), fill: "none",
      stroke: color, "stroke-width": 1.5 }));
  }
  for (const [x, y] of sorted) {
    chart.append(shape === "square" ? svg("rect", { x: x - 4, y: y - 4, width: 8, height: 8, fill: color })
      : svg("circle", { cx: x, cy: y, r: 4, fill: color }));
  }
}

function legend(chart) {
  const items = [["#1c64c8", "blend TTFT"], ["#999", "full prefill TTFT"], ["#d9480f", "agreement F1"]];
  items.forEach(([color, label], i) => {
    const x = BOX.left + i * 130;
    chart.append(svg("rect", { x, y: 262, width: 10, height: 10, fill: color }),
      svg("text", { x: x + 14, y: 271 }, label));
  });
  chart.append(svg("circle", { cx: BOX.left + 405, cy: 267, r: 4, fill: "#666" }),
    svg("text", { x: BOX.left + 413, y: 271 }, "blend"),
    svg("rect", { x: BOX.left + 455, y: 263, width: 8, height: 8, fill: "#666" }),
    svg("text", { x: BOX.left + 467, y: 271 }, "cacheblend"));
}

function drawChart(runs) {
  const chart = $("#chart");
  chart.textContent = "";
  chart.dataset.runs = state.finished;
  const maxMs = 1150 * Math.max(0, ...runs.flatMap((r) => [r.ttftBlend, r.ttftFull])) || 100;
  axes(chart, maxMs);
  const x = (ratio) => BOX.left + (BOX.right - BOX.left) * ratio;
  const yMs = (s) => BOX.bottom - (BOX.bottom - BOX.top) * (1000 * s) / maxMs;
  const yF1 = (f) => BOX.bottom - (BOX.bottom - BOX.top) * f;
  for (const strategy of ["blend", "cacheblend"]) {
    const mine = runs.filter((r) => r.strategy === strategy);
    const shape = strategy === "blend" ? "circle" : "square";
    series(chart, mine.map((r) => [x(r.ratio), yMs(r.ttftFull)]), "#999", shape);
    series(chart, mine.map((r) => [x(r.ratio), yMs(r.ttftBlend)]), "#1c64c8", shape);
    series(chart, mine.map((r) => [x(r.ratio), yF1(r.f1)]), "#d9480f", shape);
  }
  legend(chart);
}

// ----- store view --------------------------------------------------------------------------
function cells(tbody, values) {
  const tr = document.createElement("tr");
  for (const v of values) tr.append(Object.assign(document.createElement("td"), { textContent: v }));
  tbody.append(tr);
}

function bytes(n) {
  if (n === null || n === undefined) return "no cap";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

const rate = (x) => (x === null ? "n/a" : pct(x));

function showStoreDocs(docs, first) {
  const body = $("#store-docs tbody");
  if (first) body.textContent = "";
  for (const d of docs.data) {
    cells(body, [d.id, d.tokens, d.num_chunks, new Date(d.created * 1000).toLocaleString()]);
  }
  const none = "none yet: “store the pasted documents” on the Ask view";
  if (first && !docs.data.length) cells(body, [none, "", "", ""]);
}

async function loadStore() {
  clearError();
  try {  // a refresh starts the listing again: a page an earlier "Load more" brings back is dropped
    const [current, store] = await Promise.all([pages.store.first(), api("v1/kvblend/store")]);
    if (current) renderTiers(store);
  } catch (err) {
    showError(err);
  }
}

function renderTiers(store) {
  const body = $("#store-tiers tbody");
  body.textContent = "";
  for (const t of store.tiers) {
    const mine = t.tenant;
    cells(body, [t.name, `${bytes(t.used_bytes)} / ${bytes(t.capacity_bytes)}`, mine.entries, bytes(mine.bytes),
      `${mine.hits} / ${mine.misses}${mine.layer_hits ? ` (+${mine.layer_hits} layer reads)` : ""}`,
      rate(mine.hit_rate)]);
  }
  const l = store.lookups;
  $("#store-summary").textContent = `${store.documents.count} stored documents (${store.documents.tokens} tokens); `
    + `chunk lookups: ${l.hits} hits, ${l.misses} misses (hit rate ${rate(l.hit_rate)})`
    + (store.tenant_bytes_cap ? `; your cap per tier: ${bytes(store.tenant_bytes_cap)}` : "");
}

function showView(name) {
  for (const tab of $$("[role=tab]")) {
    const on = tab.dataset.view === name;
    tab.setAttribute("aria-selected", on);
    tab.tabIndex = on ? 0 : -1;  // one Tab stop for the tab list: the arrow keys move within it
  }
  $("#view-ask").hidden = name !== "ask";
  $("#view-store").hidden = name !== "store";
  if (name === "store") loadStore();
}

function tabKeys(event) {  // the WAI-ARIA tabs pattern: arrows to the previous or next tab, Home, End
  const tabs = $$("[role=tab]");
  const at = tabs.indexOf(event.target);
  const to = { ArrowLeft: at - 1, ArrowRight: at + 1, Home: 0, End: tabs.length - 1 }[event.key];
  if (to === undefined) return;
  event.preventDefault();
  const tab = tabs[(to + tabs.length) % tabs.length];
  tab.focus();
  showView(tab.dataset.view);
}

// ----- start -------------------------------------------------------------------------------
function bind() {
  $("#key-form").addEventListener("submit", useKey);
  $("#forget-key").addEventListener("click", forgetKey);
  $("#add-doc").addEventListener("click", () => addTextDoc().focus());
  $("#upload").addEventListener("change", upload);
  $("#save-docs").addEventListener("click", saveDocs);
  $("#stored").addEventListener("change", pickStored);
  $("#ratio").addEventListener("input", () => { $("#ratio-value").textContent = Number($("#ratio").value).toFixed(2); });
  $("#run").addEventListener("click", run);
  $("#stop").addEventListener("click", () => state.abort && state.abort.abort());
  $("#refresh-store").addEventListener("click", loadStore);
  $("#more-docs").addEventListener("click", () => nextPage(pages.store));
  $("#more-stored").addEventListener("click", () => nextPage(pages.choices));
  for (const tab of $$("[role=tab]")) tab.addEventListener("click", () => showView(tab.dataset.view));
  $("[role=tablist]").addEventListener("keydown", tabKeys);
}

function start() {
  bind();
  $("#api-key").value = sessionStorage.getItem(KEY) || "";
  addTextDoc();
  addTextDoc();
  drawChart([]);
  connect();
}

document.addEventListener("DOMContentLoaded", start);
