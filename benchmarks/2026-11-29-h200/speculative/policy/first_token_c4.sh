# after the first-token changes: random prompts, engine, c=4, ngram / off / off / ngram
set -u
P() { echo "$@" | tee -a $OUT/progress.txt; }
[ -d /tmp/m1b ] || python3 -m trio_mlx.cli model build --shape llama-3.2-1b --dtype bfloat16 /tmp/m1b > /dev/null 2>&1
n=0
for cfg in ngram off off ngram; do
  n=$((n+1)); to=45; [ $n = 1 ] && to=100
  case $cfg in off) E="";; ngram) E="TRIO_MLX_SPECULATIVE=ngram";; esac
  env $E timeout $to python3 -m trio_mlx.cli bench --engine --model /tmp/m1b --concurrency 4 --requests-per-level 16 --max-tokens 128 --prompt-tokens 128 --quiet --out $OUT/f$n-$cfg.json > $OUT/f$n-$cfg.log 2>&1
  P "$n $cfg rc=$? $(date +%T) $(python3 .gpuwork/summ.py $OUT/f$n-$cfg.json)"
done
