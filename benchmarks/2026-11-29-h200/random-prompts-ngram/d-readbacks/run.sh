# c=4 random prompts: off / ngram, with mx.clear_cache as is and as a no-op, alternating, traces
set -u
P() { echo "$@" | tee -a $OUT/progress.txt; }
[ -d /tmp/m1b ] || python3 -m trio_mlx.cli model build --shape llama-3.2-1b --dtype bfloat16 /tmp/m1b > /dev/null 2>&1
timeout 150 python3 benchmarks/2026-11-29-h200/random-prompts-ngram/d-readbacks/wrap.py bench --engine --model /tmp/m1b --concurrency 4 --requests-per-level 4 --max-tokens 16 --prompt-tokens 128 --quiet --out $OUT/warm.json > $OUT/warm.log 2>&1
P "warm rc=$? $(date +%T)"
for r in 1 2 3; do
 if [ $((r % 2)) = 1 ]; then order="off ngram offnc ngramnc"; else order="ngramnc offnc ngram off"; fi
 for cfg in $order; do
  E="TRIO_MLX_STEP_TRACE=$OUT/t$r-$cfg.tsv"
  case $cfg in ngram*) E="$E TRIO_MLX_SPECULATIVE=ngram";; esac
  case $cfg in *nc) E="$E NOCLEAR=1";; esac
  env $E timeout 60 python3 benchmarks/2026-11-29-h200/random-prompts-ngram/d-readbacks/wrap.py bench --engine --model /tmp/m1b --concurrency 4 --requests-per-level 32 --max-tokens 128 --prompt-tokens 128 --quiet --out $OUT/r$r-$cfg.json > $OUT/r$r-$cfg.log 2>&1
  P "$r $cfg rc=$? $(date +%T) $(python3 benchmarks/2026-11-29-h200/speculative/batched/summ.py $OUT/r$r-$cfg.json) $(grep COUNTS $OUT/r$r-$cfg.log)"
 done
done
cd $OUT && tar czf all.tgz *.json *.log *.tsv progress.txt 2>/dev/null; ls | head -2
