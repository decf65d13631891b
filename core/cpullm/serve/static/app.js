// cpullm chat page: streams answers from this server's /v1/chat/completions (server-sent events).
// No build step, no dependencies. Model text is only ever inserted as textContent.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { model: null, history: [], busy: false, abort: null };

function setState(s, text) {
  document.body.dataset.state = s;
  $("status").textContent = text || s;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function addMessage(role, text) {
  const el = document.createElement("div");
  el.className = "msg " + role;
  el.textContent = text;
  $("messages").appendChild(el);
  el.scrollIntoView({ block: "end" });
  return el;
}

async function errorText(resp) {
  try {
    const body = await resp.json();
    if (body && body.error) return body.error;
  } catch (e) { /* not JSON */ }
  return { message: "HTTP " + resp.status, code: null };
}

async function loadModel() {
  try {
    const resp = await fetch("/v1/models", { headers: headers() });
    if (!resp.ok) {
      const err = await errorText(resp);
      setState("error", resp.status === 401 ? "enter the API key" : err.message);
      return;
    }
    const body = await resp.json();
    state.model = body.data[0].id;
    $("model").textContent = state.model + "  (" + body.data[0].n_ctx + "-token context)";
    setState("idle", "ready");
  } catch (e) {
    setState("error", "server unreachable");
  }
}

function numberField(id, fallback, lo, hi) {
  const v = Number($(id).value);
  if (!Number.isFinite(v)) return fallback;
  return Math.min(hi, Math.max(lo, v));
}

function showStats(tokens, t0, tFirst, tEnd, live) {
  // decode speed: tokens after the first over the time since the first arrived
  let tps = 0;
  if (tFirst !== null && tokens > 1 && tEnd > tFirst) tps = (tokens - 1) / ((tEnd - tFirst) / 1000);
  else if (tokens > 0 && tEnd > t0) tps = tokens / ((tEnd - t0) / 1000);
  const ttft = tFirst !== null ? ((tFirst - t0) / 1000).toFixed(2) + " s to first token · " : "";
  $("stats").textContent = tokens + (tokens === 1 ? " token · " : " tokens · ") + tps.toFixed(1) +
    " tok/s" + (live ? "" : " · " + ttft.replace(/ · $/, ""));
  $("stats").dataset.tokens = String(tokens);
  $("stats").dataset.tps = tps.toFixed(3);
}

// The tools declared in the settings (a JSON list of OpenAI function tools), or null.
function declaredTools() {
  const raw = $("tools").value.trim();
  if (!raw) return null;
  const tools = JSON.parse(raw);
  if (!Array.isArray(tools)) throw new Error("Tools must be a JSON list of {type: 'function', function: {...}}");
  return tools;
}

// An assistant message's parts: thinking (collapsed), the answer's text, its tool calls.
function answerParts(el) {
  const parts = { el: el, content: document.createElement("span"), thinking: null, calls: [] };
  parts.content.className = "content";
  el.appendChild(parts.content);
  return parts;
}

function addThinking(parts, piece) {
  if (!parts.thinking) {
    const box = document.createElement("details");
    box.className = "thinking";
    const summary = document.createElement("summary");
    summary.textContent = "thinking";
    box.appendChild(summary);
    parts.thinkingText = document.createElement("div");
    box.appendChild(parts.thinkingText);
    parts.el.insertBefore(box, parts.content);
    parts.thinking = box;
  }
  parts.thinkingText.textContent += piece;
}

function addToolCall(parts, call) {
  const row = document.createElement("div");
  row.className = "tool-call";
  row.textContent = "\u2192 " + call.function.name + "(" + call.function.arguments + ")";
  parts.el.appendChild(row);
  parts.calls.push({ id: call.id, type: "function", function: call.function });
}

async function streamAnswer(messages, el) {
  const body = {
    model: state.model, messages: messages, stream: true, stream_options: { include_usage: true },
    temperature: numberField("temperature", 0.7, 0, 2),
    max_tokens: Math.round(numberField("max-tokens", 256, 1, 1e9)),
  };
  let tools;
  try {
    tools = declaredTools();
  } catch (e) {
    return { error: { message: "tools: " + e.message } };
  }
  if (tools) body.tools = tools;
  el.textContent = "";
  const parts = answerParts(el);
  state.abort = new AbortController();
  const t0 = performance.now();
  let tFirst = null, chunks = 0, text = "", finish = null, usage = null;
  const resp = await fetch("/v1/chat/completions", {
    method: "POST", headers: headers(), body: JSON.stringify(body), signal: state.abort.signal,
  });
  if (!resp.ok) return { error: await errorText(resp) };
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return { text, finish, usage, t0, tFirst, chunks, calls: parts.calls };
        const obj = JSON.parse(data);
        if (obj.error) return { error: obj.error, text };
        if (obj.usage) usage = obj.usage;
        const choice = obj.choices && obj.choices[0];
        if (!choice) continue;
        if (choice.finish_reason) finish = choice.finish_reason;
        const delta = choice.delta || {};
        const piece = delta.content, thought = delta.reasoning_content;
        if (piece || thought || delta.tool_calls) {
          if (tFirst === null) tFirst = performance.now();
          chunks += 1;
          if (piece) {
            text += piece;
            parts.content.textContent = text;
          }
          if (thought) addThinking(parts, thought);
          for (const call of delta.tool_calls || []) addToolCall(parts, call);
          el.scrollIntoView({ block: "end" });
          showStats(chunks, t0, tFirst, performance.now(), true);
        }
      }
    }
  }
  return { text, finish, usage, t0, tFirst, chunks, calls: parts.calls };
}

async function send(text) {
  if (state.busy || !text.trim()) return;
  if (!state.model) await loadModel();
  if (!state.model) return;
  state.busy = true;
  $("send").disabled = true;
  $("stop").disabled = false;
  setState("busy", "generating…");
  addMessage("user", text);
  state.history.push({ role: "user", content: text });
  const el = addMessage("assistant", "");
  let result;
  try {
    for (;;) {
      const system = $("system").value.trim();
      const messages = (system ? [{ role: "system", content: system }] : []).concat(state.history);
      result = await streamAnswer(messages, el);
      // the conversation outgrew the context: forget the oldest turn and ask again
      if (result.error && result.error.code === "context_length_exceeded" && state.history.length > 2) {
        state.history.splice(0, 2);
        addMessage("notice", "(context full: the oldest turn was dropped)");
        continue;
      }
      break;
    }
  } catch (e) {
    result = e.name === "AbortError" ? { text: el.textContent, finish: "stopped" } : { error: { message: String(e) } };
  }
  if (result.error) {
    state.history.pop();
    el.className = "msg error";
    el.textContent = "error: " + result.error.message;
    setState("idle", "error");
  } else {
    const tokens = result.usage ? result.usage.completion_tokens : result.chunks || 0;
    if (result.t0 !== undefined) showStats(tokens, result.t0, result.tFirst, performance.now(), false);
    const reply = { role: "assistant", content: result.text || "" };
    if (result.calls && result.calls.length) reply.tool_calls = result.calls;
    state.history.push(reply);
    el.dataset.done = "1";
    el.dataset.finish = result.finish || "";
    setState("idle", result.finish === "stopped" ? "stopped" : "ready");
  }
  state.busy = false;
  state.abort = null;
  $("send").disabled = false;
  $("stop").disabled = true;
}

document.addEventListener("DOMContentLoaded", () => {
  const saved = localStorage.getItem("cpullm.apiKey");
  if (saved) $("api-key").value = saved;
  $("api-key").addEventListener("change", () => {
    localStorage.setItem("cpullm.apiKey", $("api-key").value.trim());
    loadModel();
  });
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("prompt").value;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => { if (state.abort) state.abort.abort(); });
  $("reset").addEventListener("click", () => {
    if (state.abort) state.abort.abort();
    state.history = [];
    $("messages").textContent = "";
    $("stats").textContent = "";
  });
  loadModel();
});
