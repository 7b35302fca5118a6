"""Access logs: one line per request, carrying the id sent back in the X-Request-Id header.

`trio-mlx serve` runs hypercorn with `AccessLogger` and `ACCESS_LOG_FORMAT`
(whose last field is the response's X-Request-Id). Under plain hypercorn, pass
`--access-logformat` with `%({x-request-id}o)s` for the same id.

Why a logger class: hypercorn 0.18 writes two lines for one request when the
client closes its connection as soon as it has the response (curl does, and
so do many probes). `HTTPStream._send_closed` awaits the final send before it
marks the stream closed; the connection-closed event that arrives meanwhile
finds the stream "still open" and logs a status-less line ("-"), then the
real line follows. `AccessLogger` holds a status-less line back until the
app's task for that request has returned (the app calls `request_done`): if
the real line came meanwhile, the held one was hypercorn's spurious line and
is dropped; otherwise the client really left early and the line is written,
with the request id the app recorded in the scope.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hypercorn.logging import Logger

from ._asgi import REQUEST_ID

_HELD = "trio_mlx.held_access_line"
_APP_DONE = "trio_mlx.app_done"

ACCESS_LOG_FORMAT = '%(h)s "%(R)s" %(s)s %(b)s %(L)ss "%(a)s" %({x-request-id}o)s'


class AccessLogger(Logger):
    """hypercorn's logger, minus the spurious second line, plus the request id on every line."""

    async def access(self, request: Any, response: Any, request_time: float) -> None:
        if self.access_logger is None:
            return
        if response is None and request.get("type") == "http" and not request.get(_APP_DONE):
            request[_HELD] = lambda: self._write(request, None, request_time)
            return
        request.pop(_HELD, None)
        self._write(request, response, request_time)

    def _write(self, request: Any, response: Any, request_time: float) -> None:
        assert self.access_logger is not None
        self.access_logger.info(self.access_log_format, self.atoms(request, response, request_time))

    def atoms(self, request: Any, response: Any, request_time: float) -> Mapping[str, str]:
        atoms: Any = super().atoms(request, response, request_time)
        rid = request.get(REQUEST_ID)
        if rid and "{x-request-id}o" not in atoms:
            atoms["{x-request-id}o"] = rid
        return atoms  # type: ignore[no-any-return]


def request_done(scope: dict[str, Any]) -> None:
    """The app's task for this request returned: write a held line (the client left early)."""
    scope[_APP_DONE] = True
    held: Callable[[], None] | None = scope.pop(_HELD, None)
    if held is not None:
        held()
