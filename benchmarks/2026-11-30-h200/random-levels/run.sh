# Prompt lookup on random prompts at 1, 4 and 16 users, speculation off against on, each run
# its own process in alternating order, every run with its step trace; on one H200 with the
# mlx wheel staged in /root/gpu-stage (part_aa, part_ab and .gpuC's files, as
# ../auto-rule/README.md says).
#   bash run.sh install      the wheels, and the random bf16 1B shape at /root/m1b (../auto-rule/run.sh's)
#   bash run.sh rounds R     R rounds of off and ngram (the order alternating by round):
#                            `trio-mlx bench --engine`, c=1,4,16, 128-token random prompts,
#                            128 tokens; JSON, trace and summary per run under $OUT
#                            (SPREAD=0.5: answer lengths drawn from 64-192, `--max-tokens-spread`;
#                            LEVELS: other levels; TAG: a prefix for the run's files)
#   bash run.sh answers      probe_guess_replay.py: greedy answers to the level of four users'
#                            prompts (answers.json), replayed through prompt lookup's rules
#   bash run.sh cold4        a fresh 4-bit 1B (random) with --kv-bits 8 and prompt lookup, its
#                            MLX kernel cache empty (MLX_PTX_CACHE_DIR): when each kernel compiled
#                            (cold-ptx.tsv) against the step trace (cold.tsv; cold-clock.txt: wall
#                            minus monotonic), c=1 and 4
# Results and progress.txt under $OUT; `python3 steps.py $OUT` reads the traces.
set -u
P() { echo "$@" | tee -a "$OUT/progress.txt"; }
case $1 in
install) bash benchmarks/2026-11-30-h200/auto-rule/run.sh install ;;
rounds)
  for r in $(seq 1 "$2"); do
    if [ $((r % 2)) = 1 ]; then order="off ngram"; else order="ngram off"; fi
    for m in $order; do
      f=$OUT/${TAG:-}r$r-$m
      P "== round $r $m $(date +%T)"
      ( if [ $m = ngram ]; then export TRIO_MLX_SPECULATIVE=ngram; fi
        TRIO_MLX_STEP_TRACE=$f.tsv timeout "${LIMIT:-150}" python3 -m trio_mlx.cli bench --engine --model /root/m1b \
          --concurrency ${LEVELS:-1,4,16} --requests-multiple 12 --min-requests 24 --max-tokens 128 --prompt-tokens 128 \
          ${SPREAD:+--max-tokens-spread $SPREAD} --quiet --out "$f.json" > "$f.log" 2>&1 )
      [ -f "$f.json" ] && python3 - "$f.json" <<'PY' | tee -a "$OUT/progress.txt"
import json, sys
for L in json.load(open(sys.argv[1]))["levels"]:
    print(f"  c={L['concurrency']} {L['output_throughput']:.0f} tok/s ttft p50 {L['ttft_ms']['p50']:.1f} "
          f"done {L['completed']}/{L['requests']}")
PY
    done
  done;;
cold4)
  [ -d /root/m1b4 ] || python3 -m trio_mlx.cli model build --shape llama-3.2-1b --dtype bfloat16 --bits 4 /root/m1b4 > /dev/null 2>&1
  rm -rf /tmp/ptx-cold4 && mkdir -p /tmp/ptx-cold4
  python3 -c "import time; print(time.time() - time.monotonic())" > "$OUT/cold-clock.txt"
  P "== cold4 $(date +%T)"
  MLX_PTX_CACHE_DIR=/tmp/ptx-cold4 TRIO_MLX_KV_BITS=8 TRIO_MLX_SPECULATIVE=ngram TRIO_MLX_STEP_TRACE="$OUT/cold.tsv" \
    timeout "${LIMIT:-400}" python3 -m trio_mlx.cli bench --engine --model /root/m1b4 --concurrency 1,4 \
    --requests-per-level 8 --max-tokens 128 --prompt-tokens 128 --quiet --out "$OUT/cold.json" > "$OUT/cold.log" 2>&1
  find /tmp/ptx-cold4 -type f -printf '%T@\t%s\t%f\n' | sort -n > "$OUT/cold-ptx.tsv"
  P "kernels compiled: $(wc -l < "$OUT/cold-ptx.tsv") $(date +%T)"
  tail -3 "$OUT/cold.log" | tee -a "$OUT/progress.txt";;
answers)
  P "== answers $(date +%T)"
  PYTHONPATH=$PWD timeout "${LIMIT:-150}" python3 benchmarks/probes/probe_guess_replay.py /root/m1b --out "$OUT/answers.json" \
    > "$OUT/answers.txt" 2>&1
  grep -v '^\[' "$OUT/answers.txt" | tee -a "$OUT/progress.txt";;
esac
P "== done $1 $(date +%T)"
