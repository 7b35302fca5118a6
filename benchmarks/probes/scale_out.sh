#!/usr/bin/env bash
# Scaling out on a two-GPU host (nvidia-h200-x2): tensor parallel over NCCL (every rank
# joins its group on the thread that uses it), and two replicas behind sglang-router.
# Run from the repository root.
#
#   bash benchmarks/probes/scale_out.sh setup               # once per fresh machine (~2-3 min)
#   bash benchmarks/probes/scale_out.sh smoke   OUT          # TP=2 starts and serves (~3 min; the fix)
#   bash benchmarks/probes/scale_out.sh tp      OUT [SHAPE]  # TP=2 vs 1 GPU vs mlx_lm.server, one shape
#   bash benchmarks/probes/scale_out.sh leads   OUT          # where a served TP step's time goes (~8 min; LEADS)
#   bash benchmarks/probes/scale_out.sh replicas OUT         # 1 GPU vs 2 replicas: cache-aware / round-robin
#
# Each mode fits one 10-minute command except `tp` with the 8B shape (split it: SHAPE=llama-3.1-8b
# ROUNDS=1, then again into the same OUT). Everything it writes goes under OUT ($OUT on the device).
set -euo pipefail
mode="${1:?usage: scale_out.sh setup|smoke|leads|tp|replicas OUT}"
py="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ "$mode" = setup ]; then
  # mlx[cuda13] as pyproject.toml's extra; sglang-router for the replicas (a wheel, no build)
  "$py" -m pip install -q -e '.[cuda13,bench]' 'sglang-router>=0.3.2,<0.4' httpx
  "$py" -c "import mlx.core as mx; print(mx.__version__, mx.default_device())"
  exit 0
fi

out="${2:?usage: scale_out.sh $mode OUT}"
mkdir -p "$out" && out="$(cd "$out" && pwd)"
launch="$(dirname "$(command -v "$py")")/mlx.launch"
[ -x "$launch" ] || launch=mlx.launch
export MLX_PTX_CACHE_DIR="${MLX_PTX_CACHE_DIR:-$out/ptx-cache}"
pgids=()
cleanup() { for g in "${pgids[@]}"; do kill -KILL -- "-$g" 2>/dev/null || true; done; }
trap cleanup EXIT

bg() {  # LOG COMMAND...: start COMMAND in a process group of its own
  local log=$1
  shift
  setsid "$@" >"$log" 2>&1 &
  pgids+=($!)
}

wait_ready() {  # URL LOG SECONDS: wait for the server that bg started last (it must stay up)
  local i pid="${pgids[-1]}"
  for ((i = 0; i < $3 * 2; i++)); do
    curl -sf -o /dev/null --max-time 2 "$1/ready" && return 0
    kill -0 "$pid" 2>/dev/null || { echo "exited before ready: $1" >&2; tail -40 "$2" >&2; return 1; }
    sleep 0.5
  done
  echo "not ready: $1" >&2
  tail -40 "$2" >&2
  return 1
}

model() {  # SHAPE: a random-weight bf16 model of that shape under OUT
  local dir="$out/model-$1"
  [ -d "$dir" ] || "$py" -m trio_mlx.cli model build "$dir" --shape "$1" --dtype bfloat16 --seed 0 \
    --spelled-padding >/dev/null
  echo "$dir"
}

case "$mode" in
smoke)
  # The failure this branch fixes: `mlx.launch --backend nccl -n 2 -- trio-mlx serve MODEL --distributed
  # tensor` died in sharded_load with "There is no Stream(gpu, 2) in current thread".
  dir="$(model llama-3.2-1b)"
  bg "$out/smoke-tp.log" "$launch" --backend nccl -n 2 -- "$py" -m trio_mlx.cli serve "$dir" \
    --distributed tensor --port 8831 --max-batch 64
  wait_ready http://127.0.0.1:8831 "$out/smoke-tp.log" 400
  grep -E "joined the group over nccl on the actor's thread|distributed: 2 ranks" "$out/smoke-tp.log"
  curl -s http://127.0.0.1:8831/health | tee "$out/smoke-health.json"; echo
  for i in 1 2 3; do
    curl -s http://127.0.0.1:8831/v1/completions -H 'content-type: application/json' \
      -d '{"prompt": "Hello", "max_tokens": 16, "temperature": 0}' | tee -a "$out/smoke-answers.jsonl"; echo
  done
  "$py" -m trio_mlx.cli bench --url http://127.0.0.1:8831 --model "$dir" --concurrency 1,8,64 \
    --prompt-tokens 128 --max-tokens 128 --label tp2 --out "$out/smoke-bench-tp2.json" || true
  cleanup; pgids=(); sleep 3
  # one GPU (the one rank 0 used: a server there would be refused), the same greedy prompt:
  # the text must match the two ranks'
  bg "$out/smoke-single.log" env CUDA_VISIBLE_DEVICES=0 "$py" -m trio_mlx.cli serve "$dir" --port 8832
  wait_ready http://127.0.0.1:8832 "$out/smoke-single.log" 300
  curl -s http://127.0.0.1:8832/v1/completions -H 'content-type: application/json' \
    -d '{"prompt": "Hello", "max_tokens": 16, "temperature": 0}' | tee "$out/smoke-single.json"; echo
  cleanup; pgids=(); sleep 3
  # mlx_lm.server's own tensor-parallel mode on the same two GPUs: one request, bounded, so
  # that a server whose generation thread died costs minutes of nobody's time
  bg "$out/smoke-mlx_lm.log" "$launch" --backend nccl -n 2 -- "$py" -m mlx_lm.server --model "$dir" --port 8833
  for ((i = 0; i < 600; i++)); do curl -sf -o /dev/null --max-time 2 http://127.0.0.1:8833/health && break; sleep 0.5; done
  curl -s --max-time 120 http://127.0.0.1:8833/v1/completions -H 'content-type: application/json' \
    -d '{"model": "default_model", "prompt": "Hello", "max_tokens": 16, "temperature": 0}' \
    | tee "$out/smoke-mlx_lm.json"; echo " (mlx_lm.server: curl exit ${PIPESTATUS[0]})"
  ;;
leads)
  # Where a served TP step's time goes (benchmarks/2026-11-29-h200x2/: 31-40 ms at one row of the
  # 1B, against 4.8 ms for the same shards stepped raw): the per-step message on the raw steps,
  # then the served ranks with mlx-lm's decode step, without CUDA graphs, and as they are: ~2 min
  # each, 8 in all; LEADS picks some (e.g. LEADS="raw mlx-step" in one call, the rest in another)
  shape="${SHAPE:-llama-3.2-1b}"  # CPU dry run: SHAPE=tiny BACKEND=ring
  dir="$(model "$shape")"
  leads="${LEADS:-raw owned mlx-step no-graphs}"
  if [[ " $leads " == *" raw "* ]]; then
    group=(--backend nccl -n 2)  # BACKEND=ring: a dry run on two CPU processes, as distributed.sh's
    if [ "${BACKEND:-nccl}" = ring ]; then group=(--backend ring -n 2 --starting-port "${RING_PORT:-32323}"); fi
    MODES=none,ahead WIDTHS=1,64 ROUNDS=2 STEPS=60 timeout 240 "$launch" "${group[@]}" -- \
      "$py" benchmarks/probes/probe_dist_exchange.py "$dir" 2>&1 | grep -v '^\[' | tee "$out/raw-steps.txt" || true
  fi
  for lead in owned:X=1 mlx-step:TRIO_MLX_DECODE_STEP=mlx no-graphs:MLX_USE_CUDA_GRAPHS=0; do
    [[ " $leads " == *" ${lead%%:*} "* ]] || continue
    mkdir -p "$out/${lead%%:*}"
    ln -sfn "$dir" "$out/${lead%%:*}/$shape"
    SIDES=tp TP_ENV="${lead#*:}" EXCHANGE=0 SHAPES="$shape" ROUNDS=1 CONCURRENCY=1,64 \
      timeout 200 benchmarks/probes/distributed.sh "$out/${lead%%:*}" | tail -8 || true
  done
  ;;
tp)
  # TP=2 against one GPU and mlx_lm.server's distributed mode, in paired rounds (the existing probe)
  SHAPES="${3:-${SHAPES:-llama-3.2-1b}}" ROUNDS="${ROUNDS:-2}" benchmarks/probes/distributed.sh "$out"
  ;;
replicas)
  # The agent-shape multi-turn workload of the prompt-cache benchmark (a shared ~1.8k-token system
  # prompt, ~1.1k-token user turns, the whole history resent every turn) at 8 and 64 conversations:
  # one GPU alone, then two replicas behind sglang-router, cache_aware (default balance and a low
  # balance threshold, since the system prompt is shared) and round_robin.
  dir="$(model "${SHAPE:-llama-3.2-1b}")"  # CPU dry run: SHAPE=tiny CONVERSATIONS=2 TURNS=2 SYSTEM_WORDS=30 USER_WORDS=10 MAX_TOKENS=4
  bench() {  # URL LABEL
    "$py" -m trio_mlx.cli bench chat --url "$1" --conversations "${CONVERSATIONS:-8,64}" --turns "${TURNS:-5}" \
      --system-words "${SYSTEM_WORDS:-380}" --user-words "${USER_WORDS:-230}" --max-tokens "${MAX_TOKENS:-32}" \
      --timeout 300 --warmup 2 --label "$2" \
      --served-model-name "$(basename "$dir")" --out "$out/replicas-$2.json" || echo "($2: exit $?)" >&2
  }
  replicas_up() {
    bg "$out/replica0.log" env CUDA_VISIBLE_DEVICES=0 "$py" -m trio_mlx.cli serve "$dir" --port 8841 --max-batch 64 \
      --no-access-log
    bg "$out/replica1.log" env CUDA_VISIBLE_DEVICES=1 "$py" -m trio_mlx.cli serve "$dir" --port 8842 --max-batch 64 \
      --no-access-log
    wait_ready http://127.0.0.1:8842 "$out/replica1.log" 300
    wait_ready http://127.0.0.1:8841 "$out/replica0.log" 300
  }
  router() {  # LABEL ROUTER-ARGS...
    local label=$1
    shift
    bg "$out/router-$label.log" sglang-router launch --host 127.0.0.1 --port 8840 --prometheus-port 29400 \
      --worker-urls http://127.0.0.1:8841 http://127.0.0.1:8842 --health-check-endpoint /ready \
      --log-level warn "$@"
    for ((i = 0; i < 60; i++)); do
      [ "$(curl -s http://127.0.0.1:8840/workers | "$py" -c 'import json,sys; print(sum(w["is_healthy"] for w in json.load(sys.stdin)["workers"]))' 2>/dev/null)" = 2 ] && break
      sleep 0.5
    done
    bench http://127.0.0.1:8840 "$label"
    curl -s http://127.0.0.1:8840/get_loads >"$out/router-$label-loads.json" || true
    kill -TERM -- "-${pgids[-1]}" 2>/dev/null || true
    sleep 1
  }
  bg "$out/single.log" env CUDA_VISIBLE_DEVICES=0 "$py" -m trio_mlx.cli serve "$dir" --port 8841 --max-batch 64 \
    --no-access-log
  wait_ready http://127.0.0.1:8841 "$out/single.log" 300
  bench http://127.0.0.1:8841 one-gpu
  kill -TERM -- "-${pgids[-1]}"; sleep 3
  # fresh replicas for each policy, so that no policy inherits another's prompt caches
  replicas_up; router cache-aware --policy cache_aware; cleanup; pgids=(); sleep 3
  if [ "${BALANCED:-1}" = 1 ]; then  # BALANCED=0 skips this policy
    replicas_up; router cache-aware-balanced --policy cache_aware --balance-abs-threshold 4 \
      --balance-rel-threshold 1.2; cleanup; pgids=(); sleep 3
  fi
  replicas_up; router round-robin --policy round_robin
  ;;
*)
  echo "unknown mode $mode" >&2
  exit 2
  ;;
esac
echo "results in $out"
