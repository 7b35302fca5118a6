"""What a server says while it starts: each stage with its duration, conversion progress,
and the settings one per line (not a raw dict).

Here what needs no model; a start and a conversion: tests/integration/test_startup_log.py.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest

from trio_mlx.models import _models
from trio_mlx.server._serve import (
    _startup_failure,
    describe_settings,
    hypercorn_config,
    local_url,
    serve,
    warn_if_open,
)
from trio_mlx.server._settings import Settings


def messages(caplog, prefix: str = "trio_mlx") -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith(prefix)]


def test_a_quick_conversion_step_logs_no_progress(caplog):
    caplog.set_level(logging.INFO, logger="trio_mlx.models")
    progress = _models._Progress("converting the weights", 3, "tensors")
    for _ in range(3):
        progress.advance()
    progress.note("writing the tokenizer")
    assert messages(caplog, "trio_mlx.models") == []


def test_settings_are_logged_one_per_line_with_changes_marked():
    text = describe_settings(Settings.from_env({}, max_batch=8, api_key="sekret", cors_origins=("https://a.example",)))
    lines = text.splitlines()
    assert lines[0].startswith("settings (* set by a flag or a TRIO_MLX_* variable")
    rows = {re.split(r"\s+", line.strip().lstrip("* "))[0]: line for line in lines[1:]}
    assert len(rows) == len(Settings().public())
    assert rows["max-batch"].startswith("  * ") and rows["max-batch"].endswith(" 8")
    assert rows["prefill-batch"].startswith("    ") and rows["prefill-batch"].endswith(" 8")
    assert rows["api-key"].endswith(" ***") and "sekret" not in text
    assert rows["cors-origins"].endswith(" https://a.example")
    assert rows["model"].endswith("(the embedded default)")
    assert rows["model-name"].endswith("- (served as smollm2-135m-instruct)")
    assert "{" not in text


def test_the_startup_hint_names_a_url_that_works_for_a_wildcard_bind():
    # `--host 0.0.0.0` printed http://0.0.0.0:PORT/, which answered 403 (a foreign Host over loopback)
    assert local_url("http://0.0.0.0:8000") == "http://127.0.0.1:8000"
    assert local_url("http://[::]:8000") == "http://[::1]:8000"
    assert local_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000"
    assert local_url("http://192.168.1.5:8000") == "http://192.168.1.5:8000"


def test_a_server_open_beyond_loopback_without_an_api_key_warns(caplog):
    caplog.set_level(logging.WARNING, logger="trio_mlx")
    for host in ("127.0.0.1", "localhost", "::1"):
        warn_if_open(Settings(host=host))
    warn_if_open(Settings(host="0.0.0.0", api_key="sekret"))
    assert messages(caplog) == []
    warn_if_open(Settings(host="0.0.0.0"))
    (line,) = messages(caplog)
    assert "0.0.0.0 without --api-key" in line and "sekret" not in line


@pytest.mark.parametrize("why", ["lock", "load"])
async def test_a_refused_start_says_so_in_one_line_and_never_that_it_runs(why, tiny_model_fp32, caplog):
    # A model that failed to load, or the serving lock another process holds: the log said
    # "could not start", then hypercorn's "Running on http://..." and the chat page's URL
    # after it, and for the lock a traceback.
    from hypercorn.utils import LifespanFailureError

    from trio_mlx import ModelLoadError
    from trio_mlx.server import _workers
    from trio_mlx.server._app import create_app

    caplog.set_level(logging.INFO)
    settings = Settings.from_env({}, model=str(tiny_model_fp32), warmup=False)

    def broken(settings: Settings) -> Any:
        raise ModelLoadError("could not load the model: no weights here")

    held = _workers.acquire(settings) if why == "lock" else None
    try:
        app = create_app(settings, engine_factory=broken)
        config = hypercorn_config(settings)
        config.bind = ["127.0.0.1:0"]
        with pytest.raises(BaseException) as info:
            await serve(app, config)
        assert _startup_failure(info.value, (LifespanFailureError,)) is not None
    finally:
        if held is not None:
            held.release()
    lines = [r.getMessage() for r in caplog.records]
    assert sum("could not start" in line for line in lines) == 1, lines
    assert not [line for line in lines if "Running on" in line or "in a browser" in line], lines
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records if r.exc_info]
