"""Where trio_mlx keeps what it makes once: converted models, the CPU path's OpenBLAS copy."""

from __future__ import annotations

import os
import pathlib


def default_cache_dir() -> pathlib.Path:
    """$TRIO_MLX_CACHE_DIR, else $XDG_CACHE_HOME/trio_mlx, else ~/.cache/trio_mlx."""
    if explicit := os.environ.get("TRIO_MLX_CACHE_DIR"):
        return pathlib.Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(xdg).expanduser() / "trio_mlx"
