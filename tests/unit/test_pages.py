"""What a browser gets over HTTP: `/` (the chat page or, for API clients, JSON), its static
files, and `/docs` (Swagger UI from a package) — all local, all under a strict CSP;
a real hypercorn over the fake actor (nothing here depends on a model).

The page's behaviour in a real browser is tests/system/test_page_browser.py.
"""

from __future__ import annotations

import re

from app_server import assert_error, fake_factory, serve

BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"


def local_refs(html: str) -> list[str]:
    """Every src= and href= in a page."""
    return re.findall(r'(?:src|href)="([^"]*)"', html)


async def test_api_clients_still_get_json_at_root(tiny_model_fp32):
    async with serve(tiny_model_fp32, factory=fake_factory(), model_name="tiny-test") as server, server.client() as client:
        for accept in ("application/json", "*/*", None):
            headers = {"Accept": accept} if accept else {}
            r = await client.get("/", headers=headers)
            assert r.status_code == 200 and r.headers["content-type"].startswith("application/json"), accept
            body = r.json()
            assert body["model"] == "tiny-test" and "/docs" in body["endpoints"]
            assert r.headers["vary"] == "Accept"


async def test_browsers_get_the_page_under_a_strict_csp(tiny_model_fp32):
    async with serve(tiny_model_fp32, factory=fake_factory()) as server, server.client() as client:
        r = await client.get("/", headers={"Accept": BROWSER_ACCEPT})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        csp = r.headers["content-security-policy"]
        assert "script-src 'self';" in csp and "unsafe-inline" not in csp and "default-src 'none'" in csp
        assert r.headers["x-content-type-options"] == "nosniff"
        html = r.text
        assert "<script>" not in html and " on" not in re.sub(r"\s+", " ", html).replace(" one", "")
        refs = local_refs(html)
        assert refs and all(ref.startswith("/") and not ref.startswith("//") for ref in refs), refs
        for ref in refs:
            if ref.startswith("/static/"):
                asset = await client.get(ref)
                assert asset.status_code == 200, ref
                assert "unsafe-inline" not in asset.headers["content-security-policy"]
        # The module graph: app.js imports its neighbours, each served with a JavaScript type.
        for name in ("app.js", "api.js", "markdown.js"):
            asset = await client.get(f"/static/{name}")
            assert asset.status_code == 200 and "javascript" in asset.headers["content-type"], name
            assert "innerHTML" not in asset.text and "insertAdjacentHTML" not in asset.text, name
            assert "http://" not in asset.text and "https://" not in asset.text.replace("(https?:", ""), name


async def test_only_the_pages_own_files_are_served(tiny_model_fp32):
    async with serve(tiny_model_fp32, factory=fake_factory()) as server, server.client() as client:
        for path in ("/static/../_app.py", "/static/%2e%2e/_app.py", "/static/_pages.py", "/static/",
                     "/static/index.html/x", "/docs/assets/swagger-ui.js.map", "/docs/assets/../../x"):
            r = await client.get(path)
            assert r.status_code == 404, (path, r.status_code)
            assert_error(r, 404)


async def test_docs_is_swagger_ui_over_the_servers_openapi_with_local_assets(tiny_model_fp32):
    async with serve(tiny_model_fp32, factory=fake_factory()) as server, server.client() as client:
        r = await client.get("/docs")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "script-src 'self';" in r.headers["content-security-policy"]
        refs = local_refs(r.text)
        assert any(ref.endswith("swagger-ui-bundle.js") for ref in refs), refs
        for ref in refs:
            assert ref.startswith("/") and not ref.startswith("//"), ref
            asset = await client.get(ref)
            assert asset.status_code == 200 and len(asset.content) > 100, ref
        bundle = (await client.get("/docs/assets/swagger-ui-bundle.js")).text
        assert "SwaggerUIBundle" in bundle
        init = (await client.get("/static/docs.js")).text
        assert 'url: "/openapi.json"' in init and "validatorUrl: null" in init
        assert (await client.get("/openapi.json")).status_code == 200


async def test_the_page_and_docs_need_no_key_but_the_api_does(tiny_model_fp32):
    async with serve(tiny_model_fp32, factory=fake_factory(), api_key="sekret") as server, server.client() as client:
        for path in ("/", "/static/app.js", "/docs", "/docs/assets/swagger-ui.css", "/openapi.json"):
            r = await client.get(path, headers={"Accept": BROWSER_ACCEPT})
            assert r.status_code == 200, path
        assert_error(await client.get("/v1/models"), 401)


def test_every_static_file_is_served_and_every_served_file_exists() -> None:
    """A file added to server/static/ must be listed in _pages.py to be served (and the wheel
    ships the whole folder: pyproject's package-data)."""
    from trio_mlx.server._pages import PAGE_FILES, STATIC

    assert {p.name for p in STATIC.iterdir()} == PAGE_FILES | {"docs.html"}
