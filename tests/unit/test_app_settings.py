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
    assert (s.model, s.tuning.max_batch, s.drain_timeout, s.tuning.warmup) == ("/models/llama", 32, 2.5, False)
    assert s.cors_origins == ("https://a.example", "https://b.example")
    assert s.model_name is None and s.public()["api_key"] == "***"
    for var, value in [("TRIO_MLX_MAX_BATCH", "many"), ("TRIO_MLX_WARMUP", "perhaps"),
                       ("TRIO_MLX_STALL_TIMEOUT", "0"), ("TRIO_MLX_MAX_BATCH", "0"),
                       ("TRIO_MLX_PING_INTERVAL", "nan"), ("TRIO_MLX_LOG_LEVEL", "loud"),
                       ("TRIO_MLX_PROMPT_CACHE_DISK_GB", "-1"), ("TRIO_MLX_PROMPT_CACHE_ISOLATION", "user"),
                       ("TRIO_MLX_GRAMMAR_MASKS", "sometimes")]:
        with pytest.raises(ValueError, match=var.removeprefix("TRIO_MLX_").lower() + "|" + var):
            Settings.from_env({var: value})


def test_grammar_masks_before_the_forward_needs_the_owned_step():
    """mlx-lm's step fills each row's mask in its own processor: only the owned step can fill
    them beside the forward. 'auto', the default, is 'after' with mlx-lm's step."""
    assert Settings.from_env({"TRIO_MLX_GRAMMAR_MASKS": "before"}).tuning.grammar_masks == "before"
    with pytest.raises(ValueError, match="grammar_masks 'before' needs decode_step 'owned'"):
        Settings.from_env({"TRIO_MLX_GRAMMAR_MASKS": "before", "TRIO_MLX_DECODE_STEP": "mlx"})
    assert Settings.from_env({}).tuning.grammar_masks == "auto"
    assert Settings.from_env({"TRIO_MLX_DECODE_STEP": "mlx"}).tuning.grammar_masks == "auto"


def test_prompt_cache_isolation_by_key_needs_keys():
    s = Settings.from_env({"TRIO_MLX_API_KEY": "a,b", "TRIO_MLX_PROMPT_CACHE_ISOLATION": "key"})
    assert s.prompt_cache_isolation == "key" and Settings.from_env({}).prompt_cache_isolation == "shared"
    with pytest.raises(ValueError, match="needs api_key"):
        Settings.from_env({"TRIO_MLX_PROMPT_CACHE_ISOLATION": "key"})


def test_the_prompt_caches_disk_tier_needs_a_single_rank():
    assert Settings.from_env({"TRIO_MLX_PROMPT_CACHE_DISK_GB": "2"}).tuning.prompt_cache_disk_gb == 2.0
    with pytest.raises(ValueError, match="prompt_cache_disk_gb needs a single rank"):
        Settings.from_env({}, prompt_cache_disk_gb=2.0, distributed="tensor")


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
    assert (s.model, s.tuning.max_batch, s.port, s.access_log, s.cors_origins) == ("some/model", 8, 9000, False, ("*",))
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
    actor's (None: the device decides, `_memory.PREFILL_BUDGET_CPU`), a value reaches the engine,
    and a negative one stops the server."""
    from trio_mlx import Engine
    from trio_mlx.actor import ActorConfig
    from trio_mlx.server._app import _engine_options

    assert Settings().tuning.prefill_budget is None and Engine(None).tuning.prefill_budget is None
    assert ActorConfig(Path("m")).tuning.prefill_budget is None
    assert _engine_options(Settings())["tuning"].prefill_budget is None
    assert Settings.from_env({"TRIO_MLX_PREFILL_BUDGET": "4096"}).tuning.prefill_budget == 4096
    assert Settings.from_env({"TRIO_MLX_PREFILL_BUDGET": ""}).tuning.prefill_budget is None
    assert settings_from_args(build_parser().parse_args(["--prefill-budget", "0"])).tuning.prefill_budget == 0
    assert _engine_options(Settings.from_env({}, prefill_budget=512))["tuning"].prefill_budget == 512
    with pytest.raises(ValueError, match="prefill_budget"):
        Settings.from_env({"TRIO_MLX_PREFILL_BUDGET": "-1"})
    with pytest.raises(ValueError, match="prefill_budget"):
        Engine(None, prefill_budget=-1)


# A text each str knob accepts (any text for the others); every other kind has one below.
_SAMPLE_TEXT = {"decode_step": "mlx", "speculative": "ngram", "ngram_size": "2", "adapters": "x=/tmp/x",
                "grammar_masks": "after"}
_KIND_TEXT = {"int": "3", "float": "0.5", "bool": "off"}


def test_every_tuning_knob_is_a_flag_and_a_variable():
    """A new `ActorTuning` field needs nothing else: `trio-mlx serve` has its flag (with its help
    and default), TRIO_MLX_<NAME> sets it, and both reach the record the engine takes."""
    import dataclasses

    from trio_mlx import ActorTuning
    from trio_mlx._fields import env_name, field_kind

    parser = build_parser()
    flags = {s: a for a in parser._actions for s in a.option_strings}
    for f in dataclasses.fields(ActorTuning):
        flag = "--" + f.name.replace("_", "-")
        kind = field_kind(f)
        assert flag in flags and f.metadata["doc"] in (flags[flag].help or ""), f.name
        text = _SAMPLE_TEXT.get(f.name, _KIND_TEXT.get(kind, "/tmp/x"))
        from_env = getattr(Settings.from_env({env_name(f.name): text}).tuning, f.name)
        assert from_env != getattr(ActorTuning(), f.name), f"{env_name(f.name)} did not reach the tuning"
        argv = ["--no-" + flag[2:]] if kind == "bool" else [flag, text]  # bools default on
        assert getattr(settings_from_args(parser.parse_args(argv)).tuning, f.name) == from_env, flag


def test_the_library_and_the_server_have_one_default_per_knob():
    """What a library user gets without asking is what a server user gets: the actor's tuning
    is one record (the server nests it, the engine and its actor take it whole), and each
    engine setting the server also has defaults alike (it once was restart_limit 0 against 3)."""
    import dataclasses
    import inspect

    from trio_mlx import ActorTuning, Engine, open_engine
    from trio_mlx.actor import ActorConfig
    from trio_mlx.server._app import _engine_options

    assert Settings().tuning == ActorTuning() == Engine(None).tuning == ActorConfig(Path("m")).tuning
    settings = Settings.from_env({}, retire_steps=3)
    assert _engine_options(settings)["tuning"] is settings.tuning  # passed whole
    library = inspect.signature(Engine).parameters
    shared = [f.name for f in dataclasses.fields(Settings) if f.name in library and f.name != "tuning"]
    assert {"max_queue", "actor", "restart_limit", "restart_window", "restart_backoff",
            "default_max_tokens", "cache_dir"} <= set(shared)
    for name in shared:
        assert getattr(Settings(), name) == library[name].default, name
    # open_engine hands its keywords to Engine as they are: the same defaults.
    assert list(inspect.signature(open_engine).parameters) == ["model", "options"]
    # A flat keyword and the record say the same; the keyword wins over the record.
    assert Engine(None, max_batch=8).tuning == Engine(None, tuning=ActorTuning(max_batch=8)).tuning
    assert Engine(None, tuning=ActorTuning(max_batch=8), max_batch=4).tuning.max_batch == 4
    with pytest.raises(TypeError, match="max_batches"):
        Engine(None, max_batches=8)
