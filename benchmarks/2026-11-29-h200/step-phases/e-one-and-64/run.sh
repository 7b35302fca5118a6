# one user and 64, 128 new tokens each, per-phase timers (a fresh machine: the model built first)
set -u
python3 -m trio_mlx.cli model build --shape llama-3.2-1b --dtype bfloat16 /tmp/m1b > /dev/null 2>&1
timeout 100 python3 benchmarks/2026-11-29-h200/step-phases/phase.py bench --engine --model /tmp/m1b --concurrency 4 --requests-per-level 4 --max-tokens 16 --prompt-tokens 128 --quiet --out $OUT/warm.json > /dev/null 2>&1
for c in 1 64; do
  n=$([ $c = 1 ] && echo 12 || echo 64)
  PHASE_OUT=$OUT/p-c$c.tsv timeout 70 python3 benchmarks/2026-11-29-h200/step-phases/phase.py bench --engine --model /tmp/m1b --concurrency $c --requests-per-level $n --max-tokens 128 --prompt-tokens 128 --quiet --out $OUT/r-c$c.json > /dev/null 2>&1
  echo "c=$c rc=$? $(python3 benchmarks/2026-11-29-h200/speculative/batched/summ.py $OUT/r-c$c.json | awk '{printf "%s tok/s ttft %s tpot %s", $5, $9, $12}') | $(python3 benchmarks/2026-11-29-h200/step-phases/phases.py --brief $OUT/p-c$c.tsv | cut -d'|' -f2)"
done | tee $OUT/c1-c64.txt
