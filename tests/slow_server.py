"""`trio-mlx serve` with every decode step slowed down by a test fault hook, for process-level tests
(SIGTERM under load needs requests that last long enough to be caught in flight).

    python tests/slow_server.py STEP_SECONDS [trio-mlx serve arguments ...]
"""

from __future__ import annotations

import sys

from app_server import engine_factory, slow_steps

from trio_mlx.server._serve import main

if __name__ == "__main__":
    step = float(sys.argv[1])
    sys.exit(main(sys.argv[2:], engine_factory=engine_factory(fault_hook=slow_steps(step))))
