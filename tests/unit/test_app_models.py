"""A server of several models (`--models`), over `FakeActor`: /v1/models lists them, a request
names one (or an alias of one, or one of its adapters as MODEL:NAME) and is answered by it, a
model that cannot be loaded because every loaded one is busy, or whose load outlasts
startup_timeout, is a 503 with Retry-After in each API's error shape, names it does not serve
load nothing, and /metrics gives each loaded model's engine figures by model. The pool's own
rules: tests/unit/test_model_pool.py; real models: tests/integration/test_model_pool.py; the
server as a process: tests/system/test_app_models.py."""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import hypercorn.trio
import pytest
import trio
from app_server import CHAT, Scrape, assert_error, chat_body
from hypercorn.config import Config

from trio_mlx.actor import FakeActor
from trio_mlx.server._app import create_app
from trio_mlx.server._serve import build_parser, describe_settings, settings_from_args
from trio_mlx.server._settings import Settings

MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"
NAMES = ("alpha", "beta", "gamma")


@pytest.fixture
def folder(tmp_path, tiny_model_fp32):
    for name in NAMES:
        shutil.copytree(tiny_model_fp32, tmp_path / "models" / name)
    return tmp_path / "models"


def actors(step_seconds: dict[str, float] | None = None, load_seconds: dict[str, float] | None = None) -> Any:
    """Fake actors, with slow steps (loads) for the models `step_seconds` (`load_seconds`) names."""
    def make(config, link):
        name = config.model_path.name
        return FakeActor(config, link, step_seconds=(step_seconds or {}).get(name, 0.0),
                         load_seconds=(load_seconds or {}).get(name, 0.0))
    return make


@asynccontextmanager
async def serve_models(folder, *, step_seconds: dict[str, float] | None = None, actor: Any = None,
                       load_seconds: dict[str, float] | None = None,
                       **settings: Any) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    """A server of the models in `folder` over fake actors (`actor(config, link)`, else `actors`)."""
    settings.setdefault("warmup", False)
    settings.setdefault("drain_timeout", 1.0)
    app = create_app(Settings.from_env({}, models=(str(folder),), allow_multiple_workers=True, **settings))
    app.pool_actor = actor or actors(step_seconds, load_seconds)
    app.on_fatal = lambda reason: None  # type: ignore[method-assign]
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(hypercorn.trio.serve, app, config, shutdown_trigger=stop.wait))
        try:
            async with httpx.AsyncClient(base_url=binds[0], timeout=20.0) as client:
                yield app, client
        finally:
            stop.set()


@asynccontextmanager
async def busy(app: Any, client: httpx.AsyncClient, model: str) -> AsyncIterator[None]:
    """`model` decoding one streamed request (it is not idle) for as long as the block runs;
    at its end the client leaves (the stream closed mid-answer: the server aborts it) and the
    model is idle again. A test holds a model busy only as long as it needs."""
    leave = trio.Event()

    async def hold() -> None:
        body = chat_body(model=model, max_tokens=400, ignore_eos=True, stream=True)
        async with client.stream("POST", CHAT, json=body) as r:
            assert r.status_code == 200
            await leave.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold)
        with trio.fail_after(10):
            while app.pool.engine(model) is None or app.pool.engine(model).statistics().decoding == 0:  # noqa: ASYNC110
                await trio.sleep(0.01)
        yield
        leave.set()
    with trio.fail_after(10):
        while app.pool.engine(model).in_flight:  # noqa: ASYNC110
            await trio.sleep(0.01)


async def test_v1_models_lists_every_model_and_loads_none_before_it_is_asked_for(folder):
    async with serve_models(folder) as (app, client):
        data = (await client.get("/v1/models")).json()["data"]
        assert [m["id"] for m in data] == list(NAMES)
        assert [m["loaded"] for m in data] == [False] * 3
        assert data[1]["root"] == str(folder / "beta")
        assert (await client.get("/ready")).status_code == 200
        r = await client.post(CHAT, json=chat_body(model="beta", max_tokens=3))
        assert r.status_code == 200 and r.json()["model"] == "beta", r.text
        card = (await client.get("/v1/models/beta")).json()
        assert card["loaded"] is True and card["context_length"] == 2048
        health = (await client.get("/health")).json()
        assert health["models"]["beta"]["state"] == "loaded" and health["models"]["alpha"]["state"] == "unloaded"
        err = assert_error(await client.post(CHAT, json=chat_body(model="delta")), 404, code="model_not_found")
        assert "'alpha', 'beta', 'gamma'" in err["message"]


async def test_each_api_reaches_the_model_it_names_or_an_alias_of(folder):
    async with serve_models(folder, max_loaded_models=3, model_aliases=("claude-*=gamma", "gpt-*=alpha")) as (
            app, client):
        r = await client.post(MESSAGES, json={"model": "claude-sonnet-4", "max_tokens": 2,
                                              "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["model"] == "gamma", r.text
        r = await client.post(RESPONSES, json={"model": "beta", "input": "hi", "max_output_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "beta", r.text
        r = await client.post(CHAT, json=chat_body(model="gpt-4o", max_tokens=2))
        assert r.status_code == 200 and r.json()["model"] == "alpha", r.text
        assert {s.name: s.state for s in app.pool.status()} == dict.fromkeys(NAMES, "loaded")
        # the engines are the models' own: each counted its own request, and /metrics says so by model
        assert [app.pool.engine(n).statistics().requests_finished for n in NAMES] == [1, 1, 1]
        r = await client.post(CHAT, json=chat_body(model="beta", max_tokens=2))
        scrape = Scrape((await client.get("/metrics")).text)
        assert scrape.value("trio_mlx_model_requests_finished_total", model="beta") == 2
        assert scrape.value("trio_mlx_model_requests_finished_total", model="gamma") == 1
        assert scrape.value("trio_mlx_model_state", model="alpha", state="loaded") == 1
        assert scrape.value("trio_mlx_model_loads_total", model="alpha") == 1


async def test_no_idle_model_to_unload_is_a_503_with_retry_after_in_each_api_s_shape(folder):
    async with serve_models(folder, step_seconds={"alpha": 0.02}) as (app, client):
        async with busy(app, client, "alpha"):
            load = (await client.get("/get_load")).json()[0]
            assert load["num_reqs"] + load["num_waiting_reqs"] == 1  # alpha's request, summed over models
            r = await client.post(CHAT, json=chat_body(model="beta", max_tokens=2))
            err = assert_error(r, 503, code="model_capacity", type="server_error")
            assert "'beta' cannot be loaded now" in err["message"]
            assert int(r.headers["retry-after"]) >= 1
            r = await client.post(MESSAGES, json={"model": "beta", "max_tokens": 2,
                                                  "messages": [{"role": "user", "content": "hi"}]})
            body = r.json()
            assert r.status_code == 503 and body["type"] == "error" and "retry-after" in r.headers, r.text
            assert "cannot be loaded now" in body["error"]["message"]
            r = await client.post(RESPONSES, json={"model": "beta", "input": "hi"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_capacity", r.text
            assert "retry-after" in r.headers
        r = await client.post(CHAT, json=chat_body(model="beta", max_tokens=2))  # alpha idle: unloaded for beta
        assert r.status_code == 200 and r.json()["model"] == "beta", r.text
        assert {s.name: s.state for s in app.pool.status()}["alpha"] == "unloaded"


async def test_a_load_past_startup_timeout_is_a_503_with_retry_after_in_each_api_s_shape(folder):
    async with serve_models(folder, startup_timeout=0.3, load_seconds={"alpha": 1.5}) as (app, client):
        answers: dict[str, httpx.Response] = {}

        async def ask(path: str, body: dict[str, Any]) -> None:
            answers[path] = await client.post(path, json=body)

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:  # all three wait for the one load
                nursery.start_soon(ask, CHAT, chat_body(model="alpha", max_tokens=2))
                nursery.start_soon(ask, MESSAGES, {"model": "alpha", "max_tokens": 2,
                                                   "messages": [{"role": "user", "content": "hi"}]})
                nursery.start_soon(ask, RESPONSES, {"model": "alpha", "input": "hi", "stream": True})
        err = assert_error(answers[CHAT], 503, code="model_load_timeout", type="server_error")
        assert "'alpha' did not load within 0.3 s (startup_timeout)" in err["message"]
        body = answers[MESSAGES].json()
        assert answers[MESSAGES].status_code == 503 and body["type"] == "error", answers[MESSAGES].text
        assert "did not load within" in body["error"]["message"]
        assert answers[RESPONSES].status_code == 503, answers[RESPONSES].text
        assert answers[RESPONSES].json()["error"]["code"] == "model_load_timeout"
        assert all(int(r.headers["retry-after"]) >= 1 for r in answers.values())
        # once the GPU thread is out of alpha's load, the slot is free: beta loads and answers
        with trio.fail_after(10):
            while {s.name: s.state for s in app.pool.status()}["alpha"] != "unloaded":  # noqa: ASYNC110
                await trio.sleep(0.02)
        r = await client.post(CHAT, json=chat_body(model="beta", max_tokens=2))
        assert r.status_code == 200 and r.json()["model"] == "beta", r.text


async def test_metrics_give_each_loaded_model_s_engine_figures_by_model(folder):
    async with serve_models(folder, max_loaded_models=2, step_seconds={"alpha": 0.02}) as (app, client):
        scrape = Scrape((await client.get("/metrics")).text)
        assert scrape.value("trio_mlx_engine_state", state="ready") == 1  # the pool serves, none loaded
        assert "trio_mlx_queue_depth{" not in scrape.text  # no model loaded: no series of one
        r = await client.post(CHAT, json=chat_body(model="beta", max_tokens=3, ignore_eos=True))
        assert r.status_code == 200, r.text
        async with busy(app, client, "alpha"):
            # MLX's memory is the process's: the freshest model's reading, the peak's largest
            for name, memory, at in (("alpha", (100, 500, 7), 1.0), ("beta", (200, 400, 9), 2.0)):
                registry = app.pool.engine(name)._registry
                registry.memory, registry.memory_read_at = memory, at
            scrape = Scrape((await client.get("/metrics")).text)
            assert scrape.value("trio_mlx_requests_in_engine", model="alpha", stage="decode") == 1
            assert scrape.value("trio_mlx_requests_in_engine", model="beta", stage="decode") == 0
            assert scrape.value("trio_mlx_active_sequences", model="alpha") == 1
            assert scrape.value("trio_mlx_queue_depth", model="alpha") == 0
            assert scrape.value("trio_mlx_decode_steps_total", model="alpha") > 0
            assert [labels for labels, _ in scrape.samples["trio_mlx_decode_step_last_seconds"]] == [
                {"model": "alpha"}, {"model": "beta"}]  # the fake reports no step times: the series only
            assert scrape.value("trio_mlx_engine_requests_finished_total", model="beta") == 1
            assert scrape.value("trio_mlx_engine_generated_tokens_total", model="beta") == 3
            assert scrape.value("trio_mlx_aborts_by_cause_total", model="beta", cause="disconnect") == 0
            assert ({"model": "gamma"}, 0.0) not in scrape.samples["trio_mlx_queue_depth"]  # not loaded
            assert scrape.value("trio_mlx_mlx_active_memory_bytes") == 200
            assert scrape.value("trio_mlx_mlx_cache_memory_bytes") == 9
            assert scrape.value("trio_mlx_mlx_peak_memory_bytes") == 500
            assert scrape.value("trio_mlx_engine_state", state="ready") == 1


async def test_names_it_does_not_serve_are_404s_that_load_nothing_and_leave_no_series(folder):
    async with serve_models(folder) as (app, client):
        before = (await client.get("/metrics")).text
        bad = [f"nope-{i}" for i in range(40)] + ["../alpha", str(folder / "alpha"), "alpha/..", "/etc/passwd",
                                                   "alpha:lora", "%2e%2e", ""]
        for name in bad:
            assert_error(await client.post(CHAT, json=chat_body(model=name)), 404, code="model_not_found")
            r = await client.post(MESSAGES, json={"model": name, "max_tokens": 2,
                                                  "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 404 and r.json()["type"] == "error", r.text
        assert (await client.get("/v1/models/..%2Falpha")).status_code == 404
        assert [s.loads for s in app.pool.status()] == [0, 0, 0]
        after = (await client.get("/metrics")).text
        assert not any(f'"{name}"' in after for name in bad if name)  # no series named after a request
        assert len(after.splitlines()) - len(before.splitlines()) < 20  # the 404s' own counters only


async def test_an_idle_model_is_unloaded_on_request_and_a_busy_one_is_a_409(folder, tmp_path):
    sql = _adapter_dir(tmp_path / "sql")
    async with serve_models(folder, max_loaded_models=2, step_seconds={"beta": 0.02},
                            model_adapters=(f"alpha:sql={sql}",), model_aliases=("gpt-*=alpha",)) as (app, client):
        r = await client.post("/models/unload", json={"model": "alpha"})
        assert r.status_code == 200 and r.json()["unloaded"] is False, r.text  # not loaded: nothing to do
        assert (await client.post(CHAT, json=chat_body(model="alpha", max_tokens=2))).status_code == 200
        r = await client.post("/models/unload", json={"model": "gpt-4o"})  # an alias names its model
        assert r.status_code == 200 and r.json() == {"id": "alpha", "object": "model", "unloaded": True,
                                                     "state": "unloaded"}, r.text
        assert {s.name: s.state for s in app.pool.status()}["alpha"] == "unloaded"
        assert_error(await client.post("/models/unload", json={"model": "delta"}), 404, code="model_not_found")
        assert_error(await client.post("/models/unload", json={"model": "alpha:sql"}), 400, code="invalid_value")
        async with busy(app, client, "beta"):
            err = assert_error(await client.post("/models/unload", json={"model": "beta"}), 409, code="model_busy")
            assert "'beta' is serving requests" in err["message"]
        assert {s.name: s.state for s in app.pool.status()}["beta"] == "loaded"
        r = await client.post("/models/unload", json={"model": "beta"})  # idle now
        assert r.status_code == 200 and r.json()["unloaded"] is True
        r = await client.post(CHAT, json=chat_body(model="beta", max_tokens=2))  # and it loads again
        assert r.status_code == 200 and app.pool.status()[1].loads == 2


def _adapter_dir(where) -> str:
    """A directory that passes the engine's cheap check (`models.check_adapter`); the fake actor
    never reads its weights."""
    where.mkdir(parents=True)
    (where / "adapters.safetensors").write_bytes(b"")
    (where / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": 1, "lora_parameters": {"rank": 4, "scale": 1.0, "dropout": 0.0}}))
    return str(where)


async def test_each_model_has_its_own_named_adapters_picked_as_model_colon_name(folder, tmp_path):
    sql_a, sql_b = _adapter_dir(tmp_path / "a-sql"), _adapter_dir(tmp_path / "b-sql")
    adapters = (f"alpha:sql={sql_a}", f"beta:sql={sql_b}", f"gamma:bad={tmp_path / 'missing'}")
    async with serve_models(folder, max_loaded_models=3, model_adapters=adapters,
                            model_aliases=("claude-*=beta:sql",)) as (app, client):
        data = (await client.get("/v1/models")).json()["data"]
        assert [m["id"] for m in data] == ["alpha", "alpha:sql", "beta", "beta:sql", "gamma", "gamma:bad"]
        assert data[1]["parent"] == "alpha" and data[1]["root"] == sql_a and data[1]["loaded"] is False
        r = await client.post(CHAT, json=chat_body(model="alpha:sql", max_tokens=2))
        assert r.status_code == 200 and r.json()["model"] == "alpha:sql", r.text
        card = (await client.get("/v1/models/alpha:sql")).json()
        assert card["loaded"] is True and card["parent"] == "alpha" and card["root"] == sql_a
        assert app.pool.engine("alpha").adapters == ("sql",)  # alpha loaded with its own adapter
        r = await client.post(MESSAGES, json={"model": "claude-3", "max_tokens": 2,
                                              "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["model"] == "beta:sql", r.text
        r = await client.post(CHAT, json=chat_body(model="beta", max_tokens=2))
        assert r.status_code == 200 and r.json()["model"] == "beta", r.text
        for name in ("sql", "gamma:sql", "alpha:bad", "alpha:"):  # an adapter is its model's only
            err = assert_error(await client.post(CHAT, json=chat_body(model=name)), 404, code="model_not_found")
            assert "the adapters 'alpha:sql', 'beta:sql', 'gamma:bad'" in err["message"], err
        # an adapter that cannot be found fails its model's load, naming it
        err = assert_error(await client.post(CHAT, json=chat_body(model="gamma", max_tokens=2)), 500,
                           code="model_load_failed")
        assert "adapter 'bad'" in err["message"]
        info = (await client.get("/server_info")).json()
        assert info["adapters"] == {"alpha:sql": sql_a, "beta:sql": sql_b, "gamma:bad": str(tmp_path / "missing")}


def test_adapters_of_several_models_are_checked_at_startup(folder):
    with pytest.raises(ValueError, match="model_adapters needs models"):
        Settings.from_env({}, model_adapters=("alpha:sql=/x",))
    with pytest.raises(ValueError, match="which models does not list"):
        Settings.from_env({}, models=(str(folder),), model_adapters=("delta:sql=/x",))
    with pytest.raises(ValueError, match="each entry is MODEL:NAME=PATH"):
        Settings.from_env({}, models=(str(folder),), model_adapters=("sql=/x",))
    with pytest.raises(ValueError, match="alpha:sql is given twice"):
        Settings.from_env({}, models=(str(folder),), model_adapters=("alpha:sql=/x", "alpha:sql=/y"))
    with pytest.raises(ValueError, match="model_adapters of 'alpha': adapters: the name 'a b' must be"):
        Settings.from_env({}, models=(str(folder),), model_adapters=("alpha:a b=/x",))
    with pytest.raises(ValueError, match=r"unset adapters \(adapters over one of them: model_adapter"):
        Settings.from_env({}, models=(str(folder),), adapters=("sql=/x",))
    args = build_parser().parse_args(["--models", str(folder), "--model-adapter", "alpha:sql=/x",
                                      "--model-adapter", "beta:sql=/y"])
    settings = settings_from_args(args)
    assert settings.model_adapter_map == {"alpha": {"sql": "/x"}, "beta": {"sql": "/y"}}
    assert settings.model_tuning("alpha").adapter_map == {"sql": "/x"} and settings.model_tuning("gamma").adapters == ()
    assert settings.serves("beta:sql") == "sql" and settings.serves("gamma:sql") is False


def test_the_settings_of_several_models(folder):
    args = build_parser().parse_args(["--models", str(folder), "--max-loaded-models", "2"])
    settings = settings_from_args(args)
    assert settings.model_table == {n: str(folder / n) for n in NAMES} and settings.max_loaded_models == 2
    assert settings.served_model_name == "alpha"  # what a request that names no model gets
    logged = describe_settings(settings)
    assert re.search(r"^ +model +- \(models\)$", logged, re.M) and "(the embedded default)" not in logged
    with pytest.raises(ValueError, match="unset model"):
        Settings.from_env({}, models=(str(folder),), model="/m/x")
    with pytest.raises(ValueError, match="unset step_trace"):  # the hosted actors write no step trace
        Settings.from_env({}, models=(str(folder),), step_trace="/tmp/trace")
    with pytest.raises(ValueError, match="models needs actor 'thread'"):
        Settings.from_env({}, models=(str(folder),), actor="process")
    with pytest.raises(ValueError, match="no model folder"):
        Settings.from_env({}, models=(str(folder.parent),))
    with pytest.raises(ValueError, match="TARGET one of 'alpha', 'beta', 'gamma'"):
        Settings.from_env({}, models=(str(folder),), model_aliases=("claude-*=delta",))
    with pytest.raises(ValueError, match="max_loaded_models must be >= 1"):
        Settings.from_env({}, models=(str(folder),), max_loaded_models=0)


async def test_the_unload_needs_a_body_naming_the_model_and_the_api_key(folder):
    """`POST /models/unload` takes `{"model": NAME}`; anything else is a 400 naming `model`, and
    with an API key the unload needs it, though it lies outside `/v1/`."""
    async with serve_models(folder, api_key="sesame") as (app, client):
        assert_error(await client.post("/models/unload", json={"model": "alpha"}), 401)
        auth = {"Authorization": "Bearer sesame"}
        for body in ({}, {"model": ""}, {"model": 3}, [1], "alpha"):
            err = assert_error(await client.post("/models/unload", json=body, headers=auth), 400, code="invalid_value")
            assert err["param"] == "model", body
        r = await client.post("/models/unload", content=b"{not json", headers={**auth, "Content-Type": "application/json"})
        assert_error(r, 400, code="invalid_value")
        r = await client.post("/models/unload", json={"model": "alpha"}, headers=auth)
        assert r.status_code == 200 and r.json()["unloaded"] is False, r.text
        # a model id with slashes is a model card's path, never an unload
        assert (await client.post("/v1/models/alpha/unload", headers=auth)).status_code in (404, 405)
