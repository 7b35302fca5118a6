"""Named LoRA adapters (`--adapter NAME=PATH`) as the HTTP layer and the settings see them, over
the fake actor: how a request's model field picks one, /v1/models listing them, the 404s of
names the server does not serve in each API's error shape, and the settings' checks. What an
adapter does to tokens, the mixed batch and the prompt cache's keying: tests/integration/test_adapters.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from app_server import CHAT, COMPLETIONS, assert_error, chat_body, fake_factory, serve

from trio_mlx import ActorTuning
from trio_mlx.server._serve import build_parser, settings_from_args
from trio_mlx.server._settings import Settings

MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"


def _adapter_dir(where: Path) -> Path:
    """A directory that passes the engine's cheap check (`models.check_adapter`); the fake actor
    never reads its weights."""
    where.mkdir(parents=True)
    (where / "adapters.safetensors").write_bytes(b"")
    (where / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": 1, "lora_parameters": {"rank": 4, "scale": 1.0, "dropout": 0.0}}))
    return where


@pytest.fixture
def adapters(tmp_path: Path) -> tuple[str, ...]:
    return (f"sql={_adapter_dir(tmp_path / 'sql')}", f"poem={_adapter_dir(tmp_path / 'poem')}")


async def test_v1_models_lists_the_model_and_each_adapter_with_its_parent(tiny_model_fp32, adapters):
    async with serve(tiny_model_fp32, factory=fake_factory(adapters=adapters), adapters=adapters) as server, server.client() as client:
        data = (await client.get("/v1/models")).json()["data"]
        assert [m["id"] for m in data] == ["model", "sql", "poem"]
        assert "parent" not in data[0] and data[0]["root"] == str(tiny_model_fp32)
        sql = data[1]
        assert sql["parent"] == "model" and sql["root"] == adapters[0].split("=", 1)[1]
        assert sql["object"] == "model" and sql["owned_by"] == "trio_mlx"
        assert (await client.get("/v1/models/sql")).json() == sql
        assert (await client.get("/v1/models/model:poem")).json()["id"] == "poem"
        assert_error(await client.get("/v1/models/model:nope"), 404, code="model_not_found")
        info = (await client.get("/server_info")).json()
        assert info["adapters"] == dict(a.split("=", 1) for a in adapters)


async def test_a_request_names_an_adapter_alone_or_after_the_model_and_is_answered_as_it(tiny_model_fp32, adapters):
    async with serve(tiny_model_fp32, factory=fake_factory(adapters=adapters), adapters=adapters) as server, server.client() as client:
        for name in ("sql", "model:sql"):
            r = await client.post(CHAT, json=chat_body(model=name, max_tokens=2))
            assert r.status_code == 200 and r.json()["model"] == "sql", r.text
        r = await client.post(CHAT, json=chat_body(model="model", max_tokens=2))
        assert r.status_code == 200 and r.json()["model"] == "model"
        r = await client.post(MESSAGES, json={"model": "model:poem", "max_tokens": 2,
                                              "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["model"] == "poem", r.text
        r = await client.post(RESPONSES, json={"model": "poem", "input": "hi", "max_output_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "poem", r.text


async def test_unknown_names_get_404_in_each_api_s_shape(tiny_model_fp32, adapters):
    async with serve(tiny_model_fp32, factory=fake_factory(adapters=adapters), adapters=adapters) as server, server.client() as client:
        for name in ("model:nope", "nope", "gpt-4o", "model:"):
            err = assert_error(await client.post(CHAT, json=chat_body(model=name)), 404, code="model_not_found",
                               param="model")
            assert repr(name) in err["message"] and "'sql', 'poem'" in err["message"], err
        assert_error(await client.post(COMPLETIONS, json={"prompt": "a", "model": "model:nope"}), 404,
                     code="model_not_found")
        r = await client.post(MESSAGES, json={"model": "model:nope", "max_tokens": 2,
                                              "messages": [{"role": "user", "content": "hi"}]})
        body = r.json()
        assert r.status_code == 404 and body["type"] == "error", r.text
        assert body["error"]["type"] == "not_found_error" and "'model:nope'" in body["error"]["message"]
        r = await client.post(RESPONSES, json={"model": "model:nope", "input": "hi"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text


async def test_without_adapters_an_adapter_looking_name_is_an_unknown_model(tiny_model_fp32):
    async with serve(tiny_model_fp32, factory=fake_factory()) as server, server.client() as client:
        err = assert_error(await client.post(CHAT, json=chat_body(model="model:sql")), 404, code="model_not_found")
        assert "this server serves 'model'" in err["message"]


def test_the_flag_repeats_and_the_variable_takes_commas():
    parser = build_parser()
    args = parser.parse_args(["--adapter", "sql=/a/sql", "--adapter", "poem=/a/poem"])
    assert settings_from_args(args).tuning.adapters == ("sql=/a/sql", "poem=/a/poem")
    assert settings_from_args(args).tuning.adapter_map == {"sql": "/a/sql", "poem": "/a/poem"}
    env = Settings.from_env({"TRIO_MLX_ADAPTERS": "sql=/a/sql,poem=/a/poem"})
    assert env.tuning.adapters == ("sql=/a/sql", "poem=/a/poem")
    # the library's mapping is the same record
    assert ActorTuning(adapters={"sql": "/a/sql", "poem": "/a/poem"}) == env.tuning


@pytest.mark.parametrize(("given", "message"), [
    (("sql",), "each entry is NAME=PATH"),
    (("a:b=/x",), "the name 'a:b' must be"),
    (("sql=/x", "sql=/y"), "'sql' is given twice"),
    (("sql=",), "'sql' names no path"),
])
def test_bad_adapter_entries_are_refused_naming_them(given, message):
    with pytest.raises(ValueError, match=message):
        ActorTuning(adapters=given)


def test_what_cannot_combine_is_refused_at_startup():
    with pytest.raises(ValueError, match="adapters and adapter_path do not combine"):
        ActorTuning(adapters=("sql=/x",), adapter_path="/y")
    with pytest.raises(ValueError, match="adapters need decode_step 'owned'"):
        ActorTuning(adapters=("sql=/x",), decode_step="mlx")
    with pytest.raises(ValueError, match="adapters need a single rank"):
        Settings.from_env({}, adapters=("sql=/x",), distributed="tensor")
    with pytest.raises(ValueError, match="'model' is the served model's own name"):
        Settings.from_env({}, model="/m/model", adapters=("model=/x",))


async def test_model_aliases_map_a_clients_own_names_to_the_model_or_an_adapter(tiny_model_fp32, adapters):
    """Claude Code asks for `claude-...` models, other clients for a `gpt-...` default: each alias
    (a glob) names what serves them; the first match wins; other names stay 404."""
    aliases = ("claude-*-haiku-*=sql", "claude-*=model", "gpt-4o=model:poem")
    async with serve(tiny_model_fp32, factory=fake_factory(adapters=adapters), adapters=adapters,
                     model_aliases=aliases) as server, server.client() as client:
        r = await client.post(MESSAGES, json={"model": "claude-sonnet-4-5-20250929", "max_tokens": 2,
                                              "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["model"] == "model", r.text
        r = await client.post(MESSAGES, json={"model": "claude-3-5-haiku-20241022", "max_tokens": 2,
                                              "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["model"] == "sql", r.text
        r = await client.post(CHAT, json=chat_body(model="gpt-4o", max_tokens=2))
        assert r.status_code == 200 and r.json()["model"] == "poem", r.text
        r = await client.post(RESPONSES, json={"model": "gpt-4o", "input": "hi", "max_output_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "poem", r.text
        assert (await client.get("/v1/models/gpt-4o")).json()["id"] == "poem"
        assert_error(await client.post(CHAT, json=chat_body(model="gpt-4o-mini")), 404, code="model_not_found")


@pytest.mark.parametrize("alias", ["claude-*=nope", "claude-*", "=model", "x=model:nope"])
def test_an_alias_to_nothing_served_is_refused_at_startup(tiny_model_fp32, alias):
    with pytest.raises(ValueError, match="model_aliases"):
        Settings.from_env({}, model=str(tiny_model_fp32), model_name="model", model_aliases=(alias,))


def test_model_aliases_come_from_a_repeated_flag_or_the_environment(tiny_model_fp32):
    args = build_parser().parse_args([str(tiny_model_fp32), "--model-name", "m", "--model-alias", "claude-*=m",
                                      "--model-alias", "gpt-4o=m,o1=m"])
    assert settings_from_args(args).model_aliases == ("claude-*=m", "gpt-4o=m", "o1=m")
    env = Settings.from_env({"TRIO_MLX_MODEL_ALIASES": "claude-*=m"}, model=str(tiny_model_fp32), model_name="m")
    assert env.model_aliases == ("claude-*=m",)
