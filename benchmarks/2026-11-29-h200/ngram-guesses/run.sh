# Prompt lookup drafting only after its guesses hit, against the code before (OLD: a tree of
# trio_mlx from before the change) and speculation off, on one H200.
#   OLD=DIR bash run.sh random   # random 1B shape, 128-token random prompts, c=1,4,16, two rounds
#   bash run.sh repeat           # the embedded SmolLM2 asked to repeat a file (probe_speculative.py)
#   bash run.sh trace            # c=4 alone, off and ngram, with step traces (TRIO_MLX_STEP_TRACE)
#   bash run.sh plain            # probe_plain_with_drafter.py: a plain step with a drafter, cold and warmed
# Results and progress.txt under $OUT.
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
case $1 in
random)
  [ -d /root/m1b ] || python3 -m trio_mlx.cli model build --shape llama-3.2-1b --dtype bfloat16 /root/m1b > /dev/null 2>&1
  for r in 1 2; do
    if [ $r = 1 ]; then order="new:off new:ngram old:ngram"; else order="old:ngram new:ngram new:off"; fi
    for cfg in $order; do
      code=${cfg%%:*}; m=${cfg##*:}; f=$OUT/r$r-$code-$m.json
      P "== round $r $code $m $(date +%T)"
      ( if [ $code = old ]; then export PYTHONPATH=$OLD; else export PYTHONPATH=$NEW; fi
        if [ $m = ngram ]; then export TRIO_MLX_SPECULATIVE=ngram; fi
        timeout 150 python3 -m trio_mlx.cli bench --engine --model /root/m1b --concurrency 1,4,16 \
          --requests-multiple 12 --min-requests 24 --max-tokens 128 --prompt-tokens 128 --quiet --out "$f" > /dev/null 2>&1 )
      [ -f "$f" ] && summ "$f" | tee -a "$OUT/progress.txt"
    done
  done ;;
plain)
  [ -d /root/m1b ] || python3 -m trio_mlx.cli model build --shape llama-3.2-1b --dtype bfloat16 /root/m1b > /dev/null 2>&1
  for w in "" --warm; do
    P "== plain steps with a drafter $w $(date +%T)"
    timeout 200 python3 benchmarks/probes/probe_plain_with_drafter.py /root/m1b --rounds 2 $w 2>&1 | tail -8 | tee -a "$OUT/progress.txt"
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
  timeout 250 python3 benchmarks/probes/probe_speculative.py --rounds 2 --configs off,ngram --max-tokens 300 \
    --out "$OUT/repeat.json" > "$OUT/repeat.txt" 2>&1
  grep -v '^\[' "$OUT/repeat.txt" | grep -v '^{' | tail -8 | tee -a "$OUT/progress.txt" ;;
esac
P "== done $(date +%T)"
