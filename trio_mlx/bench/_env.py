"""The TRIO_MLX_* actor knobs a bench run shares with the server, read as the server reads them.

`trio-mlx bench --engine` and the ceiling run MLX in the bench's own process; the
environment that tunes a server's actor (TRIO_MLX_RETIRE_STEPS, _DECODE_STEP, _IDLE_RELEASE,
_CACHE_LIMIT_GB, _STEP_TRACE, _PROMPT_CACHE_GB) tunes theirs, through the server's one parser.
"""

from __future__ import annotations

from typing import Any


def actor_knobs() -> dict[str, Any]:
    """The actor options set in the environment, as `open_engine` keywords."""
    from ..server._settings import Settings

    s = Settings.from_env()
    return {"retire_steps": s.retire_steps, "decode_step": s.decode_step, "idle_release": s.idle_release,
            "cache_limit_gb": s.cache_limit_gb, "step_trace": s.step_trace,
            "prompt_cache_gb": s.prompt_cache_gb}
