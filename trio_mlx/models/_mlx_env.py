"""MLX settings that MLX reads from the environment once, at their first use: the runtime's
defaults, put in place where the user set none, before anything runs on the device.

`MLX_CUDA_GRAPH_CACHE_SIZE`: MLX's CUDA backend records a step's kernels into CUDA graphs
and keeps up to this many instantiated graphs to reuse (default 100); once it holds more it
drops them all (mlx/backend/cuda/device.cpp), and each is instantiated again, on the host,
at its next use. A server meets new graphs at each shape new to the process (a KV cache's
first growth past 256, 512, ... tokens; a batch of a new width). On an H200 (1B shape),
1000 against 100:
- the step at a KV cache's first growth past 256 and 512 tokens: 320-330 ms -> 45-75 ms;
- one and four users: 1.04-1.45x the tokens, in three rounds against 100 in alternating
  order: the plain step at one row stayed at ~2.5 ms where 100 left it at ~3.9 in two of
  the three processes.
(BENCHMARKS.md, "What the runtime does because of a measurement".) What 1000 graphs hold
was not measured: a graph holds its kernels' parameters, not the buffers they use.

No MLX here: `models/__init__.py` calls `install()` before importing the modules that do.
A process that ran MLX on the device before importing trio_mlx keeps what MLX read then.
"""

from __future__ import annotations

import os

DEFAULTS = {"MLX_CUDA_GRAPH_CACHE_SIZE": "1000"}


def install() -> None:
    """Each of `DEFAULTS` the environment does not set already (the user's value wins)."""
    for name, value in DEFAULTS.items():
        os.environ.setdefault(name, value)
