"""A real headless Chromium for the page's tests (tests/system/test_page_browser.py), driven by Playwright.

The browser is Debian's `chromium` package (scripts/test.sh installs it with apt-get
when it is missing and it can), never one Playwright downloads. Where there is none:
on Linux (CI) the tests FAIL with what to install; on macOS they skip, since a dev
machine there need not have Chromium.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

# As a root CI container needs them: no sandbox, no GPU, nothing fetched in the background.
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TESTS = Path(__file__).parent
ROOT = TESTS.parent


def chromium_path() -> str:
    """The system Chromium, or fail (Linux) / skip (elsewhere) saying how to get one."""
    found = os.environ.get("TRIO_MLX_CHROMIUM") or next(
        (p for name in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(name))), None)
    if found:
        return found
    why = ("no Chromium found (looked for $TRIO_MLX_CHROMIUM, chromium, chromium-browser, google-chrome); "
           "on Debian/Ubuntu: apt-get install chromium (scripts/test.sh does this when run as root)")
    if sys.platform == "linux":
        pytest.fail(why, pytrace=False)
    pytest.skip(why)


@contextmanager
def open_browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is missing: pip install -e '.[test]'", pytrace=False)
    executable = chromium_path()
    with sync_playwright() as p:
        # launch() gives each run a fresh temporary profile (its --user-data-dir).
        browser = p.chromium.launch(executable_path=executable, headless=True, args=FLAGS)
        try:
            yield browser
        finally:
            browser.close()


class ServerProcess:
    """`trio-mlx serve` in a subprocess (tests/slow_server.py: decode steps slowed so that an
    answer is still streaming when the test presses Stop)."""

    def __init__(self, model: Path, step_seconds: float, *args: str):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(
            [sys.executable, str(TESTS / "slow_server.py"), str(step_seconds), str(model), "--port", "0",
             "--no-warmup", "--no-access-log", "--actor", "thread", *args],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, cwd=ROOT)
        self.log = ""
        self.url: str | None = None
        self._has_url = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._has_url.wait(60) or self.url is None:
            self.close()
            raise AssertionError(f"the server did not start:\n{self.log[-3000:]}")

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in iter(self.proc.stderr.readline, b""):
            self.log += line.decode("utf-8", "replace")
            if self.url is None and (m := re.search(r"Running on (http://\S+)", self.log)):
                self.url = m.group(1)
                self._has_url.set()
        self._has_url.set()

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
