# random prompts at c=4, longer runs, three rounds alternating (after the grammar probe)
set -u
P() { echo "$@" | tee -a $OUT/progress.txt; }
[ -d /tmp/m1b ] || python3 -m trio_mlx.cli model build --shape llama-3.2-1b --dtype bfloat16 /tmp/m1b > /dev/null 2>&1
for r in 1 2 3; do
  if [ $((r % 2)) = 1 ]; then order="off ngram"; else order="ngram off"; fi
  for cfg in $order; do
  case $cfg in off) E="";; ngram) E="TRIO_MLX_SPECULATIVE=ngram";; esac
  env $E timeout ${TR:-50} python3 -m trio_mlx.cli bench --engine --model /tmp/m1b --concurrency 4 --requests-per-level 48 --max-tokens 128 --prompt-tokens 128 --quiet --out $OUT/rr$r-$cfg.json > $OUT/rr$r-$cfg.log 2>&1; echo "rc=$?" >> $OUT/rr$r-$cfg.log
  P "round $r $(python3 .gpuwork/summ.py $OUT/rr$r-$cfg.json)"
done; done
