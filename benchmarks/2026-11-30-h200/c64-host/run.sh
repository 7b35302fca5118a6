# Where a 64-user server's decode step goes beyond the step alone, on one H200 (the stage in
# /root/gpu-stage as ../auto-rule/README.md says; `bash ../link-join/run.sh install`):
#   bash run.sh alone    the bare forward (plain cache, the actor's batch cache) and the actor's
#                        decode step alone (probe_decode_step.py), at 64 rows, two rounds each
#   bash run.sh spy      `trio-mlx serve` (thread actor, a step trace) under the bench at c=64
#                        (128-token prompts, 128 tokens, 640 requests); py-spy on the server:
#                        8 s at 250 Hz (--nonblocking, --idle), then 6 s --native at 50 Hz
#                        (blocking), raw files under $OUT/spy
#   bash run.sh paired   one server with a step trace under the bench at c=64 (256 requests, 128-token
#                        prompts and answers): alone, then paired with the BatchGenerator (2 rounds, the
#                        ceiling in the bench's process), then alone again; each run's start and end
#                        in progress.txt (the monotonic clock, as the trace) to place its steps in the trace
# Results and progress.txt under $OUT.
set -u
P() { echo "$@" | tee -a "$OUT/progress.txt"; }
export PYTHONPATH=$PWD
M=${M1B:-/root/m1b}
case $1 in
alone)
  for r in 1 2; do
    timeout 100 python3 benchmarks/probes/probe_bare_forward.py "$M" --rows 64 --steps 300 --rounds 2 \
      --cache plain,batch-after > "$OUT/bare-$r.txt" 2>&1
    grep -E "rows|ms" "$OUT/bare-$r.txt" | tail -6 | tee -a "$OUT/progress.txt"
    timeout 150 python3 benchmarks/probes/probe_decode_step.py "$M" --rows 64 --steps 300 --rounds 2 \
      > "$OUT/step-$r.txt" 2>&1
    tail -4 "$OUT/step-$r.txt" | tee -a "$OUT/progress.txt"
  done;;
spy)
  O=$OUT/spy; mkdir -p "$O"
  TRIO_MLX_STEP_TRACE="$O/trace.tsv" python3 -m trio_mlx.cli serve --model "$M" --port 8091 --max-batch 256 \
    > "$O/serve.log" 2>&1 & SP=$!
  for t in $(seq 240); do curl -sf localhost:8091/v1/models > /dev/null && break; sleep 1; done
  P "== up $(date +%T)"
  timeout 150 python3 -m trio_mlx.cli bench --url http://127.0.0.1:8091 --model "$M" --concurrency 64 \
    --requests-per-level 640 --max-tokens 128 --prompt-tokens 128 --quiet --out "$O/c64.json" > "$O/c64.log" 2>&1 & BP=$!
  sleep 8
  py-spy record -p $SP -d 8 -r 250 --threads --idle --nonblocking -f raw -o "$O/py.txt" > /dev/null 2>> "$O/spy-err.txt"
  py-spy record -p $SP -d 6 -r 50 --threads --idle --native -f raw -o "$O/nat.txt" > /dev/null 2>> "$O/spy-err.txt"
  wait $BP; kill $SP; wait $SP 2>/dev/null
  tail -3 "$O/c64.log" | tee -a "$OUT/progress.txt"
  python3 benchmarks/2026-11-30-h200/c1-host/spy_lines.py "$O/py.txt" "" tm 30 | tee -a "$OUT/progress.txt";;
paired)
  O=$OUT/paired; mkdir -p "$O"
  TRIO_MLX_STEP_TRACE="$O/trace.tsv" python3 -m trio_mlx.cli serve --model "$M" --port 8091 --max-batch 256 \
    > "$O/serve.log" 2>&1 & SP=$!
  for t in $(seq 240); do curl -sf localhost:8091/v1/models > /dev/null && break; sleep 1; done
  B() { P "$2 from $(python3 -c "import time; print(time.monotonic())")"
        timeout "$1" python3 -m trio_mlx.cli bench --url http://127.0.0.1:8091 --model "$M" --concurrency 64 \
          --requests-per-level 256 --max-tokens 128 --prompt-tokens 128 --quiet --out "$O/$2.json" "${@:3}" \
          > "$O/$2.log" 2>&1
        P "$2 to $(python3 -c "import time; print(time.monotonic())")"; }
  B 60 plain1
  B 150 paired --paired "$O/paired-ceil.json" --paired-rounds 2
  B 60 plain2
  kill $SP; wait $SP 2>/dev/null;;
esac
P "== done $1 $(date +%T)"
