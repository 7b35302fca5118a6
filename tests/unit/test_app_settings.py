"""Server settings: TRIO_MLX_* variables, `trio-mlx serve` flags, the served model id; and app import cost."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trio_mlx.server._serve import build_parser, hypercorn_config, settings_from_args
from trio_mlx.server._settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def test_environment_variables_are_parsed_strictly():
    s = Settings.from_env({
        "TRIO_MLX_MODEL": "/models/llama", "TRIO_MLX_MAX_BATCH": "32", "TRIO_MLX_DRAIN_TIMEOUT": "2.5",
        "TRIO_MLX_WARMUP": "off", "TRIO_MLX_CORS_ORIGINS": "https://a.example, https://b.example",
        "TRIO_MLX_API_KEY": "k", "TRIO_MLX_MODEL_NAME": "", "UNRELATED": "x",
    })
    assert (s.model, s.max_batch, s.drain_timeout, s.warmup) == ("/models/llama", 32, 2.5, False)
    assert s.cors_origins == ("https://a.example", "https://b.example")
    assert s.model_name is None and s.public()["api_key"] == "***"
    for var, value in [("TRIO_MLX_MAX_BATCH", "many"), ("TRIO_MLX_WARMUP", "perhaps"),
                       ("TRIO_MLX_STALL_TIMEOUT", "0"), ("TRIO_MLX_MAX_BATCH", "0"),
                       ("TRIO_MLX_PING_INTERVAL", "nan"), ("TRIO_MLX_LOG_LEVEL", "loud"),
                       ("TRIO_MLX_PROMPT_CACHE_DISK_GB", "-1")]:
        with pytest.raises(ValueError, match=var.removeprefix("TRIO_MLX_").lower() + "|" + var):
            Settings.from_env({var: value})


def test_the_prompt_caches_disk_tier_needs_a_single_rank():
    assert Settings.from_env({"TRIO_MLX_PROMPT_CACHE_DISK_GB": "2"}).prompt_cache_disk_gb == 2.0
    with pytest.raises(ValueError, match="prompt_cache_disk_gb needs a single rank"):
        Settings(prompt_cache_disk_gb=2.0, distributed="tensor")


def test_served_model_name():
    assert Settings().served_model_name == "smollm2-135m-instruct"
    assert Settings(model="default").served_model_name == "smollm2-135m-instruct"
    assert Settings(model="mlx-community/Llama-3.2-1B-Instruct-4bit").served_model_name == \
        "mlx-community/Llama-3.2-1B-Instruct-4bit"
    assert Settings(model="/srv/models/my-llama/").served_model_name == "my-llama"
    assert Settings(model="./my-llama", model_name="prod").served_model_name == "prod"


def test_served_model_name_is_worked_out_once(tmp_path, monkeypatch):
    """Every request compares its `model` with it; the file system is asked once."""
    import os

    settings = Settings(model=str(tmp_path / "org/name"))
    calls = []
    real_exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: calls.append(p) or real_exists(p))
    assert [settings.served_model_name for _ in range(3)] == ["name"] * 3
    assert len(calls) <= 1


def test_flags_win_over_the_environment(monkeypatch):
    monkeypatch.setenv("TRIO_MLX_MAX_BATCH", "not a number")  # overridden, so never parsed
    monkeypatch.setenv("TRIO_MLX_PORT", "9000")
    args = build_parser().parse_args(["some/model", "--max-batch", "8", "--no-access-log",
                                      "--cors-origins", "*", "--drain-timeout", "3"])
    s = settings_from_args(args)
    assert (s.model, s.max_batch, s.port, s.access_log, s.cors_origins) == ("some/model", 8, 9000, False, ("*",))
    config = hypercorn_config(s)
    assert config.bind == ["127.0.0.1:9000"] and config.worker_class == "trio"
    assert config.graceful_timeout > s.drain_timeout  # hypercorn must not cut a draining stream
    with pytest.raises(ValueError, match="--max-batch"):
        settings_from_args(build_parser().parse_args(["--max-batch", "x"]))


def test_importing_the_app_is_cheap_and_loads_no_model():
    code = ("import sys, time; t = time.perf_counter(); import trio_mlx.app as m; "
            "print(time.perf_counter() - t, 'mlx' in sys.modules, m.app.engine)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    seconds, mlx_loaded, engine = out.stdout.split()
    assert mlx_loaded == "False" and engine == "None", out.stderr
    assert float(seconds) < 5


def test_the_prefill_budget_reaches_the_actor_with_one_default():
    """`--prefill-budget` / TRIO_MLX_PREFILL_BUDGET: the server's default is the library's and the
    actor's (None: the device decides, `_actor.PREFILL_BUDGET_CPU`), a value reaches the engine,
    and a negative one stops the server."""
    import inspect

    from trio_mlx import Engine
    from trio_mlx.actor import ActorConfig
    from trio_mlx.server._app import _engine_options

    library = inspect.signature(Engine).parameters["prefill_budget"].default
    assert Settings().prefill_budget is None and library is None and ActorConfig(Path("m")).prefill_budget is None
    assert _engine_options(Settings())["prefill_budget"] is None
    assert Settings.from_env({"TRIO_MLX_PREFILL_BUDGET": "4096"}).prefill_budget == 4096
    assert Settings.from_env({"TRIO_MLX_PREFILL_BUDGET": ""}).prefill_budget is None
    assert settings_from_args(build_parser().parse_args(["--prefill-budget", "0"])).prefill_budget == 0
    assert _engine_options(Settings(prefill_budget=512))["prefill_budget"] == 512
    with pytest.raises(ValueError, match="prefill_budget"):
        Settings.from_env({"TRIO_MLX_PREFILL_BUDGET": "-1"})
    with pytest.raises(ValueError, match="prefill_budget"):
        Engine(None, prefill_budget=-1)
