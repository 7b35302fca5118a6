// The page's HTTP side: the server's own OpenAI-compatible API, streamed over SSE with fetch.
//
// streamChat() posts to /v1/chat/completions with stream_options.include_usage and calls
// back per text delta; an AbortSignal cancels the fetch, which closes the connection, and
// the server aborts the request (its slot is freed within one decode step).

export class APIError extends Error {
  constructor(status, message, code, retryAfter) {
    super(message);
    this.status = status;
    this.code = code;
    this.retryAfter = retryAfter;
  }

  // What the page shows: readable first, the server's own words after.
  describe() {
    const wait = this.retryAfter ? ` Try again in ${this.retryAfter} s.` : "";
    if (this.status === 401) return `The server wants an API key (401): ${this.message}`;
    if (this.status === 429) return `The server is busy (429): ${this.message}.${wait}`;
    if (this.status === 503) return `The server is unavailable (503): ${this.message}.${wait}`;
    if (this.code === "context_length_exceeded") {
      return `This conversation no longer fits in the model's context: ${this.message}. ` +
        "Start a new chat or lower max tokens in the settings.";
    }
    if (this.status === 0) return `Could not reach the server: ${this.message}`;
    return `Error ${this.status}: ${this.message}`;
  }
}

function headers(key) {
  const h = { "Content-Type": "application/json" };
  if (key) h["Authorization"] = `Bearer ${key}`;
  return h;
}

async function errorOf(resp) {
  let message = resp.statusText || "request failed";
  let code = null;
  try {
    const body = await resp.json();
    if (body && body.error) {
      message = body.error.message || message;
      code = body.error.code || null;
    }
  } catch (_) { /* not JSON: keep the status text */ }
  return new APIError(resp.status, message, code, resp.headers.get("Retry-After"));
}

async function send(url, init) {
  try {
    return await fetch(url, init);
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new APIError(0, err.message || String(err), null, null);
  }
}

export async function fetchModels(key) {
  const resp = await send("/v1/models", { headers: headers(key) });
  if (!resp.ok) throw await errorOf(resp);
  return (await resp.json()).data || [];
}

// Streams one answer. `onDelta(text)` gets each piece of content; resolves with
// {usage, finishReason} (usage null when the server sent none).
export async function streamChat(body, { key, signal, onDelta }) {
  const resp = await send("/v1/chat/completions", {
    method: "POST",
    headers: headers(key),
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    signal,
  });
  if (!resp.ok) throw await errorOf(resp);
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let usage = null;
  let finishReason = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue; // ": ping" comments while queued
        const data = line.slice(5).trim();
        if (data === "[DONE]") return { usage, finishReason };
        const chunk = JSON.parse(data);
        if (chunk.error) {
          throw new APIError(chunk.error.code === "aborted" ? 503 : 500, chunk.error.message,
            chunk.error.code, null);
        }
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const text = choice.delta && choice.delta.content;
          if (text) onDelta(text);
          if (choice.finish_reason) finishReason = choice.finish_reason;
        }
      }
    }
  }
  return { usage, finishReason };
}
