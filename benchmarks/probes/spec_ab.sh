# Shell functions shared by the speculative-decoding records' run.sh scripts (sourced, not
# run): the random-prompt rounds of the engine with prompt lookup on and off, new tree
# against OLD, and the four-user step traces. Need OUT, NEW (this tree) and, for an "old"
# configuration, OLD (another tree's root); the random bf16 1B shape at /root/m1b.
P() { echo "$@" | tee -a "$OUT/progress.txt"; }
summ() { python3 - "$1" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
for L in j["levels"]:
    print(f"  c={L['concurrency']} {L['output_throughput']:.0f} tok/s ttft p50 {L['ttft_ms']['p50']:.1f} "
          f"tokens/event {L['tokens_per_event']:.3f} done {L['completed']}/{L['requests']}")
PY
}
model_1b() {
  [ -d /root/m1b ] || python3 -m trio_mlx.cli model build --shape llama-3.2-1b --dtype bfloat16 /root/m1b > /dev/null 2>&1
}
# random_round R: c=1,4,16 on 128-token random prompts, 128 tokens; round 1 in one order, 2 reversed
random_round() {
  local order
  if [ "$1" = 1 ]; then order="new:off new:ngram old:ngram"; else order="old:ngram new:ngram new:off"; fi
  for cfg in $order; do
    code=${cfg%%:*}; m=${cfg##*:}; f=$OUT/r$1-$code-$m.json
    P "== round $1 $code $m $(date +%T)"
    ( if [ $code = old ]; then export PYTHONPATH=$OLD; else export PYTHONPATH=$NEW; fi
      if [ $m = ngram ]; then export TRIO_MLX_SPECULATIVE=ngram; fi
      timeout 150 python3 -m trio_mlx.cli bench --engine --model /root/m1b --concurrency 1,4,16 \
        --requests-multiple 12 --min-requests 24 --max-tokens 128 --prompt-tokens 128 --quiet --out "$f" > /dev/null 2>&1 )
    [ -f "$f" ] && summ "$f" | tee -a "$OUT/progress.txt"
  done
}
# traces: c=4 alone, off / ngram / ngram / off, with step traces (TRIO_MLX_STEP_TRACE)
traces() {
  for m in off ngram ngram off; do
    f=$OUT/t-$m-$(date +%s)
    P "== trace c=4 $m $(date +%T)"
    ( if [ $m = ngram ]; then export TRIO_MLX_SPECULATIVE=ngram; fi
      TRIO_MLX_STEP_TRACE=$f.tsv timeout 100 python3 -m trio_mlx.cli bench --engine --model /root/m1b --concurrency 4 \
        --requests-per-level 48 --max-tokens 128 --prompt-tokens 128 --quiet --out "$f.json" > /dev/null 2>&1 )
    [ -f "$f.json" ] && summ "$f.json" | tee -a "$OUT/progress.txt"
  done
}
# repeat NAME PYTHONPATH ROUNDS CONFIGS: the embedded SmolLM2 asked to repeat a passage
# (probe_speculative.py, 300 tokens), its JSON and log as NAME.json / NAME.txt
repeat() {
  P "== repeat workload SmolLM2, $1 $(date +%T)"
  ( export PYTHONPATH=$2:/root/emb
    timeout 280 python3 benchmarks/probes/probe_speculative.py --rounds "$3" --configs "$4" --max-tokens 300 \
      --out "$OUT/$1.json" > "$OUT/$1.txt" 2>&1 )
  grep -v '^\[' "$OUT/$1.txt" | grep -v '^{' | tail -12 | tee -a "$OUT/progress.txt"
}
