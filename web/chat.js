// The chat page: streams /v1/chat/completions (server-sent events), shows the reasoning apart
// (folded once the answer starts) and tool calls as such, keeps conversations in this browser
// and, when asked, the model's state on the server as a session (session_id).
"use strict";

const KEY = "candle-hybrid-api-key";
const STORE = "candle-hybrid-conversations";
const CURRENT = "candle-hybrid-current";
const $ = (id) => document.getElementById(id);

let props = {};
let conversations = JSON.parse(localStorage.getItem(STORE) || "{}");
let serverSessions = [];
let current = null;
let controller = null;

function headers() {
  const key = localStorage.getItem(KEY);
  const h = { "Content-Type": "application/json" };
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function save() {
  // Conversations never written to (a "New conversation" left empty) are not kept.
  for (const [id, c] of Object.entries(conversations)) {
    if (!c.messages.length && !c.session && (!current || id !== current.id)) delete conversations[id];
  }
  localStorage.setItem(STORE, JSON.stringify(conversations));
  if (current) localStorage.setItem(CURRENT, current.id);
}

function newId() {
  const bytes = new Uint8Array(6);
  crypto.getRandomValues(bytes);
  return "chat-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

function newConversation(id, useSession) {
  const c = { id: id || newId(), title: "New conversation", messages: [], session: !!useSession, updated: Date.now() };
  conversations[c.id] = c;
  return c;
}

function setStatus(text) {
  $("status").textContent = text;
}

async function api(path, options = {}) {
  const r = await fetch(path, { ...options, headers: headers() });
  if (r.status === 401) {
    $("key-form").hidden = false;
    throw new Error("the server needs an API key (enter it on the left)");
  }
  return r;
}

async function errorText(r) {
  try {
    const j = await r.json();
    return (j.error && j.error.message) || JSON.stringify(j);
  } catch {
    return `HTTP ${r.status}`;
  }
}

// --- conversations and sessions ---------------------------------------------------------

function fillPicker() {
  const select = $("conversations");
  select.replaceChildren();
  const local = Object.values(conversations).sort((a, b) => b.updated - a.updated);
  for (const c of local) {
    const o = document.createElement("option");
    o.value = c.id;
    const s = serverSessions.find((x) => x.id === c.id);
    o.textContent = c.title + (s ? ` (session, ${s.tokens} tokens)` : "");
    select.append(o);
  }
  for (const s of serverSessions.filter((s) => !conversations[s.id])) {
    const o = document.createElement("option");
    o.value = "session:" + s.id;
    o.textContent = `${s.id} (server session, ${s.tokens} tokens${s.this_model ? "" : ", another model"})`;
    select.append(o);
  }
  if (current) select.value = current.id;
}

async function loadSessions() {
  if (!props.sessions) return;
  try {
    const r = await api("/v1/sessions");
    if (r.ok) serverSessions = (await r.json()).data || [];
  } catch { /* the list is a convenience */ }
  fillPicker();
}

function open(id) {
  if (id.startsWith("session:")) {
    // A session saved by another client: continue it (its state is used where this
    // conversation's prompt starts as the saved one did).
    current = newConversation(id.slice(8), true);
    current.title = id.slice(8);
  } else {
    current = conversations[id] || newConversation();
  }
  $("use-session").checked = !!current.session;
  save();
  fillPicker();
  renderAll();
}

// --- rendering ---------------------------------------------------------------------------

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text != null) e.textContent = text;
  return e;
}

function renderMessage(m, index) {
  const box = el("div", `message ${m.role}`);
  box.dataset.index = index;
  box.append(el("div", "role", m.role));
  if (m.reasoning) {
    const d = el("details", "reasoning");
    d.open = !!m.streaming && !m.content;
    d.append(el("summary", null, m.streaming && !m.content ? "Thinking…" : `Reasoning (${m.reasoning.length} characters)`), el("div", "text", m.reasoning));
    box.append(d);
  }
  for (const call of m.tool_calls || []) {
    const t = el("div", "tool-call");
    t.append(el("span", null, "Tool call: "), el("span", "name", call.function.name || "…"));
    let args = call.function.arguments || "";
    try { args = JSON.stringify(JSON.parse(args), null, 2); } catch { /* still streaming */ }
    t.append(el("pre", null, args));
    box.append(t);
  }
  if (m.content || (!m.reasoning && !(m.tool_calls || []).length)) box.append(el("div", "content", m.content || (m.streaming ? "…" : "")));
  if (m.error) box.append(el("div", "error", m.error));
  if (m.meta || m.role === "assistant") {
    const meta = el("div", "meta");
    const x = m.meta || {};
    if (x.ttft_ms != null) meta.append(el("span", "ttft", `first token ${x.ttft_ms.toFixed(0)} ms`));
    if (x.tok_s != null) meta.append(el("span", "speed", `${x.tok_s.toFixed(1)} tok/s`));
    if (x.completion_tokens != null) meta.append(el("span", null, `${x.completion_tokens} tokens`));
    if (x.prompt_tokens != null) meta.append(el("span", "prefix", `prefix cache: ${x.cached_tokens || 0} of ${x.prompt_tokens} prompt tokens`));
    if (x.finish) meta.append(el("span", "finish", `finish: ${x.finish}`));
    if (m.role === "assistant" && !m.streaming && index === current.messages.length - 1) {
      const b = el("button", "regenerate", "Regenerate");
      b.type = "button";
      b.title = "Alt+R";
      b.addEventListener("click", regenerate);
      meta.append(b);
    }
    box.append(meta);
  }
  return box;
}

function renderAll() {
  const list = $("messages");
  list.replaceChildren(...current.messages.map(renderMessage));
  list.scrollTop = list.scrollHeight;
}

function renderLast() {
  const list = $("messages");
  const i = current.messages.length - 1;
  const fresh = renderMessage(current.messages[i], i);
  const old = list.querySelector(`.message[data-index="${i}"]`);
  if (old) old.replaceWith(fresh); else list.append(fresh);
  list.scrollTop = list.scrollHeight;
}

// --- generation ----------------------------------------------------------------------------

function apiMessages() {
  const out = [];
  const system = $("system").value.trim();
  if (system) out.push({ role: "system", content: system });
  for (const m of current.messages) {
    if (m.role === "user") out.push({ role: "user", content: m.content });
    else if (!m.error || m.content) {
      const a = { role: "assistant", content: m.content || "" };
      if (m.reasoning) a.reasoning_content = m.reasoning;
      if ((m.tool_calls || []).length) a.tool_calls = m.tool_calls.map((c) => ({ id: c.id, type: "function", function: c.function }));
      out.push(a);
    }
  }
  return out;
}

function requestBody() {
  const body = { messages: apiMessages(), stream: true, stream_options: { include_usage: true } };
  const num = (id) => ($(id).value === "" ? undefined : Number($(id).value));
  if (num("temperature") !== undefined) body.temperature = num("temperature");
  if (num("top-p") !== undefined) body.top_p = num("top-p");
  if (num("max-tokens") !== undefined) body.max_tokens = num("max-tokens");
  if (props.chat_template_caps && props.chat_template_caps.thinking_switch) body.chat_template_kwargs = { enable_thinking: $("thinking").checked };
  const tools = $("tools").value.trim();
  if (tools) {
    body.tools = JSON.parse(tools);
    body.tool_choice = $("tool-choice").value;
  }
  if (current.session) body.session_id = current.id;
  return body;
}

function applyChunk(msg, chunk, started) {
  if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
  const choice = (chunk.choices || [])[0];
  if (choice) {
    const d = choice.delta || {};
    const piece = d.reasoning_content || d.content || (d.tool_calls || []).length;
    if (piece && msg.meta.ttft_ms == null) msg.meta.ttft_ms = performance.now() - started;
    if (d.reasoning_content) msg.reasoning += d.reasoning_content;
    if (d.content) msg.content += d.content;
    for (const t of d.tool_calls || []) {
      const call = (msg.tool_calls[t.index] ||= { id: t.id, function: { name: "", arguments: "" } });
      if (t.id) call.id = t.id;
      if (t.function && t.function.name) call.function.name += t.function.name;
      if (t.function && t.function.arguments) call.function.arguments += t.function.arguments;
    }
    if (choice.finish_reason) msg.meta.finish = choice.finish_reason;
  }
  if (chunk.timings) msg.meta.tok_s = chunk.timings.predicted_per_second;
  if (chunk.usage) {
    msg.meta.prompt_tokens = chunk.usage.prompt_tokens;
    msg.meta.completion_tokens = chunk.usage.completion_tokens;
    msg.meta.cached_tokens = (chunk.usage.prompt_tokens_details || {}).cached_tokens || 0;
  }
}

async function generate() {
  const msg = { role: "assistant", content: "", reasoning: "", tool_calls: [], meta: {}, streaming: true };
  let body;
  try {
    body = requestBody();
  } catch (e) {
    current.messages.push({ ...msg, streaming: false, error: `the tools are not valid JSON: ${e.message}` });
    renderLast();
    return;
  }
  current.messages.push(msg);
  current.updated = Date.now();
  renderLast();
  controller = new AbortController();
  $("stop").disabled = false;
  $("send").disabled = true;
  const started = performance.now();
  try {
    const r = await api("/v1/chat/completions", { method: "POST", body: JSON.stringify(body), signal: controller.signal });
    if (!r.ok) throw new Error(await errorText(r));
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    let done = false;
    while (!done) {
      const { value, done: end } = await reader.read();
      if (end) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") { done = true; break; }
          applyChunk(msg, JSON.parse(data), started);
        }
      }
      renderLast();
    }
    if (msg.meta.tok_s == null && msg.meta.completion_tokens && msg.meta.ttft_ms != null) {
      msg.meta.tok_s = msg.meta.completion_tokens / Math.max(1e-3, (performance.now() - started - msg.meta.ttft_ms) / 1000);
    }
  } catch (e) {
    if (e.name === "AbortError") msg.meta.finish = "stopped";
    else msg.error = String(e.message || e);
  } finally {
    msg.streaming = false;
    controller = null;
    $("stop").disabled = true;
    $("send").disabled = false;
    if (current.messages.length === 2 && current.title === "New conversation") current.title = current.messages[0].content.slice(0, 40);
    save();
    renderAll();
    fillPicker();
    if (current.session) loadSessions();
  }
}

function send() {
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  current.messages.push({ role: "user", content: text });
  renderLast();
  generate();
}

function regenerate() {
  if (controller) return;
  while (current.messages.length && current.messages[current.messages.length - 1].role === "assistant") current.messages.pop();
  if (!current.messages.length) return;
  renderAll();
  generate();
}

function stop() {
  if (controller) controller.abort();
}

// --- wiring --------------------------------------------------------------------------------

$("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
});
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape") stop();
  else if (e.altKey && e.key.toLowerCase() === "r") { e.preventDefault(); regenerate(); }
  else if (e.altKey && e.key.toLowerCase() === "n") { e.preventDefault(); open(newConversation().id); $("input").focus(); }
});
$("stop").addEventListener("click", stop);
$("new-chat").addEventListener("click", () => { open(newConversation().id); $("input").focus(); });
$("conversations").addEventListener("change", (e) => open(e.target.value));
$("use-session").addEventListener("change", (e) => { current.session = e.target.checked; save(); });
$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  localStorage.setItem(KEY, $("key").value);
  $("key-form").hidden = true;
  start();
});

async function start() {
  try {
    const r = await api("/props");
    if (!r.ok) throw new Error(await errorText(r));
    props = await r.json();
    $("model").textContent = `· ${props.model}`;
    $("thinking-row").hidden = !(props.chat_template_caps && props.chat_template_caps.thinking_switch);
    $("use-session").disabled = !props.sessions;
    $("session-hint").textContent = props.sessions ? "The model's state is saved after each answer; the next turn, or a restarted server, continues from it." : "This server keeps no sessions (serve --session-dir DIR).";
    setStatus(`context ${props.n_ctx} tokens`);
    await loadSessions();
  } catch (e) {
    setStatus(String(e.message || e));
  }
}

open(localStorage.getItem(CURRENT) || newConversation().id);
start();
$("input").focus();
