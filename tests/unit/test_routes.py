"""The route table (`server/_routes.py`) is the server's dispatch, its index at `/`, its OpenAPI
document and the metrics' generation endpoints: every route in it is served on each of its
methods, the app serves no route the table lacks, the index lists the table's listed paths and
the OpenAPI document its documented ones, each in its order, and nothing else. Over the fake
actor (no answer here depends on a model)."""

from __future__ import annotations

import dataclasses

import pytest
from app_server import fake_factory, serve

from trio_mlx.server._asgi import needs_key
from trio_mlx.server._openapi import openapi_document, openapi_path
from trio_mlx.server._routes import GENERATION_PATHS, INDEX, ROUTES, Route
from trio_mlx.server._settings import Settings

# A concrete request path for each route with parameters: a new one needs its sample here.
SAMPLES = {
    "/v1/models/<path:model_id>": "/v1/models/tiny-test",
    "/static/<path:name>": "/static/app.js",
    "/docs/assets/<path:name>": "/docs/assets/swagger-ui.css",
}


def request_path(path: str) -> str:
    if "<" in path:
        assert path in SAMPLES, f"give {path} a sample request path in SAMPLES"
        return SAMPLES[path]
    return path


def test_the_table_names_each_path_once():
    paths = [route.path for route in ROUTES]
    assert len(paths) == len(set(paths))
    assert all(route.methods and route.summary for route in ROUTES)
    assert all("<" not in path for path in INDEX)  # a listed path is one a client can ask for as written


async def test_every_route_is_served_and_the_index_is_the_tables(tiny_model_fp32):
    async with serve(tiny_model_fp32, factory=fake_factory(), model_name="tiny-test") as server, \
            server.client() as client:
        app = server.app
        # The dispatch is the table: the raw routes by path, every other one Quart's (its rules
        # named by their paths; OPTIONS and HEAD come with each).
        quart = {rule.rule: rule.methods for rule in app.url_map.iter_rules()}
        assert set(app.asgi_routes) == {route.path for route in ROUTES if route.asgi}
        assert set(quart) == {route.path for route in ROUTES if not route.asgi}
        for route in ROUTES:
            if not route.asgi:
                assert set(route.methods) <= quart[route.path], route.path
            for method in route.methods:
                r = await client.request(method, request_path(route.path), json={} if method == "POST" else None)
                # served: answered by its handler (an empty body may be refused), not a 404 or 405
                assert r.status_code not in (404, 405), (method, route.path, r.status_code, r.text)
                assert r.status_code < 500, (method, route.path, r.status_code, r.text)

        r = await client.get("/", headers={"Accept": "application/json"})
        assert r.status_code == 200
        listed = [route.path for route in ROUTES if route.listed]
        assert r.json()["endpoints"] == listed == INDEX  # each listed route, nothing the table lacks
        # the index as it was kept by hand, before the table: the same list, in the same order
        assert listed == ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
                          "/v1/responses", "/v1/models", "/health", "/ready", "/metrics", "/server_info",
                          "/model_info", "/get_load", "/openapi.json", "/docs"]

        # The OpenAPI document is the table's documented routes, in its order: each with its
        # methods and its summary, every API path (those that take the key) among them.
        doc = (await client.get("/openapi.json")).json()
        documented = [route for route in ROUTES if route.documented]
        assert list(doc["paths"]) == [openapi_path(route.path) for route in documented]
        for route in documented:
            operations = doc["paths"][openapi_path(route.path)]
            assert set(operations) == {m.lower() for m in route.methods}, route.path
            assert all(op["summary"] == route.summary for op in operations.values()), route.path
        assert {route.path for route in ROUTES if needs_key(route.path)} <= {route.path for route in documented}
        # the paths as they were kept by hand, before the table
        assert list(doc["paths"]) == ["/v1/chat/completions", "/v1/completions", "/v1/messages",
                                      "/v1/messages/count_tokens", "/v1/responses", "/v1/models",
                                      "/v1/models/{model_id}", "/models/unload", "/health", "/ready",
                                      "/health/ready", "/metrics", "/server_info", "/model_info", "/get_load"]
        assert doc["paths"]["/v1/models/{model_id}"]["get"]["parameters"] == [
            {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}]


def test_the_openapi_document_has_schemas_for_each_documented_route_and_no_other():
    """A documented route without its schemas in `_openapi`, or schemas for a path no
    documented route has, fails the build rather than leave the document short or stale."""
    settings = Settings(model_name="m")
    new = Route("/v1/new", ("POST",), ROUTES[0].handler, "A new endpoint")
    with pytest.raises(LookupError, match="/v1/new"):
        openapi_document(settings, (*ROUTES, new))
    with pytest.raises(LookupError, match="/metrics"):
        openapi_document(settings, [route for route in ROUTES if route.path != "/metrics"])
    openapi_document(settings, (*ROUTES, dataclasses.replace(new, documented=False)))  # not documented: fine


def test_with_an_api_key_each_api_path_asks_for_it_and_anthropics_also_as_x_api_key():
    doc = openapi_document(Settings(model_name="m", api_key="k"), ROUTES)
    for route in ROUTES:
        if not route.documented:
            continue
        for op in doc["paths"][openapi_path(route.path)].values():
            wanted = [{"bearer": []}] if needs_key(route.path) else None
            if wanted and route.path.startswith("/v1/messages"):  # Anthropic's clients send x-api-key
                wanted.append({"x-api-key": []})
            assert op.get("security") == wanted, route.path
    assert set(doc["components"]["securitySchemes"]) == {"bearer", "x-api-key"}
    assert "securitySchemes" not in openapi_document(Settings(model_name="m"), ROUTES)["components"]


def test_the_generation_paths_are_the_tables_generating_routes():
    """The endpoints whose outcomes the metrics count from the start: the table's, as they
    were kept by hand before it (count_tokens answers without generating)."""
    assert GENERATION_PATHS == tuple(route.path for route in ROUTES if route.generates) == (
        "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")


async def test_what_a_router_reads_names_the_model_the_replica_and_the_load(tiny_model_fp32):
    """sglang-router names each worker's model from /server_info (its /v1/models then lists it)
    and reads /get_load for its load-based policies; /health names the replica."""
    async with serve(tiny_model_fp32, factory=fake_factory(), model_name="tiny-test", replica="r1") as server, \
            server.client() as client:
        info = (await client.get("/server_info")).json()
        assert info["served_model_name"] == "tiny-test" and info["replica"] == "r1"
        assert info["model_path"] == str(tiny_model_fp32) and info["max_running_requests"] > 0
        assert (await client.get("/get_server_info")).json() == info
        model = (await client.get("/model_info")).json()
        assert model["model_type"] == "llama" and model["architectures"] == ["LlamaForCausalLM"]
        assert model["is_generation"] is True and (await client.get("/get_model_info")).json() == model
        load = (await client.get("/get_load")).json()
        assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
        assert (await client.get("/health")).json()["replica"] == "r1"


async def test_the_load_counts_the_prompts_of_the_requests_in_flight():
    from trio_mlx.actor import SamplingParams
    from trio_mlx.engine._registry import Registry

    registry = Registry()
    registry.open_inbox()
    a = registry.submit([1, 2, 3], 4, SamplingParams(), frozenset(), None, max_batch=8, max_queue=8)
    registry.submit([4, 5], 4, SamplingParams(), frozenset(), None, max_batch=8, max_queue=8)
    assert registry.figures()["prompt_tokens_in_flight"] == 5
    registry.abort(a, "disconnect")
    assert registry.figures()["prompt_tokens_in_flight"] == 2
