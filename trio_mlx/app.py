"""The ASGI application object: `hypercorn -k trio trio_mlx.app:app`.

Built by `create_app()` from the TRIO_MLX_* environment (see `server/_settings.py`);
with none set it serves the embedded default model. Importing this module is
cheap: the model loads when the server starts (the ASGI lifespan), not here.

Run it with hypercorn's trio worker (`-k trio`); the default asyncio worker is
refused at startup. With plain hypercorn, set `--graceful-timeout` above
TRIO_MLX_DRAIN_TIMEOUT (hypercorn's default of 3 s cuts streams without a
terminal event); `trio-mlx serve` does all of this for you and also drains
on SIGTERM.
"""

from .server._app import TrioMLXApp as TrioMLXApp
from .server._app import create_app as create_app
from .server._records import RequestRecord as RequestRecord
from .server._settings import Settings as Settings

app = create_app()
