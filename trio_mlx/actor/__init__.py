"""The GPU actor: the one thread (or child process) that owns the model and every mx.array.

The engine talks to it only through the messages of `_protocol.py`. Importing
this package does not import MLX: `Actor`, `ThreadLink`, `run_actor_process`
and the ceiling load on first use (PEP 562), so a server whose actor runs in a
child process never loads MLX itself.

`ceiling` (`_ceiling.py`, mlx-lm's BatchGenerator and MLX's bare forward in a closed loop,
no server) is public for `trio-mlx bench`, which measures servers against it and imports no
private module of the runtime; it lives here because only `actor/` and `models/` import MLX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._link import ActorLink as ActorLink
from ._link import ActorPort as ActorPort
from ._protocol import Abort as Abort
from ._protocol import ActorConfig as ActorConfig
from ._protocol import ActorInfo as ActorInfo
from ._protocol import Command as Command
from ._protocol import FinishReason as FinishReason
from ._protocol import Grammar as Grammar
from ._protocol import SamplingParams as SamplingParams
from ._protocol import Shutdown as Shutdown
from ._protocol import StepReport as StepReport
from ._protocol import Submit as Submit
from ._protocol import TokenOut as TokenOut
from ._tuning import ActorTuning as ActorTuning

if TYPE_CHECKING:
    from ._actor import Actor as Actor
    from ._fake import FakeActor as FakeActor
    from ._link import ThreadLink as ThreadLink
    from ._process import run_actor_process as run_actor_process

_LAZY = {
    "Actor": "._actor",
    "FakeActor": "._fake",
    "ThreadLink": "._link",
    "run_actor_process": "._process",
    "ceiling": "._ceiling",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module = importlib.import_module(_LAZY[name], __name__)
        return module if name == "ceiling" else getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
