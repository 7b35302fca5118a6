"""trio_mlx: a trio-based serving runtime for MLX language models.

    async with trio_mlx.open_engine() as engine:
        async with engine.chat([{"role": "user", "content": "Hi"}], max_tokens=32) as events:
            async for event in events:
                ...

The HTTP server is `trio_mlx.app:app` (any ASGI server: `hypercorn trio_mlx.app:app`).
This module only re-exports. The layers, each a subpackage whose imports point down:
`server` (HTTP) -> `engine` (trio side) -> `actor` (MLX) -> `models`; `bench` beside.
docs/design.md walks one request through them.
"""

from . import _fdlimit
from ._errors import ContextLengthExceededError as ContextLengthExceededError
from ._errors import EngineBrokenError as EngineBrokenError
from ._errors import EngineClosedError as EngineClosedError
from ._errors import EngineRestartingError as EngineRestartingError
from ._errors import InvalidRequestError as InvalidRequestError
from ._errors import ModelLoadError as ModelLoadError
from ._errors import QueueFullError as QueueFullError
from ._errors import TrioMLXError as TrioMLXError
from .actor import SamplingParams as SamplingParams
from .engine import ActorTuning as ActorTuning
from .engine import Engine as Engine
from .engine import EngineStatistics as EngineStatistics
from .engine import Finished as Finished
from .engine import GenerationOptions as GenerationOptions
from .engine import RequestStream as RequestStream
from .engine import TextDelta as TextDelta
from .engine import TokenLogprob as TokenLogprob
from .engine import ToolCall as ToolCall
from .engine import ToolCallDelta as ToolCallDelta
from .engine import ToolCalls as ToolCalls
from .engine import Usage as Usage
from .engine import open_engine as open_engine

__version__ = "0.1.0"

_fdlimit.install()  # before anything imports mlx-lm, which would lower the open-file limit
