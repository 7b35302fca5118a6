"""The trio side of the runtime: the engine, its request streams and public events.

It starts the GPU actor (`trio_mlx.actor`) and talks to it only through the
actor's protocol messages; the HTTP layer (`trio_mlx.server`) and library users
talk to it through `open_engine`, `Engine.generate` / `Engine.chat` and the
events below. No MLX here.

`freeze_heap` is what the engine does once its startup is over (`trio_mlx/_heap.py`): every
object alive now leaves the cyclic collector's walks. It is public for a process that holds
long-lived objects of its own and no engine: `trio-mlx bench`'s client (its tokenizer and
prompts), which imports only public names of the runtime.
"""

from .._errors import ModelCapacityError as ModelCapacityError
from .._errors import ModelLoadTimeoutError as ModelLoadTimeoutError
from .._heap import freeze_counted as freeze_heap  # noqa: F401  (a re-export under a public name: see above)
from ..actor import ActorTuning as ActorTuning
from ._engine import DEFAULT_MAX_TOKENS as DEFAULT_MAX_TOKENS
from ._engine import Engine as Engine
from ._engine import open_engine as open_engine
from ._events import EngineStatistics as EngineStatistics
from ._events import Event as Event
from ._events import Finished as Finished
from ._events import TextDelta as TextDelta
from ._events import TokenLogprob as TokenLogprob
from ._events import ToolCall as ToolCall
from ._events import ToolCallDelta as ToolCallDelta
from ._events import ToolCalls as ToolCalls
from ._events import Usage as Usage
from ._options import GenerationOptions as GenerationOptions
from ._pool import ModelPool as ModelPool
from ._pool import ModelStatus as ModelStatus
from ._pool import find_models as find_models
from ._stream import RequestStream as RequestStream
