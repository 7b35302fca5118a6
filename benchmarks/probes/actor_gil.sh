#!/usr/bin/env bash
# Thread actor against process actor, with the step traces kept: where a thread actor's
# turns lose time (docs/design.md, rule 7). On a GPU host, from the repository root:
#
#   benchmarks/probes/actor_gil.sh OUT RUN...
#
# A RUN is `thread` or `process`, or NAME:ACTOR[:VAR=VALUE...] for a run named NAME
# with environment variables of its own (an experiment's switch).
# Builds the 1B shape (bf16) under /root/model-1b unless there, runs
# probe_step_python.py (how long a decode step holds the GIL) unless PROBE=0, then
# serves with each actor in the order given and loads it with `trio-mlx bench`
# (CONC levels, default 256; 128-token prompts and answers, 4 x c requests a level).
# For each run: the bench's JSON, the server log, the step trace (gzipped) and
# `trio-mlx bench trace`'s lines; each line of `summary.txt` names the run.
set -uo pipefail
out="$1"; shift; order=("$@")
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=python3; port=8823; dir=${MODEL_DIR:-/root/model-1b}
[ -d "$dir" ] || $py -m trio_mlx.cli model build "$dir" --shape llama-3.2-1b --dtype bfloat16 --seed 0 >/dev/null
if [ "${PROBE:-1}" = 1 ]; then
  $py benchmarks/probes/probe_step_python.py "$dir" 64 256 >"$out/probe_step_python.txt" 2>&1
  grep '^rows' "$out/probe_step_python.txt" | tee -a "$out/summary.txt"
fi
i=0
for run in "${order[@]}"; do
  IFS=: read -r -a parts <<<"$run"
  if [ ${#parts[@]} -gt 1 ]; then label=${parts[0]}; actor=${parts[1]}; envs=("${parts[@]:2}"); else label=$run; actor=$run; envs=(); fi
  i=$((i+1)); name="$label-$i"; t0=$(date +%s)
  env "${envs[@]}" TRIO_MLX_STEP_TRACE="$out/trace-$name.tsv" $py -m trio_mlx.cli serve --model "$dir" --port $port \
    --max-batch 256 --actor "$actor" --no-access-log >"$out/$name.log" 2>&1 &
  pid=$!
  for ((k=0;k<600;k++)); do curl -sf -o /dev/null --max-time 2 http://127.0.0.1:$port/ready && break; kill -0 $pid || break; sleep 0.5; done
  echo "$name ready after $(( $(date +%s)-t0 )) s"
  $py -m trio_mlx.cli bench --url http://127.0.0.1:$port --model "$dir" --concurrency "${CONC:-256}" \
    --prompt-tokens 128 --max-tokens 128 --timeout 120 --requests-multiple 4 --warmup 8 --label "$name" \
    --out "$out/bench-$name.json" --quiet --server-pid $pid || echo "bench exit $?"
  kill -TERM $pid; for ((k=0;k<40;k++)); do kill -0 $pid 2>/dev/null || break; sleep 0.5; done
  kill -KILL $pid 2>/dev/null; wait $pid 2>/dev/null
  $py - "$out/bench-$name.json" "$name" <<'PY' | tee -a "$out/summary.txt"
import json, sys
for lv in json.load(open(sys.argv[1]))["levels"]:
    print(f"{sys.argv[2]} c={lv['concurrency']} tok/s {lv['output_throughput']:.0f} errors {lv['errors']['total']} "
          f"loop us/token {lv.get('server_main_thread_cpu_us_per_token', float('nan')):.1f} "
          f"server us/token {lv.get('server_cpu_us_per_token', float('nan')):.1f}")
PY
  $py -m trio_mlx.cli bench trace "$out/trace-$name.tsv" | sed "s/^/$name trace /" | tee -a "$out/summary.txt"
  gzip -f "$out/trace-$name.tsv"
done
