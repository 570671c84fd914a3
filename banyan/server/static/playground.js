// banyan playground: a chat page over the server's own OpenAI API, no dependencies, nothing fetched from elsewhere.
// The API key lives in this tab only (sessionStorage) and travels in the Authorization header, never in a URL.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_SLOT = "banyan-playground-key";
const METRICS_EVERY_MS = 2000;
const history = [];  // {role, content} of the conversation so far
let running = null;  // the AbortController of the reply being streamed

// -- the API ----------------------------------------------------------------------------------
function headers(extra = {}) {
  const key = $("api-key").value.trim();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function apiError(response) {
  try {
    const body = await response.json();
    return body.error ? `${response.status}: ${body.error.message}` : `${response.status}`;
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

async function loadModels() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (!response.ok) throw new Error(`models: ${await apiError(response)}`);
  const select = $("model");
  const chosen = select.value;
  select.replaceChildren(...(await response.json()).data.map((card) => new Option(card.id, card.id)));
  if ([...select.options].some((o) => o.value === chosen)) select.value = chosen;
}

// One chat completion, streamed: each SSE event is `data: {chunk}`; the last is `data: [DONE]`.
async function* streamChat(body, signal) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST", signal, headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(body),
  });
  if (!response.ok) throw new Error(await apiError(response));
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffered = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffered += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffered.indexOf("\n\n")) >= 0) {
      const event = buffered.slice(0, end);
      buffered = buffered.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        yield chunk;
      }
    }
  }
}

// -- the request from the settings --------------------------------------------------------------
function number(id) {
  const text = $(id).value.trim();
  return text === "" ? undefined : Number(text);
}

function responseFormat() {
  const text = $("schema").value.trim();
  $("schema-error").hidden = true;
  if (!text) return undefined;
  try {
    return { type: "json_schema", json_schema: { name: "playground", schema: JSON.parse(text), strict: true } };
  } catch (e) {
    $("schema-error").textContent = `The schema is not JSON: ${e.message}`;
    $("schema-error").hidden = false;
    throw e;
  }
}

function requestBody() {
  const system = $("system").value.trim();
  const messages = system ? [{ role: "system", content: system }, ...history] : [...history];
  return {
    model: $("model").value || undefined, messages, stream: true, stream_options: { include_usage: true },
    temperature: number("temperature"), top_p: number("top_p"), max_tokens: number("max_tokens"), seed: number("seed"),
    response_format: responseFormat(),
  };
}

// -- the conversation ----------------------------------------------------------------------------
function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `message ${role}`;
  div.textContent = text;  // text, never HTML: the model's output is not trusted markup
  $("messages").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function showUsage(usage, seconds, firstTokenSeconds) {
  const cached = usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0;
  // decode speed: the tokens after the first, over the time after the first
  const decoding = usage.completion_tokens > 1 && seconds > firstTokenSeconds
    ? ` · ${((usage.completion_tokens - 1) / (seconds - firstTokenSeconds)).toFixed(1)} tokens/s` : "";
  $("usage").textContent = `prompt ${usage.prompt_tokens} tokens (${cached} cached) · completion ` +
    `${usage.completion_tokens} tokens · first token ${(firstTokenSeconds * 1000).toFixed(0)} ms${decoding}`;
}

async function send(text) {
  let body;
  try {
    history.push({ role: "user", content: text });
    body = requestBody();
  } catch {
    history.pop();
    return;
  }
  addMessage("user", text);
  const reply = addMessage("assistant", "");
  reply.classList.add("streaming");
  $("error").hidden = true;
  running = new AbortController();
  setBusy(true);
  const start = performance.now();
  let first = null, finish = null;
  try {
    for await (const chunk of streamChat(body, running.signal)) {
      const choice = chunk.choices.length ? chunk.choices[0] : { delta: {} };
      if (choice.delta.content) {
        if (first === null) first = performance.now();
        reply.textContent += choice.delta.content;
        reply.scrollIntoView({ block: "end" });
      }
      finish = choice.finish_reason || finish;
      if (chunk.usage) showUsage(chunk.usage, (performance.now() - start) / 1000, ((first ?? start) - start) / 1000);
    }
    if (finish === "length") noteCutShort(reply, body);
    history.push({ role: "assistant", content: reply.textContent });
  } catch (e) {
    if (e.name !== "AbortError") showError(e.message);
    history.pop();
  } finally {
    reply.classList.remove("streaming");
    running = null;
    setBusy(false);
  }
}

// A reply that ran into max_tokens (or the context) says so: structured output cut there is not valid JSON.
function noteCutShort(reply, body) {
  const note = document.createElement("p");
  note.className = "notice";
  const limit = body.max_tokens === undefined ? "the context's length" : `max_tokens (${body.max_tokens})`;
  note.textContent = `Cut short at ${limit}` + (body.response_format ? ": the JSON is incomplete." : ".");
  reply.after(note);
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = false;
}

// -- the live panel: the server's own numbers from /metrics ---------------------------------------
function parseMetrics(text) {
  const sums = {};
  for (const line of text.split("\n")) {
    const match = /^(banyan:[a-z_]+)(\{[^}]*\})?\s+(\S+)/.exec(line);
    if (match) sums[match[1]] = (sums[match[1]] || 0) + Number(match[3]);
  }
  return sums;
}

let lastScrape = null;
async function refreshLive() {
  try {
    const response = await fetch("/metrics", { headers: headers() });
    if (!response.ok) return;
    const now = { at: performance.now(), m: parseMetrics(await response.text()) };
    const m = now.m;
    $("live-queue").textContent = `${m["banyan:num_requests_running"] ?? 0} / ${m["banyan:num_requests_waiting"] ?? 0}`;
    $("live-kv").textContent = `${((m["banyan:kv_cache_usage_perc"] ?? 0) * 100).toFixed(1)}%`;
    if (lastScrape) {
      const seconds = (now.at - lastScrape.at) / 1000;
      const grew = (name) => (m[name] ?? 0) - (lastScrape.m[name] ?? 0);
      $("live-tps").textContent = (grew("banyan:generation_tokens_total") / seconds).toFixed(1);
      const count = grew("banyan:time_to_first_token_seconds_count");
      if (count > 0) $("live-ttft").textContent = `${((grew("banyan:time_to_first_token_seconds_sum") / count) * 1000).toFixed(0)} ms`;
    }
    lastScrape = now;
  } catch {
    // the server is away for a moment: keep the last numbers
  }
}

// -- wiring -----------------------------------------------------------------------------------------
function start() {
  $("api-key").value = sessionStorage.getItem(KEY_SLOT) || "";
  $("api-key").addEventListener("change", () => {
    sessionStorage.setItem(KEY_SLOT, $("api-key").value.trim());
    loadModels().then(() => { $("error").hidden = true; }, (e) => showError(e.message));
  });
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || running) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => running && running.abort());
  $("clear").addEventListener("click", () => {
    history.length = 0;
    $("messages").replaceChildren();
    $("usage").textContent = "";
  });
  loadModels().catch((e) => showError(`${e.message}${$("api-key").value ? "" : " (enter the API key)"}`));
  refreshLive();
  setInterval(refreshLive, METRICS_EVERY_MS);
}

start();
