# c=4 random prompts: off / ngram at HEAD (read back where 2 tokens repeat) / ngram with 3 beside other rows; c=16 once
set -u
P() { echo "$@" | tee -a $OUT/progress.txt; }
[ -d /tmp/m1b ] || python3 -m trio_mlx.cli model build --shape llama-3.2-1b --dtype bfloat16 /tmp/m1b > /dev/null 2>&1
timeout 150 python3 benchmarks/2026-11-29-h200/random-prompts-ngram/d-readbacks/wrap.py bench --engine --model /tmp/m1b --concurrency 4 --requests-per-level 4 --max-tokens 16 --prompt-tokens 128 --quiet --out $OUT/warm.json > $OUT/warm.log 2>&1
P "warm rc=$? $(date +%T)"
run() { # round cfg concurrency
  local r=$1 cfg=$2 c=$3; local E="TRIO_MLX_STEP_TRACE=$OUT/t$r-$cfg-c$c.tsv"
  case $cfg in head) E="$E TRIO_MLX_SPECULATIVE=ngram PYTHONPATH=$HEAD_TREE:$PWD";; new) E="$E TRIO_MLX_SPECULATIVE=ngram";; esac
  env $E timeout 70 python3 benchmarks/2026-11-29-h200/random-prompts-ngram/d-readbacks/wrap.py bench --engine --model /tmp/m1b --concurrency $c --requests-per-level $((c*8)) --max-tokens 128 --prompt-tokens 128 --quiet --out $OUT/r$r-$cfg-c$c.json > $OUT/r$r-$cfg-c$c.log 2>&1
  P "$r $cfg rc=$? $(date +%T) $(python3 benchmarks/2026-11-29-h200/speculative/batched/summ.py $OUT/r$r-$cfg-c$c.json) $(grep COUNTS $OUT/r$r-$cfg-c$c.log)"
}
for r in 1 2 3; do
 case $r in 1) order="off head new";; 2) order="new off head";; 3) order="head new off";; esac
 for cfg in $order; do run $r $cfg 4; done
done
for cfg in new off; do run 4 $cfg 16; done
cd $OUT && tar czf all.tgz *.json *.log *.tsv progress.txt 2>/dev/null; ls | head -2
