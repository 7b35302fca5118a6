#!/usr/bin/env bash
# experiment: thread actor with the synchronous link, the ahead link, and the process actor
set -uo pipefail
out="$1"; shift; order=("$@")
mkdir -p "$out"; cd "$(dirname "$0")/../../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=python3; port=8821; dir=/root/model-1b
[ -d "$dir" ] || $py -m trio_mlx.cli model build "$dir" --shape llama-3.2-1b --dtype bfloat16 --seed 0 >/dev/null
export MLX_PTX_CACHE_DIR=/root/ptx
i=0
for v in "${order[@]}"; do
  i=$((i+1))
  actor=thread; extra=()
  case $v in ahead) extra=(env TRIO_MLX_EXPERIMENT_LINK=ahead);; process) actor=process;; sw*) extra=(env TRIO_MLX_EXPERIMENT_SWITCH=0.${v#sw});; esac
  t0=$(date +%s)
  env TRIO_MLX_STEP_TRACE="$out/trace-$v-$i.tsv" "${extra[@]}" $py -m trio_mlx.cli serve --model "$dir" --port $port --max-batch 256 --actor $actor --no-access-log >"$out/$v-$i.log" 2>&1 &
  pid=$!
  for ((k=0;k<600;k++)); do curl -sf -o /dev/null --max-time 2 http://127.0.0.1:$port/ready && break; kill -0 $pid || break; sleep 0.5; done
  echo "$v-$i ready after $(( $(date +%s)-t0 )) s"
  $py -m trio_mlx.cli bench --url http://127.0.0.1:$port --model "$dir" --concurrency ${CONC:-64,256} --prompt-tokens 128 --max-tokens 128 --timeout 120 --requests-multiple 4 --warmup 8 --label $v --out "$out/links-$v-$i.json" --quiet --server-pid $pid || echo "bench exit $?"
  kill -TERM $pid; for ((k=0;k<40;k++)); do kill -0 $pid 2>/dev/null || break; sleep 0.5; done; kill -KILL $pid 2>/dev/null; wait $pid 2>/dev/null
  gzip -f "$out/trace-$v-$i.tsv" 2>/dev/null; rm -f "$out/trace-$v-$i.tsv.gz"
  $py - "$out/links-$v-$i.json" <<'PY'
import json,sys
for lv in json.load(open(sys.argv[1]))["levels"]:
    print(sys.argv[1].split('/')[-1], lv["concurrency"], round(lv["output_throughput"]), "errors", lv.get("errors"), "cpu us/tok", lv.get("server_main_thread_cpu_us_per_token"), "ttft p50", lv.get("ttft_p50_ms") or lv.get("ttft_ms",{}))
PY
done
