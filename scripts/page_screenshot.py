"""Take docs/chat-page.png: the chat page of a live server, after two questions.

    python scripts/page_screenshot.py [--url http://127.0.0.1:8000] [--out docs/chat-page.png]

Needs a running server (bash scripts/serve.sh), Playwright (the `test` extra) and a
system Chromium (tests/browser.py finds it the same way).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from browser import FLAGS, chromium_path  # noqa: E402

QUESTIONS = ["What is the capital of France?",
             "Write a Python function that adds two numbers."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "chat-page.png")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), headless=True, args=FLAGS)
        page = browser.new_page(viewport={"width": 960, "height": 640}, color_scheme="light")
        page.set_default_timeout(120_000)
        page.goto(args.url + "/")
        settings = {"temperature": "0", "max_tokens": "160", "system": "", "top_p": ""}
        page.evaluate(f"localStorage.setItem('trio_mlx.settings', {json.dumps(json.dumps(settings))})")
        page.reload()
        for n, question in enumerate(QUESTIONS):
            page.fill("#input", question)
            page.click("#send")
            page.wait_for_selector(f".msg.assistant >> nth={n} >> .meta:has-text('answer tokens')")
        page.screenshot(path=str(args.out))
        browser.close()
    print(args.out)


if __name__ == "__main__":
    main()
