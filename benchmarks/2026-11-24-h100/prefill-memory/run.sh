#!/usr/bin/env bash
# experiment: prompt cache, 64 long conversations (OOM?) under prefill settings; c=1 trace
set -uo pipefail
out="$1"; shift
mkdir -p "$out"; cd "$(dirname "$0")/../../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=python3; port=8831; dir=/root/model-1b; url=http://127.0.0.1:$port
[ -d "$dir" ] || $py -m trio_mlx.cli model build "$dir" --shape llama-3.2-1b --dtype bfloat16 --seed 0 >/dev/null
export MLX_PTX_CACHE_DIR=/root/ptx
for spec in "$@"; do  # name:gb:conversations:extra-args(comma sep)
  IFS=: read -r name gb conv extra <<<"$spec"
  t0=$(date +%s)
  env TRIO_MLX_STEP_TRACE="$out/trace-$name.tsv" TRIO_MLX_PROMPT_CACHE_GB=$gb $py -m trio_mlx.cli serve --model "$dir" --port $port --max-batch 64 --no-access-log ${extra//,/ } >"$out/$name.log" 2>&1 &
  pid=$!
  for ((k=0;k<600;k++)); do curl -sf -o /dev/null --max-time 2 $url/ready && break; kill -0 $pid || break; sleep 0.5; done
  echo "$name ready after $(( $(date +%s)-t0 )) s"
  timeout 300 $py -m trio_mlx.cli bench chat --url $url --conversations $conv --turns 4 --system-words 380 --user-words 250 --max-tokens 32 --timeout 300 --warmup 2 --label $name --out "$out/chat-$name.json" >"$out/bench-$name.txt" 2>&1 || echo "bench exit $?"
  curl -s $url/metrics | grep -E "memory|prompt_cache" | grep -v "^#" >"$out/metrics-$name.txt"
  kill -TERM $pid; for ((k=0;k<40;k++)); do kill -0 $pid 2>/dev/null || break; sleep 0.5; done; kill -KILL $pid 2>/dev/null; wait $pid 2>/dev/null
  gzip -f "$out/trace-$name.tsv"
  tail -25 "$out/bench-$name.txt"; grep -ci "out of memory" "$out/$name.log"
done
tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")"
