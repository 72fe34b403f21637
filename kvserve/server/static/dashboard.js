// kvserve's dashboard: polls /debug/kv_state once a second and draws it. No library, no build step.
"use strict";

const POLL_MS = 1000;
const FREE = ".", EVICTABLE = ":"; // block codes; any other is a tenant's letter (upper case: shared)
const COLOURS = { free: "#e3e7ec", evictable: "#8fb3d9", mark: "#1f2933" };
const root = document.getElementById("root");
const statusEl = document.getElementById("status");
const sections = new Map(); // replica key -> its <section>
let updates = 0;

// ---- formatting -------------------------------------------------------------------------------

const int = (n) => (n === null || n === undefined ? "–" : String(Math.round(n)));
const pct = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%");
const ms = (s) => (s === null || s === undefined ? "–" : (1000 * s).toFixed(1) + " ms");
const fixed1 = (x) => (x === null || x === undefined ? "–" : x.toFixed(1));

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}

function duration(s) {
  return s >= 90 ? Math.round(s / 60) + " min" : Math.round(s) + " s";
}

// A tenant's colour from its digest: the same digest, the same hue, on every replica and reload.
function tenantColour(digest) {
  let h = 0;
  if (/^[0-9a-f]{8}/.test(digest)) h = parseInt(digest.slice(0, 8), 16);
  else for (const c of digest) h = (h * 31 + c.charCodeAt(0)) >>> 0;
  // hue from the low bits, lightness from higher ones: two tenants of one hue still differ
  return `hsl(${h % 360}, 65%, ${38 + ((h >>> 12) % 4) * 8}%)`;
}

// ---- the block grid ---------------------------------------------------------------------------

function countBlocks(codes) {
  const n = { free: 0, evictable: 0, used: 0, shared: 0 };
  for (const c of codes) {
    if (c === FREE) n.free++;
    else if (c === EVICTABLE) n.evictable++;
    else { n.used++; if (c !== c.toLowerCase()) n.shared++; }
  }
  return n;
}

function drawGrid(canvas, pool, colourOf) {
  const codes = pool.blocks, n = codes.length;
  const card = canvas.parentElement, style = getComputedStyle(card);
  const width = Math.max(200, card.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight));
  const cell = Math.max(2, Math.min(16, Math.floor(Math.sqrt((width * 260) / Math.max(n, 1)))));
  const cols = Math.max(1, Math.floor(width / cell)), rows = Math.ceil(n / cols);
  const dpr = window.devicePixelRatio || 1, gap = cell >= 6 ? 1 : 0;
  canvas.width = cols * cell * dpr;
  canvas.height = rows * cell * dpr;
  canvas.style.width = cols * cell + "px";
  canvas.style.height = rows * cell + "px";
  const ctx = canvas.getContext("2d");
  ctx.scale(dpr, dpr);
  for (let i = 0; i < n; i++) {
    const c = codes[i], x = (i % cols) * cell, y = Math.floor(i / cols) * cell;
    ctx.fillStyle = c === FREE ? COLOURS.free : c === EVICTABLE ? COLOURS.evictable : colourOf(c.toLowerCase());
    ctx.fillRect(x, y, cell - gap, cell - gap);
    if (c !== FREE && c !== EVICTABLE && c !== c.toLowerCase()) { // shared: a dark core
      const m = Math.max(1, Math.floor(cell / 3));
      ctx.fillStyle = COLOURS.mark;
      ctx.fillRect(x + m, y + m, Math.max(1, cell - gap - 2 * m), Math.max(1, cell - gap - 2 * m));
    }
  }
  canvas.layout = { cell, cols, n };
}

function describeBlock(pool, tenants, i) {
  const c = pool.blocks[i];
  if (c === FREE) return `block ${i}: free`;
  if (c === EVICTABLE) return `block ${i}: cached, evictable`;
  const shared = c !== c.toLowerCase() ? ", shared" : "";
  return `block ${i}: in use by tenant ${tenants[c.toLowerCase()] || "?"}${shared}`;
}

function onHover(canvas, event) {
  const l = canvas.layout, info = canvas.info;
  if (!l || !info) return;
  const r = canvas.getBoundingClientRect();
  const i = Math.floor((event.clientY - r.top) / l.cell) * l.cols + Math.floor((event.clientX - r.left) / l.cell);
  const hover = canvas.closest(".card").querySelector('[data-field="pool.hover"]');
  hover.textContent = i >= 0 && i < l.n ? describeBlock(info.pool, info.tenants, i) : "\u00a0";
}

// ---- charts: SVG polylines over the last minutes ----------------------------------------------

function niceMax(values) {
  const m = Math.max(0, ...values.filter((v) => v !== null && Number.isFinite(v)));
  if (m <= 0) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(m)));
  return [1, 2, 5, 10].map((k) => k * p).find((v) => v >= m);
}

function lineChart(svg, title, t, series, fmt, max) {
  const W = 560, H = 120, L = 52, R = 8, T = 26, B = 16;
  const top = max ?? niceMax(series.flatMap((s) => s.values));
  const n = t.length, x = (i) => L + ((W - L - R) * i) / Math.max(n - 1, 1);
  const y = (v) => T + (H - T - B) * (1 - Math.min(v, top) / top);
  let out = `<text x="0" y="11">${title}</text>`;
  out += `<line class="axis" x1="${L}" y1="${T}" x2="${L}" y2="${H - B}"/>`;
  out += `<line class="axis" x1="${L}" y1="${H - B}" x2="${W - R}" y2="${H - B}"/>`;
  out += `<text x="${L - 4}" y="${T + 4}" text-anchor="end">${fmt(top)}</text>`;
  out += `<text x="${L - 4}" y="${H - B}" text-anchor="end">0</text>`;
  if (n > 1) out += `<text x="${L}" y="${H - 3}">−${duration(t[n - 1] - t[0])}</text>`;
  out += `<text x="${W - R}" y="${H - 3}" text-anchor="end">now</text>`;
  let lx = W - R;
  for (const s of [...series].reverse()) {
    out += `<text x="${lx}" y="11" text-anchor="end" style="fill:${s.colour}">${s.label}</text>`;
    lx -= 8 + 6.5 * s.label.length;
    let d = "", run = [];
    const flush = () => { // a lone second (a gap on either side) is a dot, not an invisible line
      if (run.length === 1) out += `<circle cx="${run[0][0]}" cy="${run[0][1]}" r="1.8" fill="${s.colour}"/>`;
      else if (run.length) d += run.map(([px, py], i) => `${i ? "L" : "M"}${px},${py}`).join("");
      run = [];
    };
    s.values.forEach((v, i) => {
      if (v === null || !Number.isFinite(v)) flush();
      else run.push([x(i).toFixed(1), y(v).toFixed(1)]);
    });
    flush();
    if (d) out += `<path d="${d}" fill="none" stroke="${s.colour}" stroke-width="1.6"/>`;
  }
  svg.innerHTML = out;
}

// ---- one replica's panel ----------------------------------------------------------------------

function section(key) {
  if (!sections.has(key)) {
    const node = document.getElementById("replica-template").content.firstElementChild.cloneNode(true);
    node.dataset.replica = key;
    const canvas = node.querySelector("canvas.grid");
    canvas.addEventListener("mousemove", (e) => onHover(canvas, e));
    root.appendChild(node);
    sections.set(key, node);
  }
  return sections.get(key);
}

function set(node, field, text) {
  for (const el of node.querySelectorAll(`[data-field="${field}"]`)) el.textContent = text;
}

function renderReplica(node, title, s) {
  set(node, "replica.title", title);
  const pool = s.pool, counts = countBlocks(pool.blocks);
  const tenants = Object.fromEntries(pool.tenants.map((t) => [t.letter, t.digest]));
  const colourOf = (letter) => tenantColour(tenants[letter] || "?");
  const canvas = node.querySelector("canvas.grid");
  canvas.info = { pool, tenants };
  drawGrid(canvas, pool, colourOf);
  // counted here from the codes the grid draws, not copied from the JSON's totals
  set(node, "pool.num_blocks", int(pool.num_blocks));
  set(node, "pool.block_size", int(pool.block_size));
  set(node, "pool.free", int(counts.free));
  set(node, "pool.evictable", int(counts.evictable));
  set(node, "pool.used", int(counts.used));
  set(node, "pool.shared", int(counts.shared));
  set(node, "pool.usage", pct(counts.used / Math.max(pool.blocks.length, 1)));
  renderTenants(node.querySelector("[data-tenants]"), pool.tenants);
  renderPrefix(node, s.prefix_cache, s.history);
  renderTiers(node, s.tiers);
  renderRequests(node, s);
  renderCharts(node, s.history);
}

function renderTenants(list, tenants) {
  list.replaceChildren(...tenants.map((t) => {
    const li = document.createElement("li");
    const sw = document.createElement("i");
    sw.className = "sw";
    sw.style.background = tenantColour(t.digest);
    li.append(sw, `${t.digest} `);
    const b = document.createElement("b");
    b.textContent = String(t.blocks);
    b.dataset.field = `tenant.${t.digest}`;
    li.append(b);
    return li;
  }));
}

function renderPrefix(node, p, history) {
  set(node, "prefix.kind", p.kind ? p.kind : "off");
  set(node, "prefix.cached_blocks", int(p.cached_blocks));
  set(node, "prefix.window", duration(history.window_s));
  set(node, "prefix.recent_hit_rate", pct(p.recent_hit_rate));
  set(node, "prefix.hit_rate", pct(p.hit_rate));
  set(node, "prefix.hits", int(p.hits));
  set(node, "prefix.queries", int(p.queries));
  set(node, "prefix.evictions", int(p.evictions));
  set(node, "prefix.external_hits", int(p.external_hits));
  set(node, "prefix.external_queries", int(p.external_queries));
}

const BREAKER = ["ok", "stepped aside", "trying again"];

function tierRow(prefix, cells) {
  const tr = document.createElement("tr");
  for (const [text, field] of cells) {
    const td = document.createElement("td");
    td.textContent = text;
    if (field) td.dataset.field = `${prefix}.${field}`;
    tr.append(td);
  }
  return tr;
}

// a sharded tier (Redis Cluster) gets a row per master under its own: hits, bytes read, errors, breaker
function shardRows(t) {
  return (t.shards || []).map((s) => tierRow(`tier.${t.name}.shard.${s.name}`, [
    [`  shard ${s.name}`, null],
    [`${bytes(s.read_bytes)} read, ${int(s.errors)} errors`, "read"],
    [int(s.hits), "hits"],
    [int(s.queries), "queries"],
    [BREAKER[s.breaker_state] || String(s.breaker_state), "state"],
  ]));
}

function renderTiers(node, tiers) {
  node.querySelector("table.tiers").hidden = tiers.length === 0;
  node.querySelector("[data-tiers]").replaceChildren(...tiers.flatMap((t) => [
    tierRow(`tier.${t.name}`, [
      [t.name, null],
      [t.capacity_bytes ? `${bytes(t.used_bytes)} of ${bytes(t.capacity_bytes)}` : bytes(t.used_bytes), "used"],
      [int(t.hits), "hits"],
      [int(t.queries), "queries"],
      [BREAKER[t.breaker_state] || String(t.breaker_state), null],
    ]),
    ...shardRows(t),
  ]));
}

function renderRequests(node, s) {
  const r = s.requests, h = s.history, lat = s.latency;
  set(node, "requests.running", int(r.running));
  set(node, "requests.waiting", int(r.waiting));
  set(node, "requests.loading", int(r.loading));
  set(node, "requests.preemptions", int(r.preemptions));
  const pd = s.handoffs;
  if (pd) {  // a router's own section has none
    set(node, "role", s.role);
    set(node, "handoffs.leases", int(pd.leases));
    set(node, "handoffs.sent_blocks", int(pd.sent_blocks));
    set(node, "handoffs.received_blocks", int(pd.received_blocks));
    set(node, "handoffs.sent_bytes", bytes(pd.sent_bytes));
    set(node, "handoffs.received_bytes", bytes(pd.received_bytes));
  }
  set(node, "requests.generation_tokens", int(r.generation_tokens));
  const last = h.generation_tps.length ? h.generation_tps[h.generation_tps.length - 1] : null;
  set(node, "requests.generation_tps", fixed1(last));
  set(node, "latency.ttft_count", int(lat.ttft.count));
  set(node, "latency.ttft_mean", ms(lat.ttft.count ? lat.ttft.sum / lat.ttft.count : null));
  set(node, "latency.itl_count", int(lat.itl.count));
  set(node, "latency.itl_mean", ms(lat.itl.count ? lat.itl.sum / lat.itl.count : null));
}

function renderCharts(node, h) {
  const chart = (name) => node.querySelector(`[data-chart="${name}"]`);
  const msFmt = (v) => (1000 * v).toFixed(v < 0.01 ? 1 : 0) + " ms";
  lineChart(chart("latency"), "TTFT and ITL (mean per second)", h.t, [
    { label: "TTFT", values: h.ttft, colour: "#d9534f" },
    { label: "ITL", values: h.itl, colour: "#5b8def" },
  ], msFmt);
  lineChart(chart("tps"), "tokens per second", h.t, [
    { label: "prompt", values: h.prompt_tps, colour: "#8e6cc9" },
    { label: "generated", values: h.generation_tps, colour: "#2e9e6a" },
  ], (v) => String(Math.round(v)));
  lineChart(chart("queue"), "requests", h.t, [
    { label: "running", values: h.running, colour: "#2e9e6a" },
    { label: "waiting", values: h.waiting, colour: "#e08a1e" },
    { label: "preempted", values: h.preemptions, colour: "#d9534f" },
  ], (v) => String(Math.round(v)));
  lineChart(chart("hit_rate"), "prefix hit rate and KV usage", h.t, [
    { label: "hit rate", values: h.hit_rate, colour: "#5b8def" },
    { label: "KV in use", values: h.kv_usage, colour: "#e08a1e" },
  ], (v) => Math.round(100 * v) + "%", 1);
}

// ---- the router -------------------------------------------------------------------------------

function renderRouter(data) {
  if (!sections.has("router")) {
    const node = document.getElementById("router-template").content.firstElementChild.cloneNode(true);
    node.dataset.replica = "router";
    root.prepend(node);
    sections.set("router", node);
  }
  const rows = data.replicas.map((r) => {
    const tr = document.createElement("tr");
    const cells = [
      [`${r.index}: ${r.url}`, "url"], [r.state, "state"], [int(r.in_flight), "in_flight"],
      [int(r.load_tokens), "load_tokens"], [int(r.routed), "routed"],
      [int(r.predicted_cached_tokens), "predicted_cached_tokens"],
      [int(r.reported_cached_tokens), "reported_cached_tokens"], [r.events || "none", "events"],
    ];
    for (const [text, field] of cells) {
      const td = document.createElement("td");
      td.textContent = text;
      td.dataset.field = `router.${r.index}.${field}`;
      if (field === "state") td.className = `state-${r.state}`;
      tr.append(td);
    }
    return tr;
  });
  sections.get("router").querySelector("[data-rows]").replaceChildren(...rows);
  for (const r of data.replicas) {
    const node = section(`replica-${r.index}`);
    const error = node.querySelector('[data-field="replica.error"]');
    error.hidden = !r.error;
    error.textContent = r.error || "";
    node.querySelector(".cards").hidden = !r.kv_state;
    if (r.kv_state) renderReplica(node, `Replica ${r.index}: ${r.url} (${r.state})`, r.kv_state);
    else set(node, "replica.title", `Replica ${r.index}: ${r.url} (${r.state})`);
  }
}

// ---- polling ----------------------------------------------------------------------------------

function render(data) {
  if (data.kind === "router") {
    renderRouter(data);
    set(document, "title", `router · ${data.replicas.length} replicas`);
  } else {
    renderReplica(section("replica"), `${data.model}`, data);
    set(document, "title", `${data.model} · step ${data.step}`);
    document.body.dataset.step = String(data.step);
  }
  updates++;
  document.body.dataset.updates = String(updates);
  statusEl.className = "";
  statusEl.textContent = `updated ${new Date((data.taken || Date.now() / 1000) * 1000).toLocaleTimeString()}`;
}

async function poll() {
  try {
    // location.origin: a page opened as http://user:key@host/ must not put credentials in its own URLs
    const response = await fetch(location.origin + "/debug/kv_state", { cache: "no-store" });
    if (response.status === 401) throw new Error("the API key is missing or wrong: reload and enter it");
    if (!response.ok) throw new Error(`/debug/kv_state answered ${response.status}`);
    render(await response.json());
  } catch (e) {
    statusEl.className = "error";
    statusEl.textContent = String(e.message || e);
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
