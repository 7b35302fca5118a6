"""The ASGI application object: `hypercorn trio_mlx.app:app`, or any ASGI server.

Built by `create_app()` from the TRIO_MLX_* environment (see `server/_settings.py`);
with none set it serves the embedded default model. Importing this module is
cheap: the model loads when the server starts (the ASGI lifespan), not here.

Under hypercorn's trio worker (`hypercorn -k trio`) the app runs natively;
under an asyncio server (hypercorn's default worker, uvicorn, granian) it runs
in trio's guest mode on that server's loop (`server/_guest.py`), one process either
way. Run one worker per model and device (a second one is refused). On
SIGTERM each server finishes in-flight requests within its own graceful
timeout, then the app's lifespan shutdown stops the engine: hypercorn's
default of 3 s (`--graceful-timeout`) cuts longer streams without a terminal
event, so raise it past your longest request; uvicorn waits for them unless
`--timeout-graceful-shutdown` is set; granian waits for them. `trio-mlx serve`
configures hypercorn for you and drains on SIGTERM (TRIO_MLX_DRAIN_TIMEOUT).
"""

from .server._app import TrioMLXApp as TrioMLXApp
from .server._app import create_app as create_app
from .server._records import RequestRecord as RequestRecord
from .server._settings import Settings as Settings

app = create_app()
