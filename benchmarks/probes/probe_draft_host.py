"""Probe: a draft model's K chained drafts, over and over, for a sampling profiler to say
where their host time goes (a draft model's step is host work: graphs and their encoding).

    PYTHONPATH=. py-spy record --native --format raw -o chain.txt -- \
        python3 benchmarks/probes/probe_draft_host.py MODEL [--k 4] [--reps 300]

The drafts are made as `_drafting._draft` makes them (`probe_spec_phases.chain`); printed:
the median wall and thread CPU ms of K drafts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import trio_mlx.models  # noqa: F401 - first: on MLX's Linux CPU wheel it loads OpenBLAS before mlx.core

sys.path.insert(0, str(Path(__file__).parent))
from probe_spec_phases import chain  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--reps", type=int, default=300)
    a = p.parse_args()
    from mlx_lm import load
    model, _ = load(a.model)
    wall, cpu = chain(model, a.k, a.reps)
    print(f"{a.k} drafts: {wall:.2f} ms ({cpu:.2f} CPU), median of {a.reps}")


if __name__ == "__main__":
    main()
