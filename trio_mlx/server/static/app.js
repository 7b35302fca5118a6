// The chat page: a multi-turn conversation with the server's model, streamed.
//
// The conversation lives in this page (messages go to /v1/chat/completions whole,
// each turn); the settings and the API key live in localStorage. Model text is
// rendered by markdown.js, which never treats it as HTML.

import { APIError, fetchModels, streamChat } from "./api.js";
import { renderMarkdown } from "./markdown.js";

const SETTINGS_KEY = "trio_mlx.settings";
const API_KEY = "trio_mlx.api_key";
const FIELDS = ["system", "temperature", "top_p", "max_tokens"];

const $ = (id) => document.getElementById(id);
const log = $("log");
const input = $("input");
const sendButton = $("send");
const stopButton = $("stop");

let model = null;          // the served model's id, from /v1/models
let history = [];          // [{role, content}] of this chat, without the system prompt
let controller = null;     // the AbortController of the answer streaming now

// ---- settings -------------------------------------------------------------

function loadSettings() {
  try {
    return JSON.parse(localStorage.getItem(SETTINGS_KEY)) || {};
  } catch (_) {
    return {};
  }
}

function saveSettings() {
  const settings = {};
  for (const name of FIELDS) settings[name] = $(name).value;
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(settings));
}

function showSettings() {
  const settings = loadSettings();
  for (const name of FIELDS) $(name).value = settings[name] ?? "";
}

function samplingParams() {
  const settings = loadSettings();
  const params = {};
  for (const [name, parse] of [["temperature", parseFloat], ["top_p", parseFloat], ["max_tokens", (v) => parseInt(v, 10)]]) {
    const raw = (settings[name] ?? "").toString().trim();
    if (raw !== "" && !Number.isNaN(parse(raw))) params[name] = parse(raw);
  }
  return params;
}

// ---- the API key ----------------------------------------------------------

const apiKey = () => localStorage.getItem(API_KEY) || "";

// Resolves true once the user gave a key, false if they cancelled.
function askForKey() {
  const dialog = $("key-dialog");
  $("key-input").value = "";
  return new Promise((resolve) => {
    const done = (ok) => {
      $("key-form").removeEventListener("submit", onSubmit);
      $("key-cancel").removeEventListener("click", onCancel);
      dialog.close();
      resolve(ok);
    };
    const onSubmit = (event) => {
      event.preventDefault();
      localStorage.setItem(API_KEY, $("key-input").value.trim());
      done(true);
    };
    const onCancel = () => done(false);
    $("key-form").addEventListener("submit", onSubmit);
    $("key-cancel").addEventListener("click", onCancel);
    dialog.showModal();
  });
}

// Runs `call(key)`; on a 401 asks for the key (once per failure) and tries again.
async function withKey(call) {
  for (;;) {
    try {
      return await call(apiKey());
    } catch (err) {
      if (!(err instanceof APIError) || err.status !== 401 || !(await askForKey())) throw err;
    }
  }
}

// ---- the conversation -----------------------------------------------------

function nearBottom() {
  return log.scrollHeight - log.scrollTop - log.clientHeight < 80;
}

function addMessage(kind, text) {
  $("empty")?.remove();
  const stick = nearBottom();
  const msg = document.createElement("div");
  msg.className = `msg ${kind}`;
  const body = document.createElement("div");
  body.className = "body";
  if (kind === "assistant") body.append(renderMarkdown(text));
  else body.textContent = text;
  msg.append(body);
  log.append(msg);
  if (stick) log.scrollTop = log.scrollHeight;
  return msg;
}

function showError(err) {
  const text = err instanceof APIError ? err.describe() : `Something went wrong: ${err.message || err}`;
  addMessage("error", text);
}

function setStreaming(on) {
  document.body.dataset.state = on ? "streaming" : "idle";
  sendButton.hidden = on;
  stopButton.hidden = !on;
  if (!on) input.focus();
}

function statsLine({ started, first, ended, usage, pieces, finishReason, stopped }) {
  const parts = [];
  if (stopped) parts.push("stopped");
  if (first !== null) parts.push(`TTFT ${((first - started) / 1000).toFixed(2)} s`);
  const tokens = usage ? usage.completion_tokens : pieces;
  if (first !== null && tokens > 1 && ended > first) {
    // Tokens after the first over the time they took: the decode rate, as the server measures it.
    parts.push(`${((tokens - 1) / ((ended - first) / 1000)).toFixed(1)} tok/s`);
  }
  if (usage) parts.push(`${usage.prompt_tokens} prompt + ${usage.completion_tokens} answer tokens`);
  else parts.push(`~${pieces} answer tokens`);
  if (finishReason && finishReason !== "stop") parts.push(`finish: ${finishReason}`);
  return parts.join(" · ");
}

async function ask(text) {
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const msg = addMessage("assistant", "");
  msg.classList.add("streaming");
  const body = msg.querySelector(".body");
  const meta = document.createElement("div");
  meta.className = "meta";
  msg.append(meta);

  const system = (loadSettings().system || "").trim();
  const messages = system ? [{ role: "system", content: system }, ...history] : history.slice();
  const stats = { started: performance.now(), first: null, ended: null, usage: null, pieces: 0,
                  finishReason: null, stopped: false };
  let answer = "";
  let pending = false;
  const paint = () => {
    pending = false;
    const stick = nearBottom();
    body.replaceChildren(renderMarkdown(answer));
    if (stick) log.scrollTop = log.scrollHeight;
  };

  controller = new AbortController();
  setStreaming(true);
  try {
    const result = await withKey((key) => streamChat(
      { model: model || undefined, messages, ...samplingParams() },
      {
        key,
        signal: controller.signal,
        onDelta: (piece) => {
          if (stats.first === null) stats.first = performance.now();
          stats.pieces += 1;
          answer += piece;
          if (!pending) {
            pending = true;
            requestAnimationFrame(paint);
          }
        },
      }));
    stats.usage = result.usage;
    stats.finishReason = result.finishReason;
  } catch (err) {
    if (err.name === "AbortError") stats.stopped = true;
    else {
      if (!answer) msg.remove();
      showError(err);
    }
  } finally {
    controller = null;
    stats.ended = performance.now();
    paint();
    msg.classList.remove("streaming");
    meta.textContent = statsLine(stats);
    setStreaming(false);
  }
  if (answer) history.push({ role: "assistant", content: answer });
  else history.pop(); // refused, or stopped before a word: the turn is not part of the conversation
}

function newChat() {
  controller?.abort();
  history = [];
  log.replaceChildren();
  const empty = document.createElement("p");
  empty.id = "empty";
  empty.className = "empty";
  empty.textContent = "New chat. Ask the model something.";
  log.append(empty);
  input.focus();
}

// ---- wiring ---------------------------------------------------------------

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = input.value.trim();
  if (!text || controller) return;
  input.value = "";
  ask(text);
});

input.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});

stopButton.addEventListener("click", () => controller?.abort());
$("new-chat").addEventListener("click", newChat);

$("open-settings").addEventListener("click", () => {
  const drawer = $("settings");
  drawer.hidden = !drawer.hidden;
  if (!drawer.hidden) showSettings();
});
$("settings-form").addEventListener("input", saveSettings);
$("settings-form").addEventListener("submit", (event) => {
  event.preventDefault();
  saveSettings();
  $("settings").hidden = true;
});
$("forget-key").addEventListener("click", () => localStorage.removeItem(API_KEY));
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && !$("settings").hidden) $("settings").hidden = true;
});

showSettings();
withKey(fetchModels).then((models) => {
  model = models.length ? models[0].id : null;
  $("model").textContent = model || "no model";
  document.title = model ? `${model} · trio_mlx` : "trio_mlx chat";
}, (err) => {
  $("model").textContent = "unavailable";
  showError(err);
});
input.focus();
