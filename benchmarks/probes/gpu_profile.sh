#!/usr/bin/env bash
# Where the server's CPU goes under load: py-spy samples a running
# `trio-mlx serve` (and its actor child, with --actor process) while
# `trio-mlx bench` holds CONCURRENCY streams open, and writes collapsed
# stacks (one "frame;frame;... count" line per stack) per process.
#
#   benchmarks/probes/gpu_profile.sh OUTDIR MODEL_DIR [ACTOR] [CONCURRENCY]
#
# ACTOR is thread (default) or process; CONCURRENCY defaults to 64. Needs
# py-spy (pip install py-spy) and the rights to ptrace (root on the GPU host).
# Read the result with any flame-graph tool that takes collapsed stacks (speedscope, inferno).
# On the Firecracker GPU host py-spy took almost no samples; TRIO_MLX_STEP_TRACE is what worked.
# Set TRIO_MLX_STEP_TRACE=FILE to have the actor log each step too.
# Knobs (env): PYTHON=python PORT=8812 SECONDS_TO_SAMPLE=12 RATE=250 PROMPT_TOKENS=128 MAX_TOKENS=128
set -euo pipefail
out="${1:?usage: benchmarks/probes/gpu_profile.sh OUTDIR MODEL_DIR [thread|process] [CONCURRENCY]}"
model="${2:?model directory}"
actor="${3:-thread}"
conc="${4:-64}"
py="${PYTHON:-python}"
port="${PORT:-8812}"
secs="${SECONDS_TO_SAMPLE:-12}"
tag="$actor-c$conc"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

"$py" -m trio_mlx.cli serve --model "$model" --host 127.0.0.1 --port "$port" --max-batch "$conc" \
  --actor "$actor" --no-access-log --log-level warning >"$out/serve-$tag.log" 2>&1 &
server=$!
trap 'kill -KILL $server 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  curl -sf -o /dev/null "http://127.0.0.1:$port/ready" && break
  kill -0 $server || { tail -20 "$out/serve-$tag.log"; exit 1; }
  sleep 0.5
done
# enough requests to outlast the sampling window
"$py" -m trio_mlx.cli bench --url "http://127.0.0.1:$port" --model "$model" --concurrency "$conc" \
  --prompt-tokens "${PROMPT_TOKENS:-128}" --max-tokens "${MAX_TOKENS:-128}" --requests-multiple 12 \
  --warmup "$conc" --server-pid $server --label "profile $tag" --out "$out/profile-$tag.json" \
  --quiet &
client=$!
sleep 6  # past the warm-up
py-spy record --pid $server --subprocesses --rate "${RATE:-250}" --duration "$secs" --format raw \
  --nonblocking --threads -o "$out/profile-$tag.txt" >/dev/null 2>&1 || echo "py-spy failed" >&2
wait $client || true
curl -s "http://127.0.0.1:$port/metrics" >"$out/metrics-$tag.txt" || true
# (a server that py-spy sampled sometimes aborts at exit inside a C++ destructor,
# "terminate called without an active exception"; unsampled, it exits cleanly)
kill -TERM $server; wait $server || true
