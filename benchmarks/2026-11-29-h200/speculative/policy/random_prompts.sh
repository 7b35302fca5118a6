set -u
P() { echo "$@" | tee -a $OUT/progress.txt; }
P "== build $(date +%T) $(git -C .. log --oneline -1 2>/dev/null)"
[ -d /tmp/m1b ] || python3 -m trio_mlx.cli model build --shape llama-3.2-1b --dtype bfloat16 /tmp/m1b > /dev/null 2>&1
S() { python3 .gpuwork/summ.py "$@"; }
for r in 1 2; do for c in 4 16 1; do
  if [ $r = 1 ]; then order="off ngram"; else order="ngram off"; fi
  for cfg in $order; do
  n=$((c*4)); [ $n -lt ${NMIN:-8} ] && n=${NMIN:-8}
  P "== round $r random prompts c=$c $cfg $(date +%T)"
  case $cfg in off) E="";; ngram) E="TRIO_MLX_SPECULATIVE=ngram";; esac
  env $E timeout ${TO:-45} python3 -m trio_mlx.cli bench --engine --model /tmp/m1b --concurrency $c --requests-per-level $n --max-tokens 128 --prompt-tokens 128 --quiet --out $OUT/r$r-c$c-$cfg.json > $OUT/r$r-c$c-$cfg.log 2>&1; echo "rc=$?" >> $OUT/r$r-c$c-$cfg.log; S $OUT/r$r-c$c-$cfg.json | tee -a $OUT/progress.txt; grep -E "Error|rc=" $OUT/r$r-c$c-$cfg.log | tail -2 | tee -a $OUT/progress.txt
done; done; done
P "== done $(date +%T)"
