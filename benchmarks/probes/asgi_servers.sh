#!/usr/bin/env bash
# The same app under several ASGI servers, and the thread actor against the process actor,
# alternated in rounds so that the host's drift weighs on every side alike.
#
#   benchmarks/probes/asgi_servers.sh OUTDIR [asgi|actors|both]
#
# asgi:   `hypercorn -k trio trio_mlx.app:app` (native), `hypercorn trio_mlx.app:app` (asyncio,
#         through trio's guest mode) and `uvicorn trio_mlx.app:app` (likewise), each round in
#         that order and then reversed; `trio-mlx bench` at CONCURRENCY (1,8,64,256).
# actors: `trio-mlx serve` with the thread actor and with `--actor process`, thread, process,
#         process, thread per round pair, at ACTOR_CONCURRENCY (256), with the server's CPU.
# Knobs: MODEL_SHAPE=llama-3.2-1b DTYPE=bfloat16 ROUNDS=2 PROMPT_TOKENS=128 MAX_TOKENS=128
#        REQUESTS_MULTIPLE=4 PORT=8821 PYTHON=python3. Results: OUTDIR/*.json, one per run, and
#        OUTDIR/summary.md (output tok/s per run and the ratios to the native / thread side).
set -euo pipefail
out="${1:?usage: asgi_servers.sh OUTDIR [asgi|actors|both]}"
what="${2:-both}"
mkdir -p "$out" && out="$(cd "$out" && pwd)"
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py="${PYTHON:-python3}"
port="${PORT:-8821}"
rounds="${ROUNDS:-2}"
dir="$out/model"
[ -d "$dir" ] || "$py" -m trio_mlx.cli model build "$dir" --shape "${MODEL_SHAPE:-llama-3.2-1b}" \
  --dtype "${DTYPE:-bfloat16}" --seed 0 >/dev/null
export MLX_PTX_CACHE_DIR="${MLX_PTX_CACHE_DIR:-$out/ptx-cache}"
server_pid=""
trap '[ -n "$server_pid" ] && kill -KILL "$server_pid" 2>/dev/null || true' EXIT

start() {  # NAME COMMAND...: start a server on $port, wait until /ready
  local name=$1 i
  shift
  "$@" >"$out/$name.log" 2>&1 &
  server_pid=$!
  for ((i = 0; i < 1200; i++)); do
    kill -0 "$server_pid" 2>/dev/null || { echo "$name exited before ready" >&2; tail "$out/$name.log" >&2; return 1; }
    curl -sf -o /dev/null --max-time 2 "http://127.0.0.1:$port/ready" && return 0
    sleep 0.5
  done
  return 1
}

stop() {
  kill -TERM "$server_pid" 2>/dev/null || true
  for ((i = 0; i < 60; i++)); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.5; done
  kill -KILL "$server_pid" 2>/dev/null || true
  wait "$server_pid" 2>/dev/null || true
  server_pid=""
}

bench() {  # LABEL JSON CONCURRENCY [ARGS...]
  local label=$1 json=$2 conc=$3
  shift 3
  "$py" -m trio_mlx.cli bench --url "http://127.0.0.1:$port" --model "$dir" --concurrency "$conc" \
    --prompt-tokens "${PROMPT_TOKENS:-128}" --max-tokens "${MAX_TOKENS:-128}" --timeout 120 \
    --requests-multiple "${REQUESTS_MULTIPLE:-4}" --warmup 8 --label "$label" --out "$json" --quiet "$@" \
    || echo "($label: exit $?)" >&2
}

env_app=(env "TRIO_MLX_MODEL=$dir" TRIO_MLX_MAX_BATCH=256 TRIO_MLX_ACCESS_LOG=0)
# hypercorn gives the lifespan startup (model load and warm-up) 60 s; a first start on a GPU
# compiles its kernels for longer (MLX's PTX cache makes later starts quick)
printf 'startup_timeout = 900\ngraceful_timeout = 30\n' >"$out/hypercorn.toml"
asgi_run() {  # SERVER ROUND
  local s=$1 r=$2
  case "$s" in
    trio) start "$s-$r" "${env_app[@]}" "$py" -m hypercorn -k trio -c "$out/hypercorn.toml" -b "127.0.0.1:$port" trio_mlx.app:app ;;
    asyncio) start "$s-$r" "${env_app[@]}" "$py" -m hypercorn -c "$out/hypercorn.toml" -b "127.0.0.1:$port" trio_mlx.app:app ;;
    uvicorn) start "$s-$r" "${env_app[@]}" "$py" -m uvicorn --no-access-log --host 127.0.0.1 --port "$port" trio_mlx.app:app ;;
  esac
  bench "$s" "$out/asgi-$s-$r.json" "${CONCURRENCY:-1,8,64,256}" --server-pid "$server_pid"
  stop
}

actor_run() {  # ACTOR ROUND
  local a=$1 r=$2
  start "actor-$a-$r" "$py" -m trio_mlx.cli serve --model "$dir" --port "$port" --max-batch 256 \
    --actor "$a" --no-access-log
  bench "$a" "$out/actor-$a-$r.json" "${ACTOR_CONCURRENCY:-256}" --server-pid "$server_pid"
  stop
}

for ((r = 1; r <= rounds; r++)); do
  if [ "$what" != actors ]; then
    if ((r % 2)); then order=(trio asyncio uvicorn); else order=(uvicorn asyncio trio); fi
    for s in "${order[@]}"; do asgi_run "$s" "$r"; done
  fi
  if [ "$what" != asgi ]; then
    if ((r % 2)); then order=(thread process); else order=(process thread); fi
    for a in "${order[@]}"; do actor_run "$a" "$r"; done
  fi
done

"$py" - "$out" <<'EOF' >"$out/summary.md"
import glob, json, os, sys
from collections import defaultdict
out = sys.argv[1]
tps = defaultdict(lambda: defaultdict(list))  # kind-side -> concurrency -> [tok/s per round]
cpu = defaultdict(lambda: defaultdict(list))
for path in sorted(glob.glob(os.path.join(out, "*.json"))):
    kind, side, _ = os.path.basename(path)[:-5].split("-")
    for lv in json.load(open(path))["levels"]:
        tps[(kind, side)][lv["concurrency"]].append(lv["output_throughput"])
        if lv.get("server_main_thread_cpu_us_per_token") is not None:
            cpu[(kind, side)][lv["concurrency"]].append(lv["server_main_thread_cpu_us_per_token"])
for kind, base in (("asgi", "trio"), ("actor", "thread")):
    sides = sorted(s for k, s in tps if k == kind)
    if not sides:
        continue
    cpu_note = "; the event loop's (main thread's) CPU us/token" if kind == "actor" else ""
    print(f"## {kind}: output tok/s per round (ratio of the sums to {base}){cpu_note}\n")
    print("| c | " + " | ".join(sides) + " |")
    print("|---|" + "---|" * len(sides))
    for c in sorted(tps[(kind, base)]):
        cells = []
        for s in sides:
            v = tps[(kind, s)][c]
            ratio = sum(v) / sum(tps[(kind, base)][c]) if tps[(kind, base)][c] else float("nan")
            u = cpu[(kind, s)][c]
            cells.append(" / ".join(f"{x:,.0f}" for x in v) + f" (x{ratio:.2f})"
                         + (f"; {sum(u) / len(u):.0f} us" if u and kind == "actor" else ""))
        print(f"| {c} | " + " | ".join(cells) + " |")
    print()
EOF
cat "$out/summary.md"
