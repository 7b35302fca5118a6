"""The route table (`server/_routes.py`) is both the server's dispatch and its index at `/`:
every route in it is served on each of its methods, the app serves no route the table lacks,
and the index lists the table's listed paths, in its order, and nothing else. Over the fake
actor (no answer here depends on a model)."""

from __future__ import annotations

import re

from app_server import fake_factory, serve

from trio_mlx.server._routes import INDEX, ROUTES

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

        # What the OpenAPI document describes is served: each of its paths is a route's.
        doc = (await client.get("/openapi.json")).json()

        def shape(path: str) -> str:  # `/v1/models/{model}` and `/v1/models/<path:model_id>` alike
            return re.sub(r"\{[^}]*\}|<[^>]*>", "{}", path)

        assert {shape(p) for p in doc["paths"]} <= {shape(route.path) for route in ROUTES}


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
