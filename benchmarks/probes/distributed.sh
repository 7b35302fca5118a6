#!/usr/bin/env bash
# Tensor parallel over two GPUs of one host (NCCL) against one GPU, and against mlx_lm.server's
# distributed mode, on random-weight Llama-shaped models; alternated in rounds so that the
# host's drift weighs on every side alike (BENCHMARKS.md, "Method").
#
#   benchmarks/probes/distributed.sh OUTDIR
#
# Needs a host with at least two CUDA GPUs and mlx[cuda] (the nvidia-h200-x2 kind). Per model
# shape (SHAPES, default "llama-3.2-1b llama-3.1-8b"; bf16) and round (ROUNDS, default 2):
#   single:  CUDA_VISIBLE_DEVICES=0 trio-mlx serve MODEL
#   tp:      mlx.launch --backend nccl -n 2 -- python -m trio_mlx.cli serve MODEL --distributed tensor
#   mlx_lm:  mlx.launch --backend nccl -n 2 -- python -m mlx_lm.server --model MODEL
# each driven by `trio-mlx bench` at CONCURRENCY (1,8,64), PROMPT_TOKENS=128, MAX_TOKENS=128,
# greedy, streamed /v1/completions. Order per round: single, tp, mlx_lm, then reversed.
# Results: OUTDIR/<shape>-<side>-<round>.json and OUTDIR/summary.md (output tok/s and TTFT p50
# per side and level, and tp / single; then, from the step traces (<shape>-<side>-<round>.trace,
# rank 1's beside it as .trace.rank1), the median decode step and a follower's median wait for
# rank 0's message at each batch width). Knobs: PORT=8831 NCCL_PORT=12345 PYTHON=python3;
# BACKEND=ring (RING_PORT=32323) runs it on two CPU processes instead, as a dry run. Then, per
# shape, benchmarks/probes/probe_dist_exchange.py (the per-step message's cost on the raw decode
# steps: none / sent just before its step / a step ahead) into OUTDIR/<shape>-exchange.txt and the
# summary; EXCHANGE=0 skips it. SIDES (default "single tp mlx_lm") picks the sides run; TP_ENV
# (e.g. MLX_USE_CUDA_GRAPHS=0) is set for the tp side's ranks alone.
# Time: ~2 min to build the 8B model, then ~1-2 min per run: ~25 min for 2 shapes x 2 rounds;
# one shape and one round (SHAPES=llama-3.2-1b ROUNDS=1) fits a 10-minute command.
set -euo pipefail
out="${1:?usage: distributed.sh OUTDIR}"
mkdir -p "$out" && out="$(cd "$out" && pwd)"
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py="${PYTHON:-python3}"
launch="$(dirname "$(command -v "$py")")/mlx.launch"
[ -x "$launch" ] || launch="mlx.launch"
port="${PORT:-8831}"
rounds="${ROUNDS:-2}"
export MLX_PTX_CACHE_DIR="${MLX_PTX_CACHE_DIR:-$out/ptx-cache}"
backend="${BACKEND:-nccl}"  # BACKEND=ring runs the same comparison on two CPU processes (a dry run)
if [ "$backend" = nccl ]; then
  ngpu="$(nvidia-smi -L 2>/dev/null | wc -l || echo 0)"
  if [ "$ngpu" -lt 2 ]; then
    echo "distributed.sh needs two GPUs (found $ngpu): no multi-GPU comparison made" | tee "$out/summary.md" >&2
    exit 2
  fi
  nvidia-smi -L >"$out/gpus.txt"
  group=(--backend nccl -n 2 --nccl-port "${NCCL_PORT:-12345}")
else
  group=(--backend ring -n 2 --starting-port "${RING_PORT:-32323}")
fi
server_pgid=""
trap '[ -n "$server_pgid" ] && kill -KILL -- "-$server_pgid" 2>/dev/null || true' EXIT

start() {  # NAME COMMAND...: start in a process group of its own, wait until it serves
  local name=$1 i
  shift
  setsid "$@" >"$out/$name.log" 2>&1 &
  server_pgid=$!
  for ((i = 0; i < 1800; i++)); do
    kill -0 "$server_pgid" 2>/dev/null || { echo "$name exited before ready" >&2; tail -20 "$out/$name.log" >&2; return 1; }
    curl -sf -o /dev/null --max-time 2 "http://127.0.0.1:$port/health" && return 0
    sleep 0.5
  done
  return 1
}

stop() {  # SIGTERM trio_mlx's rank 0 (it drains and stops every rank: their step traces are
  # written out), then the whole group (the launcher and every rank), then make sure
  local leader
  leader="$(curl -sf --max-time 2 "http://127.0.0.1:$port/health" | "$py" -c \
    'import json, sys; print(json.load(sys.stdin).get("actor_pid") or "")' 2>/dev/null || true)"
  if [ -n "$leader" ]; then
    kill -TERM "$leader" 2>/dev/null || true
    for ((i = 0; i < 60; i++)); do kill -0 "$server_pgid" 2>/dev/null || break; sleep 0.5; done
  fi
  kill -TERM -- "-$server_pgid" 2>/dev/null || true
  for ((i = 0; i < 90; i++)); do kill -0 "$server_pgid" 2>/dev/null || break; sleep 0.5; done
  kill -KILL -- "-$server_pgid" 2>/dev/null || true
  wait "$server_pgid" 2>/dev/null || true
  server_pgid=""
  sleep 2  # NCCL's port and the GPUs' memory free
}

bench() {  # LABEL JSON MODEL [ARGS...]
  local label=$1 json=$2 model=$3
  shift 3
  "$py" -m trio_mlx.cli bench --url "http://127.0.0.1:$port" --model "$model" --concurrency "${CONCURRENCY:-1,8,64}" \
    --prompt-tokens "${PROMPT_TOKENS:-128}" --max-tokens "${MAX_TOKENS:-128}" --timeout 300 \
    --requests-multiple 4 --warmup 8 --label "$label" --out "$json" --quiet "$@" || echo "($label: exit $?)" >&2
}

run() {  # SHAPE SIDE ROUND
  local shape=$1 side=$2 r=$3 dir="$out/$1"
  case "$side" in
    single) start "$shape-$side-$r" env CUDA_VISIBLE_DEVICES=0 "$py" -m trio_mlx.cli serve "$dir" --port "$port" \
              --max-batch 64 --no-access-log --step-trace "$out/$shape-$side-$r.trace" ;;
    tp) start "$shape-$side-$r" env ${TP_ENV:-} "$launch" "${group[@]}" -- \
          "$py" -m trio_mlx.cli serve "$dir" --port "$port" --max-batch 64 --no-access-log --distributed tensor \
          --step-trace "$out/$shape-$side-$r.trace" ;;
    mlx_lm) start "$shape-$side-$r" "$launch" "${group[@]}" -- \
              "$py" -m mlx_lm.server --model "$dir" --port "$port" ;;
  esac
  # mlx_lm.server's /v1/models reads the hub cache; "default_model" names its --model
  if [ "$side" = mlx_lm ]; then extra=(--served-model-name default_model); else extra=(); fi
  # One bounded request first: a server whose generation thread died (mlx-lm's sharded_load
  # fails over NCCL, see benchmarks/2026-11-29-h200x2/) would hold every bench request to its timeout.
  if [ "$side" != mlx_lm ] || curl -sf --max-time 180 "http://127.0.0.1:$port/v1/completions" \
      -H 'content-type: application/json' \
      -d '{"model": "default_model", "prompt": "Hello", "max_tokens": 4, "temperature": 0}' >/dev/null; then
    bench "$shape-$side" "$out/$shape-$side-$r.json" "$dir" "${extra[@]}"
  else
    echo "($shape-$side-$r: no answer to one request within 180 s; not benchmarked)" | tee -a "$out/skipped.txt" >&2
  fi
  stop
}

for shape in ${SHAPES:-llama-3.2-1b llama-3.1-8b}; do
  [ -d "$out/$shape" ] || "$py" -m trio_mlx.cli model build "$out/$shape" --shape "$shape" --dtype bfloat16 \
    --seed 0 >/dev/null
  for ((r = 1; r <= rounds; r++)); do
    if ((r % 2)); then order=(single tp mlx_lm); else order=(mlx_lm tp single); fi
    for side in "${order[@]}"; do
      if [[ " ${SIDES:-single tp mlx_lm} " == *" $side "* ]]; then run "$shape" "$side" "$r"; fi
    done
  done
  if [ "${EXCHANGE:-1}" = 1 ]; then  # the per-step message alone, no server (~1-2 min)
    timeout 600 "$launch" "${group[@]}" -- "$py" benchmarks/probes/probe_dist_exchange.py "$out/$shape" \
      >"$out/$shape-exchange.txt" 2>&1 || echo "($shape exchange probe: exit $?)" >&2
  fi
done

"$py" - "$out" <<'EOF' >"$out/summary.md"
import glob, json, os, sys
from collections import defaultdict
out = sys.argv[1]
tps = defaultdict(lambda: defaultdict(list))   # (shape, side) -> c -> [tok/s]
ttft = defaultdict(lambda: defaultdict(list))  # (shape, side) -> c -> [TTFT p50 ms]
for path in sorted(glob.glob(os.path.join(out, "*.json"))):
    shape, side, _ = os.path.basename(path)[:-5].rsplit("-", 2)
    for lv in json.load(open(path))["levels"]:
        tps[(shape, side)][lv["concurrency"]].append(lv["output_throughput"] or 0.0)
        if lv["ttft_ms"]["p50"] is not None:
            ttft[(shape, side)][lv["concurrency"]].append(lv["ttft_ms"]["p50"])
print("Output tok/s per round (TTFT p50 ms, mean of rounds); tp / single is the ratio of the sums.\n")
for shape in sorted({s for s, _ in tps}):
    print(f"## {shape}\n\n| c | single | tp (2 GPUs) | mlx_lm.server (2 GPUs) | tp / single |\n|---|---|---|---|---|")
    for c in sorted(set().union(*(tps[(shape, side)] for side in ("single", "tp", "mlx_lm")))):
        cells = []
        for side in ("single", "tp", "mlx_lm"):
            v, t = tps[(shape, side)][c], ttft[(shape, side)][c]
            cells.append(" / ".join(f"{x:,.0f}" for x in v) + (f" ({sum(t) / len(t):.0f} ms)" if t else "") if v else "-")
        s, p = tps[(shape, "single")][c], tps[(shape, "tp")][c]
        cells.append(f"{sum(p) / sum(s):.2f}" if sum(s) and p else "-")
        print(f"| {c} | " + " | ".join(cells) + " |")
    print()
print("Median plain decode step (ms: trace rows with no insert, at a width held 20 steps or more) and, for")
print("tp, rank 1's median wait for rank 0's message (ms): what is left of the command exchange per step.\n")
print("| run | width | steps | step (ms) | rank 1 waits (ms) |\n|---|---|---|---|---|")
def steps(path):
    out = {}
    try:
        rows = [l.rstrip("\n").split("\t") for l in open(path)]
    except OSError:
        return out
    rows = [list(map(float, r)) for r in rows if r and r[0] != "t"]
    for a, b in zip(rows, rows[1:]):
        if b[3] == 0 and b[8] == a[8] and b[8] > 0:
            out.setdefault(int(b[8]), []).append((b[0] - a[0], b[1]))
    return out
med = lambda v: sorted(v)[len(v) // 2]
for path in sorted(glob.glob(os.path.join(out, "*.trace"))):
    mine, theirs = steps(path), steps(path + ".rank1")
    for w, v in sorted((w, v) for w, v in mine.items() if len(v) >= 20):  # a steady width
        wait = f"{med([x[1] for x in theirs[w]]) * 1e3:.2f}" if theirs.get(w) else "-"
        print(f"| {os.path.basename(path)[:-6]} | {w} | {len(v)} | {med([x[0] for x in v]) * 1e3:.2f} | {wait} |")
EOF
if [ -f "$out/skipped.txt" ]; then { echo; cat "$out/skipped.txt"; } >>"$out/summary.md"; fi
for f in "$out"/*-exchange.txt; do
  if [ -f "$f" ]; then { echo; echo '```'; grep -v '^\[' "$f"; echo '```'; } >>"$out/summary.md"; fi
done
cat "$out/summary.md"
