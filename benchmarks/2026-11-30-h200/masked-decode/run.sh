#!/usr/bin/env bash
# The one-query masked attention kernel (trio_mlx/actor/_cuda_attention.py) on one H200:
#   run.sh probes  probe_masked_decode.py: the kernel against MLX's attention (check), ms per
#                  call (calls), the actor's decode step over left-padded rows, kernel on and off
#                  in alternating rounds (steps)
#   run.sh bench R the engine end to end, this tree (NEW) against the tree before the kernel (OLD),
#                  round R (1: new first, 2: old first): random 128-token prompts, 128 tokens,
#                  c=4,16,64, no speculation
#   run.sh lookup  the same at c=4 with prompt lookup, two rounds
#   run.sh long    the same with 3,072-token prompts at c=16,64, two rounds
#   run.sh spread R  c=64 with max_tokens drawn from 64-192 (rows that end apart), round R as bench
# bench and lookup run only after a check that passed on this machine (/root/check-passed).
# Needs OUT, NEW and OLD (trees' roots); builds the random bf16 1B shape at /root/m1b.
set -u
source benchmarks/probes/spec_ab.sh
itl() { python3 - "$1" <<'PY'
import json, sys
for L in json.load(open(sys.argv[1]))["levels"]:
    print(f"  c={L['concurrency']} itl p50 {L['itl_ms']['p50']:.2f} ms tpot p50 {L['tpot_ms']['p50']:.2f} ms")
PY
}
case "$1" in
probes)
  model_1b
  P "== check $(date +%T)"
  python3 benchmarks/probes/probe_masked_decode.py --parts check --out "$OUT/check.json" > "$OUT/check.txt" 2>&1
  tail -1 "$OUT/check.txt" | tee -a "$OUT/progress.txt"; grep FAIL "$OUT/check.txt" | head -5 | tee -a "$OUT/progress.txt"
  grep -q "^check: .* ok" "$OUT/check.txt" && ! grep -q FAIL "$OUT/check.txt" && touch /root/check-passed
  [ -f /root/check-passed ] || { tail -30 "$OUT/check.txt"; exit 1; }
  P "== calls $(date +%T)"
  python3 benchmarks/probes/probe_masked_decode.py --parts calls --out "$OUT/calls.json" > "$OUT/calls.txt" 2>&1
  tee -a "$OUT/progress.txt" < "$OUT/calls.txt"
  P "== steps $(date +%T)"
  timeout 300 python3 benchmarks/probes/probe_masked_decode.py /root/m1b --parts steps --rows 4,16,64 --rounds 3 \
    --out "$OUT/steps.json" > "$OUT/steps.txt" 2>&1
  grep -v round "$OUT/steps.txt" | tail -6 | tee -a "$OUT/progress.txt"
  ;;
bench|lookup|long|spread)
  [ -f /root/check-passed ] || { P "no check passed here"; exit 1; }
  model_1b
  if [ "$1" = bench ]; then rounds=$2; elif [ "$1" = spread ]; then rounds=${2:-1}; else rounds="1 2"; fi
  for r in $rounds; do
    if [ $r = 1 ]; then order="new old"; else order="old new"; fi
    for code in $order; do
      f=$OUT/$1-r$r-$code.json
      P "== $1 round $r $code $(date +%T)"
      ( if [ $code = old ]; then export PYTHONPATH=$OLD; else export PYTHONPATH=$NEW; fi
        if [ "$1" = spread ]; then
          timeout 150 python3 -m trio_mlx.cli bench --engine --model /root/m1b --concurrency 64 --requests-multiple 4 \
            --max-tokens 128 --max-tokens-spread 0.5 --prompt-tokens 128 --quiet --out "$f" > /dev/null 2>&1
        elif [ "$1" = long ]; then
          timeout 95 python3 -m trio_mlx.cli bench --engine --model /root/m1b --concurrency 16,64 \
            --requests-multiple 2 --min-requests 32 --max-tokens 128 --prompt-tokens 3072 --quiet --out "$f" > /dev/null 2>&1
        elif [ "$1" = bench ]; then
          timeout 200 python3 -m trio_mlx.cli bench --engine --model /root/m1b --concurrency 4,16,64 \
            --requests-multiple 4 --min-requests 32 --max-tokens 128 --prompt-tokens 128 --quiet --out "$f" > /dev/null 2>&1
        else
          TRIO_MLX_SPECULATIVE=ngram timeout 150 python3 -m trio_mlx.cli bench --engine --model /root/m1b \
            --concurrency 4 --requests-multiple 12 --min-requests 24 --max-tokens 128 --prompt-tokens 128 --quiet \
            --out "$f" > /dev/null 2>&1
        fi )
      [ -f "$f" ] && summ "$f" | tee -a "$OUT/progress.txt" && itl "$f" | tee -a "$OUT/progress.txt"
    done
  done
  ;;
esac
