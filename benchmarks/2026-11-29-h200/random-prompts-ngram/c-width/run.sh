# after the width judge's change: c=4 only, off / ngram alternating, three rounds, traces
# (run from the repository root with PYTHONPATH=$PWD on the device; $OUT: where the results go)
set -u
P() { echo "$@" | tee -a $OUT/progress.txt; }
[ -d /tmp/m1b ] || python3 -m trio_mlx.cli model build --shape llama-3.2-1b --dtype bfloat16 /tmp/m1b > /dev/null 2>&1
timeout 150 python3 -m trio_mlx.cli bench --engine --model /tmp/m1b --concurrency 4 --requests-per-level 4 --max-tokens 16 --prompt-tokens 128 --quiet --out $OUT/warm.json > $OUT/warm.log 2>&1
P "warm rc=$? $(date +%T)"
for r in 1 2 3; do
 if [ $((r % 2)) = 1 ]; then order="off ngram"; else order="ngram off"; fi
 for cfg in $order; do
  case $cfg in off) E="TRIO_MLX_STEP_TRACE=$OUT/t$r-off.tsv";; ngram) E="TRIO_MLX_SPECULATIVE=ngram TRIO_MLX_STEP_TRACE=$OUT/t$r-ngram.tsv";; esac
  env $E timeout 60 python3 -m trio_mlx.cli bench --engine --model /tmp/m1b --concurrency 4 --requests-per-level 32 --max-tokens 128 --prompt-tokens 128 --quiet --out $OUT/r$r-$cfg.json > $OUT/r$r-$cfg.log 2>&1
  P "$r $cfg rc=$? $(date +%T) $(python3 benchmarks/2026-11-29-h200/speculative/batched/summ.py $OUT/r$r-$cfg.json)"
 done
done
cd $OUT && tar czf all.tgz *.json *.log *.tsv progress.txt 2>/dev/null; ls | head -2
