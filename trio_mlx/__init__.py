"""trio_mlx: a trio-based serving runtime for MLX language models.

    async with trio_mlx.open_engine() as engine:
        async with engine.chat([{"role": "user", "content": "Hi"}], max_tokens=32) as events:
            async for event in events:
                ...

The HTTP server is `trio_mlx.app:app` (any ASGI server: `hypercorn trio_mlx.app:app`).
This module only re-exports; every feature lives in a private module.
"""

from ._engine import Engine as Engine
from ._engine import RequestStream as RequestStream
from ._engine import open_engine as open_engine
from ._errors import ContextLengthExceededError as ContextLengthExceededError
from ._errors import EngineBrokenError as EngineBrokenError
from ._errors import EngineClosedError as EngineClosedError
from ._errors import InvalidRequestError as InvalidRequestError
from ._errors import ModelLoadError as ModelLoadError
from ._errors import QueueFullError as QueueFullError
from ._errors import TrioMLXError as TrioMLXError
from ._messages import EngineStatistics as EngineStatistics
from ._messages import Finished as Finished
from ._messages import SamplingParams as SamplingParams
from ._messages import TextDelta as TextDelta
from ._messages import TokenLogprob as TokenLogprob
from ._messages import Usage as Usage

__version__ = "0.1.0"
