#!/usr/bin/env bash
# The GPU benchmark in one command: for each model, the raw BatchGenerator
# ceiling (`trio-mlx bench --limit`), trio_mlx's engine in-process
# (`--engine`), trio_mlx's server and mlx_lm.server,
# driven with the same prompts by `trio-mlx bench`; JSON, PNG and a markdown
# table with the ratio to the ceiling land in OUTDIR.
#
#   scripts/gpu_bench.sh OUTDIR [MODEL ...]
#
# MODEL is any of smollm2-135m, llama-3.2-1b, llama-3.2-1b-4bit (default: all
# three, built here with random weights; bf16, the last one 4-bit), or tiny
# (a smoke test of this script that runs anywhere in seconds). Run one
# model per call to split the work. Needs the repo on PYTHONPATH (done here)
# and mlx / mlx-lm for the GPU (`pip install -e .[cuda13]`). Knobs (env):
#   PYTHON=python  CONCURRENCY=1,8,32,64,128,256  PROMPT_TOKENS=128
#   MAX_TOKENS=128  PORT=8811  PREFILL_BATCH=8  PREFILL_STEP=2048
#   BENCH_LIMIT=300            (seconds one target's whole sweep may take)
#   SKIP=ceiling,engine,trio,mlx_lm   (targets to leave out)
#   MLX_LM_CONCURRENCY=...     (mlx_lm.server's levels; default CONCURRENCY)
#   ACTORS=process             (where trio_mlx's GPU actor runs, engine and server
#                               targets: thread, process, or both: thread,process)
#   ADMIT_WINDOWS=             (comma-separated admit windows in seconds for the engine
#                               and server targets; default: the engine's own)
#   RETIRE_STEPS=              (comma-separated TRIO_MLX_RETIRE_STEPS for the engine and
#                               server targets; default: the actor's own)
#   REQUESTS_MULTIPLE=4        (requests per level = this x concurrency, at least 8)
#   TRACE=1                    (each engine/server target writes its actor's step trace
#                               to OUTDIR/logs/MODEL-TARGET.trace.tsv, each ceiling its
#                               own, in the same columns, to MODEL-...-ceiling.trace.tsv)
#   CEILING_AFTER=1            (measure the ceiling again after the servers; each level's
#                               bar in the table is the faster of the two; 0: once)
#   PAIRED=1                   (the trio_mlx server's bench also runs the ceiling in its own
#                               process, interleaved level by level: `bench --paired`; use
#                               with SKIP=ceiling CEILING_AFTER=0 so the table's bar is that one)
#   PAIRED_ROUNDS=1            (with PAIRED=1: interleave each level in this many rounds of
#                               ceiling, server, server, ceiling: `bench --paired-rounds`)
#   PAIRED_CACHE_GB=16         (with PAIRED=1: TRIO_MLX_CACHE_LIMIT_GB for the bench's ceiling,
#                               so that it and the server fit on one GPU at c=256)
#   RATES=                     (e.g. 2,8,32: also run trio_mlx's server with Poisson
#                               arrivals at these requests/s, RATE_REQUESTS=48 per level)
#   TRIO_NO_PACING=1           (also run trio_mlx with --max-event-rate 0)
#   MLX_LM_BIG_BACKLOG=1       (also run mlx_lm.server with a listen backlog
#                               of 1024 instead of socketserver's 5, which is
#                               what resets its connections under bursts)
set -euo pipefail
out="${1:?usage: scripts/gpu_bench.sh OUTDIR [smollm2-135m|llama-3.2-1b|llama-3.2-1b-4bit|tiny ...]}"
shift
mkdir -p "$out"
out="$(cd "$out" && pwd)"  # OUTDIR is relative to where this was called from
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(smollm2-135m llama-3.2-1b llama-3.2-1b-4bit)

py="${PYTHON:-python}"
conc="${CONCURRENCY:-1,8,32,64,128,256}"
prompt="${PROMPT_TOKENS:-128}"
maxtok="${MAX_TOKENS:-128}"
port="${PORT:-8811}"
pbatch="${PREFILL_BATCH:-8}"
pstep="${PREFILL_STEP:-2048}"
limit="${BENCH_LIMIT:-300}"
skip=",${SKIP:-},"
IFS=, read -r -a actors <<<"${ACTORS:-process}"
IFS=, read -r -a windows <<<"${ADMIT_WINDOWS:-default}"
IFS=, read -r -a retires <<<"${RETIRE_STEPS:-default}"
multiple="${REQUESTS_MULTIPLE:-4}"
maxbatch=$(tr ',' '\n' <<<"$conc" | sort -n | tail -1)
device=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1 || true)
device="${device:-$(uname -srm)}; mlx $("$py" -c 'import mlx.core as m; print(m.__version__)' 2>/dev/null || echo '?')"

mkdir -p "$out/models" "$out/logs"
server_pid=""
cleanup() { [ -n "$server_pid" ] && kill -KILL "$server_pid" 2>/dev/null || true; }
trap cleanup EXIT

log() { printf '\n=== %s  %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

wait_ready() {  # URL PID: until URL answers 200, the process dies (fail) or 10 min pass (fail)
  local url=$1 pid=$2 i
  for ((i = 0; i < 1200; i++)); do
    kill -0 "$pid" 2>/dev/null || { echo "server exited before it was ready" >&2; return 1; }
    if command -v curl >/dev/null; then
      curl -sf -o /dev/null --max-time 2 "$url" && return 0
    else
      "$py" -c 'import sys,urllib.request as u; sys.exit(u.urlopen(sys.argv[1],timeout=2).status!=200)' \
        "$url" 2>/dev/null && return 0
    fi
    sleep 0.5
  done
  echo "server not ready after 10 min" >&2
  return 1
}

stop_server() {  # SIGTERM, 30 s grace, then SIGKILL
  local i
  [ -n "$server_pid" ] || return 0
  kill -TERM "$server_pid" 2>/dev/null || true
  for ((i = 0; i < 60; i++)); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.5; done
  kill -KILL "$server_pid" 2>/dev/null || true
  wait "$server_pid" 2>/dev/null || true
  server_pid=""
}

trace() {  # TARGET: with TRACE=1, step traces of a target (the model's $name, the run's $sfx);
  # a paired ceiling runs in the bench's process, so its trace is its own
  [ "${TRACE:-0}" = 1 ] || return 0
  export TRIO_MLX_STEP_TRACE="$out/logs/$name-$1$sfx.trace.tsv"
  export TRIO_MLX_CEILING_TRACE="$out/logs/$name-$1$sfx-ceiling.trace.tsv"
}

bench() {  # NAME-OF-RUN JSON ARGS...: one sweep; errors are results, not failures
  local label=$1 json=$2 levels=(--concurrency "$conc")
  shift 2
  [[ " $* " == *" --rate "* ]] && levels=()  # a Poisson sweep: its rates are its levels
  local envs=()  # a paired ceiling shares the GPU with the server: bound its MLX cache
  [[ " $* " == *" --paired "* ]] && envs=(env "TRIO_MLX_CACHE_LIMIT_GB=${PAIRED_CACHE_GB:-16}")
  timeout "$limit" ${envs[@]+"${envs[@]}"} "$py" -m trio_mlx.cli bench --model "$dir" --prompt-tokens "$prompt" \
    --max-tokens "$maxtok" "${levels[@]}" --label "$label" --device "$device" \
    --timeout 120 --warmup "$maxbatch" --requests-multiple "$multiple" --out "$json" "$@" \
    || echo "($label: exit status $?; errors, if any, are in $json)" >&2
}

add_run() {  # JSON: a target that produced no results (killed at its time cap) is left out
  if [ -f "$1" ]; then runs+=("$1"); else echo "(no results in $1)" >&2; fi
}

serve_and_bench() {  # LABEL JSON-NAME HEALTH-PATH BENCH-ARGS... -- SERVER-COMMAND...
  local label=$1 json=$2 health=$3
  shift 3
  local bargs=()
  while [ "$1" != "--" ]; do bargs+=("$1"); shift; done
  shift
  log "$name: $label"
  "$@" >"$out/logs/$name-$json.log" 2>&1 &
  server_pid=$!
  if wait_ready "http://127.0.0.1:$port$health" "$server_pid"; then
    bench "$label" "$out/$name-$json.json" --url "http://127.0.0.1:$port" \
      --server-pid "$server_pid" "${bargs[@]}"
    add_run "$out/$name-$json.json"
    [[ " ${bargs[*]} " == *" --paired "* ]] && add_run "$out/$name-$json-ceiling.json"
  else
    tail -20 "$out/logs/$name-$json.log" >&2
  fi
  stop_server
}

summary=()
for name in "${models[@]}"; do
  case "$name" in
    smollm2-135m) build=(--shape smollm2-135m --dtype bfloat16) ;;
    llama-3.2-1b) build=(--shape llama-3.2-1b --dtype bfloat16) ;;
    llama-3.2-1b-4bit) build=(--shape llama-3.2-1b --dtype bfloat16 --bits 4) ;;
    tiny) build=(--shape tiny --dtype float32) ;;  # a smoke test of this script, on any CPU
    *) echo "unknown model $name" >&2; exit 2 ;;
  esac
  dir="$out/models/$name"
  if [ ! -f "$dir/config.json" ]; then
    log "$name: building random-weight model"
    "$py" -m trio_mlx.cli model build "$dir" "${build[@]}" --seed 0
  fi
  dir="$(cd "$dir" && pwd)"
  runs=()

  if [[ $skip != *,ceiling,* ]]; then
    log "$name: raw BatchGenerator ceiling"
    [ "${TRACE:-0}" = 1 ] && export TRIO_MLX_CEILING_TRACE="$out/logs/$name-ceiling.trace.tsv"
    bench ceiling "$out/$name-ceiling.json" --limit --max-batch "$maxbatch" \
      --prefill-batch-size "$pbatch" --prefill-step-size "$pstep"
    add_run "$out/$name-ceiling.json"
    unset TRIO_MLX_CEILING_TRACE
  fi
  for actor in "${actors[@]}"; do
   for window in "${windows[@]}"; do
    for retire in "${retires[@]}"; do
    # one actor, window and retire: the names of earlier runs; several: each named after them
    sfx="" lsfx="" wargs=()
    [ ${#actors[@]} -gt 1 ] && sfx="-$actor" lsfx=" ($actor actor)"
    if [ "$window" != default ]; then
      wargs=(--admit-window "$window")
      [ ${#windows[@]} -gt 1 ] && sfx="$sfx-w$window" lsfx="$lsfx (window $window)"
    fi
    if [ "$retire" != default ]; then
      export TRIO_MLX_RETIRE_STEPS="$retire"
      [ ${#retires[@]} -gt 1 ] && sfx="$sfx-r$retire" lsfx="$lsfx (retire $retire)"
    fi
    if [[ $skip != *,engine,* ]]; then
      log "$name: trio_mlx engine in-process (channel API, no HTTP)$lsfx"
      trace engine
      bench "engine$lsfx" "$out/$name-engine$sfx.json" --engine --actor "$actor" --max-batch "$maxbatch" \
        --prefill-batch-size "$pbatch" --prefill-step-size "$pstep" "${wargs[@]}"
      add_run "$out/$name-engine$sfx.json"
    fi
    if [[ $skip != *,trio,* ]]; then
      trace trio
      pargs=()
      [ "${PAIRED:-0}" = 1 ] && pargs=(--paired "$out/$name-trio$sfx-ceiling.json" --max-batch "$maxbatch"
        --prefill-batch-size "$pbatch" --prefill-step-size "$pstep" --paired-rounds "${PAIRED_ROUNDS:-1}")
      serve_and_bench "trio_mlx$lsfx" "trio$sfx" /health "${pargs[@]}" -- \
        "$py" -m trio_mlx.cli serve --model "$dir" --host 127.0.0.1 --port "$port" \
        --max-batch "$maxbatch" --prefill-batch "$pbatch" --prefill-step "$pstep" \
        --actor "$actor" --no-access-log --log-level warning "${wargs[@]}"
    fi
    unset TRIO_MLX_STEP_TRACE TRIO_MLX_CEILING_TRACE TRIO_MLX_RETIRE_STEPS
    done
   done
  done
  if [ -n "${RATES:-}" ] && [[ $skip != *,trio,* ]]; then  # staggered arrivals: TTFT tails
    [ "${TRACE:-0}" = 1 ] && export TRIO_MLX_STEP_TRACE="$out/logs/$name-trio_poisson.trace.tsv"
    # its batch is the server's default, not the closed loop's largest level: arrivals
    # at a rate are not capped by a concurrency, and a cap would queue them
    serve_and_bench "trio_mlx Poisson" trio_poisson /health --rate "$RATES" \
      --requests-per-level "${RATE_REQUESTS:-48}" -- \
      "$py" -m trio_mlx.cli serve --model "$dir" --host 127.0.0.1 --port "$port" \
      --prefill-batch "$pbatch" --prefill-step "$pstep" \
      --actor "${actors[0]}" --no-access-log --log-level warning
    unset TRIO_MLX_STEP_TRACE
  fi
  if [ "${TRIO_NO_PACING:-0}" = 1 ]; then  # the same server with adaptive SSE pacing off
    serve_and_bench "trio_mlx no pacing" trio_nopacing /health -- \
      "$py" -m trio_mlx.cli serve --model "$dir" --host 127.0.0.1 --port "$port" \
      --max-batch "$maxbatch" --prefill-batch "$pbatch" --prefill-step "$pstep" \
      --actor "${actors[0]}" --max-event-rate 0 --no-access-log --log-level warning
  fi
  mlx_args=(--model "$dir" --host 127.0.0.1 --port "$port" --decode-concurrency "$maxbatch"
    --prompt-concurrency "$pbatch" --prefill-step-size "$pstep" --log-level WARNING)
  if [[ $skip != *,mlx_lm,* ]]; then
    # mlx_lm.server has no ignore_eos: a sequence that samples EOS ends short
    # and counts as an error (short_output). "default_model" is its name for
    # the --model it was started with (any other name makes it load a model).
    # Its warm-up stays small: a full-width burst meets socketserver's listen
    # backlog of 5 (see MLX_LM_BIG_BACKLOG) and eats the whole time cap.
    serve_and_bench mlx_lm.server mlx_lm /health --served-model-name default_model \
      --concurrency "${MLX_LM_CONCURRENCY:-$conc}" --warmup 2 -- \
      "$py" -m mlx_lm server "${mlx_args[@]}"
  fi
  if [ "${MLX_LM_BIG_BACKLOG:-0}" = 1 ]; then
    serve_and_bench "mlx_lm.server backlog 1024" mlx_lm_backlog /health \
      --served-model-name default_model -- \
      "$py" -c 'import socketserver, sys; socketserver.TCPServer.request_queue_size = 1024
sys.argv[0] = "mlx_lm.server"; from mlx_lm.server import main; main()' "${mlx_args[@]}"
  fi

  if [[ $skip != *,ceiling,* ]] && [ "${CEILING_AFTER:-1}" = 1 ]; then
    log "$name: raw BatchGenerator ceiling, again after the servers"
    [ "${TRACE:-0}" = 1 ] && export TRIO_MLX_CEILING_TRACE="$out/logs/$name-ceiling-after.trace.tsv"
    bench "ceiling (after)" "$out/$name-ceiling-after.json" --limit --max-batch "$maxbatch" \
      --prefill-batch-size "$pbatch" --prefill-step-size "$pstep"
    add_run "$out/$name-ceiling-after.json"
  fi

  if [ ${#runs[@]} -gt 0 ]; then
    "$py" -m trio_mlx.cli bench plot "${runs[@]}" -o "$out/$name.png" >/dev/null
    "$py" -m trio_mlx.cli bench table "${runs[@]}" -o "$out/$name.md" >/dev/null
    summary+=("$name")
  fi
done

{
  echo "# trio-mlx bench: $device"
  echo
  echo "prompt $prompt / output $maxtok tokens, concurrency $conc, prefill batch $pbatch, step $pstep"
  for name in "${summary[@]}"; do
    printf '\n## %s\n\n![%s](%s.png)\n\n' "$name" "$name" "$name"
    cat "$out/$name.md"
  done
} >"$out/summary.md"
cat "$out/summary.md"
