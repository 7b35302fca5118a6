"""What keeps web pages from driving a local server: the Host check and the JSON content type.

A page the user visits can reach a server on 127.0.0.1 in two ways:

- **DNS rebinding**: the page's own name (`attacker.example`) is made to
  resolve to 127.0.0.1, so the browser treats the server as same-origin and
  reads its answers. The request still says `Host: attacker.example`. So a
  connection that arrived over loopback must name a loopback host:
  `localhost` (and `*.localhost`), an address in 127.0.0.0/8 or `[::1]`,
  with any port, or a name in `allowed_hosts` (`--allowed-hosts`; `*` turns
  the check off, for a local reverse proxy that passes its own Host on).
  Anything else gets 403 `host_not_allowed`. Connections over other
  interfaces (a server bound to 0.0.0.0, reached from the network) are not
  restricted: there the name is the network's business.
- **A "simple" cross-origin POST**: `fetch` with a text/plain or form body
  (or a Blob without a type) skips the CORS preflight, so the server would
  run the generation even though the page cannot read the answer. Requiring
  `Content-Type: application/json` on request bodies (415 otherwise) makes
  every such request preflighted, and the preflight only succeeds for
  `cors_origins`.

This is what Jupyter and Vite do for the first, and what llama-server and
vLLM get from their frameworks' JSON parsing for the second.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from ._asgi import Scope, header
from ._http import HTTPError


def _loopback_address(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]").split("%")[0]).is_loopback
    except ValueError:
        return False


def _host_name(value: bytes) -> str:
    """The host of a Host header (`name`, `name:port`, `[v6]`, `[v6]:port`), lower-cased."""
    text = value.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[: text.find("]") + 1] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


def host_allowed(name: str, allowed: Sequence[str]) -> bool:
    if name == "localhost" or name.endswith(".localhost") or _loopback_address(name):
        return True
    name = name.rstrip(".")
    for entry in allowed:
        entry = entry.lower()
        if entry == "*" or entry == name or (entry.startswith(".") and (name.endswith(entry) or name == entry[1:])):
            return True
    return False


def check_host(scope: Scope, allowed: Sequence[str]) -> None:
    """403 for a request that came over loopback naming a host that is not local or allowed."""
    server = scope.get("server")
    if not server or not _loopback_address(str(server[0])):
        return
    value = header(scope, b"host")
    if value is None:
        return  # HTTP/1.0 without Host: not a browser
    name = _host_name(value)
    if not host_allowed(name, allowed):
        raise HTTPError(
            403, f"the host {name!r} is not allowed: this server, reached over loopback, answers "
            "only requests for localhost, 127.0.0.1 or [::1]; add the name to --allowed-hosts "
            "(TRIO_MLX_ALLOWED_HOSTS) to allow it", code="host_not_allowed")


def require_json(scope: Scope) -> None:
    """415 unless the request says its body is JSON."""
    ctype = header(scope, b"content-type")
    if ctype is None or ctype.split(b";")[0].strip().lower() != b"application/json":
        raise HTTPError(415, "the request body must be JSON, sent with 'Content-Type: application/json'",
                        code="unsupported_media_type")


def check_framing(scope: Scope) -> None:
    """400, closing the connection, for a request with both Content-Length and Transfer-Encoding:
    RFC 9112 section 6.3 says such a message may be a smuggling attempt, and the server must
    close the connection after answering it."""
    if header(scope, b"content-length") is not None and header(scope, b"transfer-encoding") is not None:
        raise HTTPError(400, "a request may not have both Content-Length and Transfer-Encoding",
                        code="invalid_framing", headers=[("Connection", "close")])


# Set in the ASGI scope once a request's body has been read whole.
BODY_READ = "trio_mlx.body_read"


def unread_body_close(scope: Scope) -> list[tuple[bytes, bytes]]:
    """`Connection: close` for an answer sent before the request's body was read (a 415, 401,
    405...): the server will not read the rest, so the connection cannot carry another request,
    and a keep-alive client must be told rather than find it closed under its next request."""
    if scope.get(BODY_READ):
        return []
    length = header(scope, b"content-length")
    if header(scope, b"transfer-encoding") is not None or (length is not None and length.strip() not in (b"", b"0")):
        return [(b"connection", b"close")]
    return []
