# random prompts, engine, 1B bf16: off / ngram / ngram / off at c=1, 4, 16 (after the two-token
# least match), with step traces of the ngram runs
# (run from the repository root with PYTHONPATH=$PWD on the device; $OUT: where the results go)
set -u
P() { echo "$@" | tee -a $OUT/progress.txt; }
[ -d /tmp/m1b ] || python3 -m trio_mlx.cli model build --shape llama-3.2-1b --dtype bfloat16 /tmp/m1b > /dev/null 2>&1
timeout 150 python3 -m trio_mlx.cli bench --engine --model /tmp/m1b --concurrency 4 --requests-per-level 4 --max-tokens 16 --prompt-tokens 128 --quiet --out $OUT/warm.json > $OUT/warm.log 2>&1
P "warm rc=$? $(date +%T)"
n=0
for c in 4 1 16; do
 for cfg in off ngram ngram off; do
  n=$((n+1))
  case $cfg in off) E="X=1";; ngram) E="TRIO_MLX_SPECULATIVE=ngram TRIO_MLX_STEP_TRACE=$OUT/t$n-c$c.tsv";; esac
  env $E timeout 60 python3 -m trio_mlx.cli bench --engine --model /tmp/m1b --concurrency $c --requests-per-level $((c*8>16?c*8:16)) --max-tokens 128 --prompt-tokens 128 --quiet --out $OUT/f$n-c$c-$cfg.json > $OUT/f$n-c$c-$cfg.log 2>&1
  P "$n c=$c $cfg rc=$? $(date +%T) $(python3 benchmarks/2026-11-29-h200/speculative/batched/summ.py $OUT/f$n-c$c-$cfg.json)"
 done
done
cd $OUT && tar czf all.tgz *.json *.log *.tsv 2>/dev/null; ls
