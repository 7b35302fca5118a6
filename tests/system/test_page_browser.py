"""The chat page in a real headless Chromium against a real server (tests/browser.py).

Each test drives the page as a user would: type, send, watch tokens arrive, press
Stop, reload. Answers that the tiny random model cannot give (hostile Markdown,
server errors) are played to the page with Playwright's request routing, so the
page's own parsing and rendering handle exactly the bytes a server would send.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from browser import ServerProcess, open_browser
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from playwright.sync_api import expect

# Waits use selectors and expect(), never page.wait_for_function with a string: that evals
# JavaScript, which the page's CSP (rightly) forbids.
CHAT = "/v1/chat/completions"
expect.set_options(timeout=15_000)  # a busy CI machine; a passing wait returns at once
STEP_SECONDS = 0.05  # each decode step: an answer of 400 tokens streams for ~20 s


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with open_browser() as b:
        yield b


@pytest.fixture(scope="module")
def server(tiny_model_fp32) -> Iterator[ServerProcess]:
    s = ServerProcess(tiny_model_fp32, STEP_SECONDS, "--model-name", "tiny-test")
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def page(browser) -> Iterator[Any]:
    context = browser.new_context()  # its own localStorage
    page = context.new_page()
    page.errors = []  # uncaught exceptions and console errors (a CSP violation is one)
    page.on("pageerror", lambda exc: page.errors.append(str(exc)))
    page.on("console", lambda msg: page.errors.append(msg.text) if msg.type == "error" else None)
    page.set_default_timeout(15_000)
    try:
        yield page
    finally:
        context.close()


def health(server: ServerProcess) -> dict[str, Any]:
    return httpx.get(server.url + "/health", timeout=5).json()


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=5).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(name + ("{" + want + "}" if want else " ")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{{want}}} not in /metrics")


def wait_until(pred: Any, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def open_settings(page: Any) -> None:
    page.click("#open-settings")
    page.wait_for_selector("#settings:not([hidden])")


def sent_bodies(page: Any) -> list[dict[str, Any]]:
    bodies: list[dict[str, Any]] = []
    page.on("request", lambda r: bodies.append(json.loads(r.post_data)) if r.url.endswith(CHAT) else None)
    return bodies


def rendered(page: Any, text: str) -> str:
    """`text` as the page shows an answer: through its own Markdown renderer, read as text."""
    return page.evaluate("""async (text) => {
        const { renderMarkdown } = await import("/static/markdown.js");
        const div = document.createElement("div");
        div.append(renderMarkdown(text));
        document.body.append(div);
        try { return div.innerText; } finally { div.remove(); }
    }""", text)


def _streaming_answer(page: Any, text: str) -> list[int]:
    """Send `text` and watch the answer grow over several observations while the request runs;
    the answer's lengths seen. The sampled tiny model may end an answer within a few tokens
    (it once stopped at 8 characters, and the answer never grew again): the page is reloaded
    (a fresh conversation, the settings kept) and `text` sent again, a few times at most."""
    for _ in range(5):
        page.fill("#input", text)
        page.keyboard.press("Enter")
        lengths: list[int] = []
        deadline = time.monotonic() + 20
        while len(set(lengths)) < 4:
            assert time.monotonic() < deadline, lengths
            if lengths and page.get_attribute("body", "data-state") == "idle":
                break  # ended early
            lengths.append(len(page.inner_text(".msg.assistant .body")))
            time.sleep(0.1)
        else:
            # The answer may also have ended just after the last look: only a running one counts.
            if page.get_attribute("body", "data-state") == "streaming":
                return lengths
        page.reload()
        expect(page.locator("#model")).to_have_text("tiny-test")
    raise AssertionError("five answers in a row ended within a few tokens")


def test_streams_stops_continues_and_keeps_settings_over_a_reload(server, page):
    # The server's log says where to point the browser.
    wait_until(lambda: f"open {server.url}/ in a browser for the chat page" in server.log, 5, server.log)
    bodies = sent_bodies(page)
    page.goto(server.url + "/")
    expect(page.locator("#model")).to_have_text("tiny-test")

    open_settings(page)
    page.fill("#system", "Answer briefly.")
    page.fill("#temperature", "0.7")
    page.fill("#max_tokens", "400")
    page.click("#close-settings")
    assert page.is_hidden("#settings")

    # Stop: the fetch is aborted, the server sees the disconnect and frees the slot. The sampled
    # model may end its answer on its own between the last look and the click (once, the server
    # had finished it before /health was asked): then the answer is asked for again.
    for _ in range(5):
        lengths = _streaming_answer(page, "Hello there")
        assert lengths == sorted(lengths)
        generated = metric(server, "trio_mlx_engine_generated_tokens_total")
        if health(server)["decoding"] == 1:
            try:
                page.click("#stop", timeout=3_000)  # hidden, not clickable, once the answer ended
            except PlaywrightTimeout:
                pass
            page.wait_for_selector("body[data-state=idle]")
            if page.inner_text(".msg.assistant .meta").startswith("stopped"):
                break
        page.wait_for_selector("body[data-state=idle]")
        page.reload()
        expect(page.locator("#model")).to_have_text("tiny-test")
    else:
        raise AssertionError("five answers ended on their own before they could be stopped")
    first = bodies[-1]
    assert first["stream"] is True and first["stream_options"] == {"include_usage": True}
    assert first["temperature"] == 0.7 and first["max_tokens"] == 400 and "top_p" not in first
    assert first["messages"] == [{"role": "system", "content": "Answer briefly."},
                                 {"role": "user", "content": "Hello there"}]
    wait_until(lambda: health(server)["decoding"] == 0, 3, "the server still decodes the stopped answer")
    # The abort frees the slot at once; the request's record is counted as its handler unwinds,
    # a moment later.
    wait_until(lambda: metric(server, "trio_mlx_request_outcomes_total", endpoint=CHAT, outcome="disconnect") >= 1,
               3, "the disconnect was never counted")
    assert metric(server, "trio_mlx_request_outcomes_total", endpoint=CHAT, outcome="disconnect") == 1
    after = metric(server, "trio_mlx_engine_generated_tokens_total")
    assert after < generated + 40  # it stopped within a few steps, not after 400 tokens
    time.sleep(0.3)
    assert metric(server, "trio_mlx_engine_generated_tokens_total") == after
    stopped_answer = page.inner_text(".msg.assistant .body")

    # A second turn carries the first (the stopped answer included); it runs to its end.
    open_settings(page)
    page.fill("#max_tokens", "6")
    page.click("#close-settings")
    page.fill("#input", "And then?")
    with page.expect_response(lambda r: r.url.endswith(CHAT)) as answered:
        page.click("#send")
    page.wait_for_selector(".msg.assistant >> nth=1 >> .meta:has-text('answer tokens')")
    second = bodies[-1]
    assert [m["role"] for m in second["messages"]] == ["system", "user", "assistant", "user"]
    # The page shows the answer rendered as Markdown (the random model's `*`s can make emphasis,
    # a run of spaces shows as one): the text sent, through the page's own renderer, is what it showed.
    sent = second["messages"][2]["content"]
    assert sent.strip() and rendered(page, sent).split() == stopped_answer.split()
    # The line shows the finish the server sent: "length" at 6 tokens, unless the sampled model
    # happened to end its answer there ("stop", which the page leaves unsaid).
    finishes = re.findall(r'"finish_reason": ?"(\w+)"', answered.value.text())
    assert finishes in (["length"], ["stop"]), finishes
    meta = page.inner_text(".msg.assistant >> nth=1 >> .meta")
    answer = r"6 answer tokens · finish: length" if finishes == ["length"] else r"[1-6] answer tokens"
    assert re.fullmatch(r"TTFT \d+\.\d\d s · \d+\.\d tok/s · \d+ prompt \+ " + answer, meta), meta

    # Reload: the conversation is gone, the settings are not.
    page.reload()
    expect(page.locator("#model")).to_have_text("tiny-test")
    open_settings(page)
    assert page.input_value("#system") == "Answer briefly."
    assert page.input_value("#temperature") == "0.7" and page.input_value("#max_tokens") == "6"
    assert page.input_value("#top_p") == ""
    assert page.locator(".msg").count() == 0
    assert page.errors == []


def test_new_chat_forgets_the_conversation(server, page):
    bodies = sent_bodies(page)
    page.goto(server.url + "/")
    # Greedy: a sampled answer of the random model could be all special tokens, an empty
    # answer, whose turn the page leaves out of the conversation (app.js), and the second
    # request would carry one message where this test counts three.
    page.evaluate("localStorage.setItem('trio_mlx.settings', JSON.stringify({max_tokens: '3', temperature: '0'}))")
    page.reload()
    for text in ("one", "two"):
        page.fill("#input", text)
        page.click("#send")
        page.wait_for_selector(f".msg.assistant >> nth={0 if text == 'one' else 1} >> .meta:has-text('answer tokens')")
    assert len(bodies[1]["messages"]) == 3
    page.click("#new-chat")
    assert page.locator(".msg").count() == 0
    page.fill("#input", "three")
    page.click("#send")
    page.wait_for_selector(".msg.assistant .meta:has-text('answer tokens')")
    assert bodies[2]["messages"] == [{"role": "user", "content": "three"}]
    assert page.errors == []


HOSTILE = [
    "# Title <img src=x onerror=\"window.pwned='img'\">\n",
    "<script>window.pwned='script'</script>\n\n",
    "Click [here](javascript:window.pwned='link') or [docs](https://example.com/x).\n\n",
    "**bold** _it_ `<b>code</b>` <iframe src=\"javascript:window.pwned='iframe'\"></iframe>\n\n",
    "```html\n<script>window.pwned='fenced'</script>\n<svg onload=\"window.pwned='svg'\"></svg>\n```\n",
    "- item <a href=x onclick=\"window.pwned='a'\">x</a>\n- two\n\n",
    "| name | value |\n|---|---:|\n| <img src=y onerror=\"window.pwned='cell'\"> | **1** |\n| b | 2 |\n",
]


def sse(pieces: list[str], usage: dict[str, int] | None = None) -> str:
    events = [{"choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]} for p in pieces]
    events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    if usage:
        events.append({"choices": [], "usage": usage})
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def test_hostile_markdown_is_shown_never_run(server, page):
    body = sse(HOSTILE, {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11})
    page.route("**" + CHAT, lambda route: route.fulfill(status=200, body=body,
                                                        headers={"Content-Type": "text/event-stream"}))
    page.goto(server.url + "/")
    page.fill("#input", "be evil")
    page.click("#send")
    page.wait_for_selector(".msg.assistant .meta:has-text('5 prompt + 6 answer tokens')")
    page.wait_for_timeout(300)  # an onerror/onload would have fired by now
    answer = page.locator(".msg.assistant .body")
    assert page.evaluate("window.pwned") is None
    for tag in ("script", "img", "iframe", "svg", "[onclick]", "[onerror]", "b"):
        assert answer.locator(tag).count() == 0, tag
    # The markup is there as text; the Markdown around it is rendered.
    text = answer.inner_text()
    assert "<script>window.pwned='script'</script>" in text and "onerror" in text
    assert answer.locator("h3").inner_text().startswith("Title <img")
    assert answer.locator("strong").first.inner_text() == "bold" and answer.locator("em").inner_text() == "it"
    assert answer.locator("code").first.inner_text() == "<b>code</b>"
    fenced = answer.locator(".code pre code").inner_text()
    assert fenced.startswith("<script>window.pwned='fenced'</script>") and "<svg onload" in fenced
    assert answer.locator("li").count() == 2
    assert answer.locator("table th").all_inner_texts() == ["name", "value"]
    assert answer.locator("table td").all_inner_texts() == [
        "<img src=y onerror=\"window.pwned='cell'\">", "1", "b", "2"]
    links = answer.locator("a")
    assert links.count() == 1 and links.get_attribute("href") == "https://example.com/x"
    assert "[here](javascript:" in text
    assert page.errors == []


@pytest.mark.parametrize(("status", "error", "headers", "shown"), [
    (429, {"message": "the queue is full (64 waiting)", "code": "queue_full"}, {"Retry-After": "2"},
     "The server is busy (429): the queue is full (64 waiting). Try again in 2 s."),
    (503, {"message": "the model is still loading; retry shortly", "code": "unavailable"}, {},
     "The server is unavailable (503): the model is still loading; retry shortly."),
    (400, {"message": "the prompt (9000 tokens) plus max_tokens does not fit in 8192", "code": "context_length_exceeded"},
     {}, "This conversation no longer fits in the model's context: the prompt (9000 tokens) plus max_tokens "
     "does not fit in 8192. Start a new chat or lower max tokens in the settings."),
])
def test_server_errors_read_as_sentences(server, page, status, error, headers, shown):
    payload = json.dumps({"error": {"type": "invalid_request_error", "param": None, **error}})
    page.route("**" + CHAT, lambda route: route.fulfill(status=status, body=payload, headers={
        "Content-Type": "application/json", **headers}))
    page.goto(server.url + "/")
    page.fill("#input", "hi")
    page.click("#send")
    page.wait_for_selector(".msg.error")
    assert page.inner_text(".msg.error") == shown
    assert page.locator(".msg.assistant").count() == 0
    assert page.get_attribute("body", "data-state") == "idle"


def test_a_real_context_overflow_reads_as_a_sentence(server, page):
    page.goto(server.url + "/")
    page.evaluate("localStorage.setItem('trio_mlx.settings', JSON.stringify({max_tokens: '100000000'}))")
    page.reload()
    page.fill("#input", "hi")
    page.click("#send")
    page.wait_for_selector(".msg.error")
    assert page.inner_text(".msg.error").startswith("This conversation no longer fits in the model's context")


def test_an_api_key_is_asked_once_and_kept(tiny_model_fp32, browser):
    # A second server of the same model beside the module's: the per-model lock must let it.
    s = ServerProcess(tiny_model_fp32, 0, "--model-name", "keyed", "--api-key", "sekret",
                      "--allow-multiple-workers")
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(s.url + "/")
        page.wait_for_selector("#key-dialog[open]")
        page.fill("#key-input", "wrong")
        page.click("#key-form button[type=submit]")
        page.wait_for_selector("#key-dialog[open]")  # asked again: the key was refused
        page.fill("#key-input", "sekret")
        page.click("#key-form button[type=submit]")
        expect(page.locator("#model")).to_have_text("keyed")
        page.evaluate("localStorage.setItem('trio_mlx.settings', JSON.stringify({max_tokens: '3'}))")
        page.fill("#input", "hi")
        page.click("#send")
        page.wait_for_selector(".msg.assistant .meta:has-text('answer tokens')")
        page.reload()
        expect(page.locator("#model")).to_have_text("keyed")
        assert not page.is_visible("#key-dialog")
        assert page.evaluate("localStorage.getItem('trio_mlx.api_key')") == "sekret"
    finally:
        context.close()
        s.close()


def test_docs_render_the_servers_openapi_from_local_files_only(server, page):
    urls: list[str] = []
    page.on("request", lambda r: urls.append(r.url))
    page.goto(server.url + "/docs")
    page.wait_for_selector(".opblock-summary-path:has-text('/v1/chat/completions')")
    assert page.locator(".opblock").count() >= 5
    assert urls and all(u.startswith(server.url + "/") or u.startswith("data:") for u in urls), urls
    assert server.url + "/openapi.json" in urls
    assert page.errors == []
