"""What a browser gets: the chat page at `/`, its static files, and Swagger UI at `/docs`.

The page is plain HTML, CSS and ES modules in `server/static/` (package data; no build
step, nothing from a CDN). It talks to the server's own `/v1/chat/completions` like any
client. `GET /` answers JSON to clients that prefer it (`Accept: application/json`, or
curl's `*/*`) and the page to browsers (which ask for `text/html`). Swagger UI's files
come from the `swagger-ui-py` package, served under `/docs/assets/`. The handlers below are
entries of the route table (`_routes.py`), which also makes `/`'s JSON.

Every page is sent with a strict Content-Security-Policy: scripts only from this server
and never inline, so even a rendering bug could not run script from a model's answer.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

from quart import Response, request, send_from_directory

from ._http import HTTPError

STATIC = Path(__file__).with_name("static")
# The page's own files; anything else under /static is a 404.
PAGE_FILES = frozenset({"index.html", "app.js", "api.js", "markdown.js", "app.css", "docs.js", "favicon.svg"})
# What docs.html loads from Swagger UI's distribution.
SWAGGER_FILES = frozenset({"swagger-ui-bundle.js", "swagger-ui.css", "favicon-32x32.png"})

PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
            "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
# Swagger UI sets inline styles from its React components and draws icons as data: URLs.
DOCS_CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
            "img-src 'self' data:; connect-src 'self'; font-src 'self' data:; base-uri 'none'; "
            "form-action 'none'; frame-ancestors 'none'")


def swagger_dir() -> Path | None:
    """Swagger UI's static files in the installed swagger-ui-py (found without importing it)."""
    spec = importlib.util.find_spec("swagger_ui")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "static"


def wants_json() -> bool:
    """True unless the client prefers HTML: browsers ask for text/html, API clients for JSON or */*."""
    return request.accept_mimetypes.best_match(["application/json", "text/html"]) != "text/html"


async def file_from(directory: Path, name: str, allowed: frozenset[str], csp: str) -> Response:
    if name not in allowed:
        raise HTTPError(404, f"Invalid URL (GET {request.path})", code="not_found")
    response = await send_from_directory(directory, name)
    response.headers["Content-Security-Policy"] = csp
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Cache-Control"] = "no-cache"  # revalidate (ETag): an upgrade shows at once
    return response


# The handlers of `/` (through `front`), `/static/<file>`, `/docs` and `/docs/assets/<file>`,
# in the route table (`_routes.py`); they take the app as every route's handler does.


async def front(index_json: Callable[[], Response]) -> Response:
    """`GET /`: `index_json()` for API clients, the chat page for browsers."""
    if wants_json():
        response = index_json()
    else:
        response = await file_from(STATIC, "index.html", PAGE_FILES, PAGE_CSP)
        response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["Vary"] = "Accept"
    return response


async def static_file(app: Any, name: str) -> Response:
    return await file_from(STATIC, name, PAGE_FILES - {"index.html"}, PAGE_CSP)


async def docs(app: Any) -> Response:
    return await file_from(STATIC, "docs.html", frozenset({"docs.html"}), DOCS_CSP)


async def docs_asset(app: Any, name: str) -> Response:
    directory = swagger_dir()
    if directory is None:
        raise HTTPError(404, "Swagger UI is not installed (pip install swagger-ui-py)", code="not_found")
    return await file_from(directory, name, SWAGGER_FILES, DOCS_CSP)
