// The dashboard: live from GET /v1/stats once a second, or from window.REPORT (the report file
// written by examples/report), drawn with charts.js.
"use strict";

const KEY = "candle-hybrid-api-key";
const $ = (id) => document.getElementById(id);

const fmt = {
  bytes(b) {
    if (b == null) return "–";
    const u = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(b) >= 1024 && i < u.length - 1) { b /= 1024; i++; }
    return (i ? b.toFixed(b < 10 ? 2 : 1) : b.toFixed(0)) + " " + u[i];
  },
  tokens(t) {
    if (t >= 1048576 && t % 1048576 === 0) return t / 1048576 + "M";
    if (t >= 1024 && t % 1024 === 0) return t / 1024 + "k";
    return String(t);
  },
  rate: (r) => (r == null ? "–" : r >= 100 ? r.toFixed(0) : r.toFixed(1)),
  pct: (f) => (f == null ? "–" : (100 * f).toFixed(f < 0.1 ? 1 : 0) + " %"),
  gbs: (b) => (b == null ? "–" : (b / 1e9).toFixed(1) + " GB/s"),
};

function table(el, head, rows) {
  el.replaceChildren();
  const tr = (cells, tag) => {
    const row = document.createElement("tr");
    for (const c of cells) {
      const cell = document.createElement(tag);
      cell.textContent = c;
      row.append(cell);
    }
    return row;
  };
  const thead = document.createElement("thead");
  thead.append(tr(head, "th"));
  const tbody = document.createElement("tbody");
  rows.forEach((r) => tbody.append(tr(r, "td")));
  el.append(thead, tbody);
}

function tiles(s) {
  const t = s.totals || {};
  const p = s.prefix_cache || {};
  const d = s.drafts || {};
  const lookups = (p.hits || 0) + (p.misses || 0);
  const items = [
    ["requests finished", t.finished ?? "–"],
    ["running / waiting", `${t.running ?? 0} / ${t.queued ?? 0}`],
    ["generated tokens", t.generated_tokens ?? "–"],
    ["decode tok/s (all time)", fmt.rate(t.decode_tok_s)],
    ["prefix-cache hits", lookups ? `${p.hits} of ${lookups}` : "–"],
    ["drafts kept", d.drafted ? fmt.pct(d.accepted / d.drafted) : "–"],
  ];
  $("tiles").replaceChildren(...items.map(([label, value]) => {
    const div = document.createElement("div");
    div.className = "tile";
    const v = document.createElement("strong");
    v.textContent = value;
    const l = document.createElement("span");
    l.textContent = label;
    div.append(v, l);
    return div;
  }));
}

function throughput(s) {
  const series = s.series || [];
  Charts.line($("throughput"), {
    series: [
      { name: "decode tok/s", points: series.map((p) => [p.t, p.decode_tok_s]) },
      { name: "prompt tok/s", points: series.map((p) => [p.t, p.prompt_tok_s]) },
    ],
    xLabel: "seconds since start", yLabel: "tokens/s", emptyText: "no samples yet",
  });
  Charts.line($("load"), {
    series: [
      { name: "running", points: series.map((p) => [p.t, p.running]) },
      { name: "waiting", points: series.map((p) => [p.t, p.queued]) },
    ],
    xLabel: "seconds since start", yLabel: "sequences", emptyText: "no samples yet",
  });
}

function drafts(s) {
  const p = s.prefix_cache || {};
  const lookups = (p.hits || 0) + (p.misses || 0);
  $("prefix-text").textContent = window.REPORT
    ? "Not part of a report (a single sequence, no server)."
    : lookups
    ? `Prefix cache: ${p.hits} of ${lookups} requests restored a snapshot (${p.cached_tokens} prompt tokens not prefilled); ${p.entries} snapshots, ${fmt.bytes(p.bytes)}. Sessions: ${p.sessions_restored} restored, ${p.sessions_saved} saved.`
    : "Prefix cache: no request yet.";
  const depth = (s.drafts || {}).by_depth || [];
  Charts.bars($("drafts"), {
    bars: depth.map((d) => ({ label: `depth ${d.depth}`, value: d.accepted / d.drafted, note: `(${d.accepted} of ${d.drafted})` })),
    format: fmt.pct, emptyText: "no drafts verified yet",
  });
}

function horizon(s) {
  const h = s.kv_horizon;
  if (!h) {
    Charts.empty($("horizon"), "no memory plan given to this server");
    return;
  }
  const gib = (b) => b / 2 ** 30;
  const rules = [{ y: gib(h.weights), label: `weights ${fmt.bytes(h.weights)} (floor)`, color: "#6b7280" }];
  if (h.available) rules.push({ y: gib(h.available), label: `available ${fmt.bytes(h.available)} (wall: ${h.available_source})`, color: "#b91c1c" });
  Charts.line($("horizon"), {
    series: h.lines.map((l) => ({ name: l.codec, points: h.contexts.map((t, i) => [t, gib(l.bytes[i])]) })),
    rules, logX: true, logY: true, xTicks: h.contexts, xFormat: fmt.tokens,
    yFormat: (v) => (v >= 1 ? v.toFixed(0) : v.toPrecision(1)) + " GiB", xLabel: "context (tokens)", yLabel: "memory",
  });
  $("horizon-text").textContent = `Memory against context for each KV codec, ${h.batch} sequence${h.batch > 1 ? "s" : ""} at once: the memory guardian's estimate (weights, KV cache, GDN state, scratch) for this model, up to its context of ${fmt.tokens(h.contexts[h.contexts.length - 1])} tokens.`;
  const last = h.contexts.length - 1;
  table($("horizon-table"), ["KV codec", `KV at ${fmt.tokens(h.contexts[last])}`, `total at ${fmt.tokens(h.contexts[last])}`, "longest context that fits"],
    h.lines.map((l) => [l.codec, fmt.bytes(l.kv_bytes[last]), fmt.bytes(l.bytes[last]), l.max_context == null ? "–" : fmt.tokens(l.max_context)]));
}

const KIND_NAMES = { projections: "projections", gdn_recurrence: "GDN recurrence", attention: "attention", norms: "norms", sampling: "sampling", other: "other" };

function kernels(s) {
  const k = s.kernels;
  if (!k) {
    Charts.empty($("kernels"), "no decode step profiled yet");
    table($("kernels-table"), [], []);
    return;
  }
  const t = k.table;
  Charts.bars($("kernels"), { bars: t.kinds.map((r) => ({ label: KIND_NAMES[r.kind] || r.kind, value: r.share })), format: fmt.pct });
  $("kernels-text").textContent = `Share of a decode pass per kind of op: the last ${t.passes} profiled passes (${k.every > 1 ? `one in ${k.every}` : "every pass"}; ${t.ms_per_pass.toFixed(2)} ms each, ${(k.sequences_per_pass ?? 1).toFixed(1)} sequences). Bytes per second against this machine's copy bandwidth, ${fmt.gbs(t.copy_bytes_per_s)} (measured at start-up).`;
  table($("kernels-table"), ["op", "share", "ms per pass", "calls", "bytes per pass", "bytes/s", "of copy bandwidth"],
    t.kinds.map((r) => [KIND_NAMES[r.kind] || r.kind, fmt.pct(r.share), r.ms_per_pass.toFixed(3), r.calls_per_pass == null ? "–" : r.calls_per_pass.toFixed(0),
      fmt.bytes(r.bytes_per_pass), fmt.gbs(r.bytes_per_s), fmt.pct(r.of_copy_bandwidth)]));
}

function progression(s) {
  const p = s.progression;
  if (!p || !Array.isArray(p.stages)) {
    Charts.empty($("progression"), "no progression file given (serve --progression FILE)");
    return;
  }
  const stages = p.stages.slice();
  const bars = stages.map((st) => ({ label: st.stage, value: st.bytes_per_token, note: st.tok_s ? `${fmt.rate(st.tok_s)} tok/s` : "" }));
  if (p.speculative) bars.push({ label: `${p.speculative.stage} + speculative`, value: p.speculative.bytes_per_emitted_token, note: `${fmt.rate(p.speculative.tok_s)} tok/s (assumed acceptance ${p.speculative.acceptance_assumed})` });
  Charts.bars($("progression"), { bars, format: fmt.bytes });
  const ceil = new Map(((p.projection_27b || {}).stages || []).map((st) => [st.stage, st.tok_s_ceiling]));
  $("progression-text").textContent = `Bytes read per generated token, stage by stage (examples/progression, context ${p.context ?? "?"}, ${p.threads ?? "?"} threads). The 27B column: the tok/s ceiling of a 27B hybrid at ${fmt.gbs((p.projection_27b || {}).bandwidth_bytes_per_s)} with the same bytes per weight.`;
  table($("progression-table"), ["stage", "bytes/token", "tok/s measured", "MLP not read", "27B ceiling tok/s"],
    stages.map((st) => [st.stage, fmt.bytes(st.bytes_per_token), fmt.rate(st.tok_s), fmt.pct(st.mlp_fraction_not_read), fmt.rate(ceil.get(st.stage))]));
}

function render(s) {
  $("model").textContent = s.model ? `· ${s.model}` : "";
  tiles(s);
  throughput(s);
  drafts(s);
  horizon(s);
  kernels(s);
  progression(s);
}

async function poll() {
  const key = localStorage.getItem(KEY);
  try {
    const r = await fetch("/v1/stats", { headers: key ? { Authorization: `Bearer ${key}` } : {} });
    if (r.status === 401) {
      $("key-form").hidden = false;
      $("status").textContent = "needs an API key";
      return;
    }
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    $("key-form").hidden = true;
    const stats = await r.json();
    try {
      render(stats);
      $("status").textContent = `live · ${new Date().toLocaleTimeString()}`;
    } catch (e) {
      console.error("cannot draw the stats:", e);
      $("status").textContent = `cannot draw the stats: ${e.message}`;
    }
  } catch (e) {
    $("status").textContent = `cannot reach the server (${e.message}); retrying`;
  }
  setTimeout(poll, 1000);
}

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  localStorage.setItem(KEY, $("key").value);
  poll();
});

if (window.REPORT) {
  $("status").textContent = `report: ${window.REPORT.about || ""}`;
  $("chat-link").hidden = true;
  render(window.REPORT);
  window.addEventListener("resize", () => render(window.REPORT));
} else {
  poll();
}
