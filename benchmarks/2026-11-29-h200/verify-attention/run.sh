# A speculative step's attention as matmuls (`_shapes.few_queries`) against query by query
# (OLD: a trio_mlx tree from before the change), on one H200. Results and progress.txt under $OUT.
#   bash run.sh probe          # probe_verify_phases.py: the attention alone, and the actor's steps
#   OLD=DIR bash run.sh random R  # random 1B shape, 128-token random prompts, c=1,4,16; round R (1 or 2)
#   bash run.sh trace          # c=4, off / ngram / ngram / off, with step traces (TRIO_MLX_STEP_TRACE)
#   bash run.sh repeat         # the embedded SmolLM2 asked to repeat a passage (probe_speculative.py)
#   OLD=DIR bash run.sh repeat-old  # the same, prompt lookup alone, with the OLD tree (one round)
set -u
P() { echo "$@" | tee -a "$OUT/progress.txt"; }
NEW=$PWD
summ() { python3 - "$1" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
for L in j["levels"]:
    print(f"  c={L['concurrency']} {L['output_throughput']:.0f} tok/s ttft p50 {L['ttft_ms']['p50']:.1f} "
          f"tokens/event {L['tokens_per_event']:.3f} done {L['completed']}/{L['requests']}")
PY
}
[ -d /root/m1b ] || python3 -m trio_mlx.cli model build --shape llama-3.2-1b --dtype bfloat16 /root/m1b > /dev/null 2>&1
case $1 in
probe)
  P "== probe_verify_phases $(date +%T)"
  timeout 280 python3 benchmarks/probes/probe_verify_phases.py /root/m1b --rows 4 --tokens 160 2>&1 \
    | grep -v '^\[' | tee -a "$OUT/progress.txt" ;;
random)
  if [ $2 = 1 ]; then order="new:off new:ngram old:ngram"; else order="old:ngram new:ngram new:off"; fi
  for cfg in $order; do
    code=${cfg%%:*}; m=${cfg##*:}; f=$OUT/r$2-$code-$m.json
    P "== round $2 $code $m $(date +%T)"
    ( if [ $code = old ]; then export PYTHONPATH=$OLD; else export PYTHONPATH=$NEW; fi
      if [ $m = ngram ]; then export TRIO_MLX_SPECULATIVE=ngram; fi
      timeout 150 python3 -m trio_mlx.cli bench --engine --model /root/m1b --concurrency 1,4,16 \
        --requests-multiple 12 --min-requests 24 --max-tokens 128 --prompt-tokens 128 --quiet --out "$f" > /dev/null 2>&1 )
    [ -f "$f" ] && summ "$f" | tee -a "$OUT/progress.txt"
  done ;;
trace)
  for m in off ngram ngram off; do
    f=$OUT/t-$m-$(date +%s)
    P "== trace c=4 $m $(date +%T)"
    ( if [ $m = ngram ]; then export TRIO_MLX_SPECULATIVE=ngram; fi
      TRIO_MLX_STEP_TRACE=$f.tsv timeout 100 python3 -m trio_mlx.cli bench --engine --model /root/m1b --concurrency 4 \
        --requests-per-level 48 --max-tokens 128 --prompt-tokens 128 --quiet --out "$f.json" > /dev/null 2>&1 )
    [ -f "$f.json" ] && summ "$f.json" | tee -a "$OUT/progress.txt"
  done ;;
repeat)
  export PYTHONPATH=$NEW:/root/emb
  P "== repeat workload SmolLM2 $(date +%T)"
  timeout 280 python3 benchmarks/probes/probe_speculative.py --rounds 2 --configs off,ngram --max-tokens 300 \
    --out "$OUT/repeat.json" > "$OUT/repeat.txt" 2>&1
  grep -v '^\[' "$OUT/repeat.txt" | grep -v '^{' | tail -12 | tee -a "$OUT/progress.txt" ;;
repeat-old)
  export PYTHONPATH=$OLD:/root/emb
  P "== repeat workload SmolLM2, old tree $(date +%T)"
  timeout 200 python3 benchmarks/probes/probe_speculative.py --rounds 1 --configs ngram --max-tokens 300 \
    --out "$OUT/repeat-old.json" > "$OUT/repeat-old.txt" 2>&1
  grep -v '^\[' "$OUT/repeat-old.txt" | grep -v '^{' | tail -4 | tee -a "$OUT/progress.txt" ;;
esac
P "== done $1 $(date +%T)"
