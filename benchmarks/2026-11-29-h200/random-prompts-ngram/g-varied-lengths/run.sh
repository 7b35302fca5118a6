# c=4 random prompts: off with every request 128 tokens / off with 64-192 (rows end apart) / ngram with 64-192; traces
set -u
P() { echo "$@" | tee -a $OUT/progress.txt; }
[ -d /tmp/m1b ] || python3 -m trio_mlx.cli model build --shape llama-3.2-1b --dtype bfloat16 /tmp/m1b > /dev/null 2>&1
timeout 150 python3 benchmarks/2026-11-29-h200/random-prompts-ngram/g-varied-lengths/vary.py bench --engine --model /tmp/m1b --concurrency 4 --requests-per-level 4 --max-tokens 16 --prompt-tokens 128 --quiet --out $OUT/warm.json > $OUT/warm.log 2>&1
P "warm rc=$? $(date +%T)"
run() {
  local r=$1 cfg=$2; local E="TRIO_MLX_STEP_TRACE=$OUT/t$r-$cfg.tsv"
  case $cfg in offvary) E="$E VARY=1";; ngramvary) E="$E VARY=1 TRIO_MLX_SPECULATIVE=ngram";; esac
  env $E timeout 60 python3 benchmarks/2026-11-29-h200/random-prompts-ngram/g-varied-lengths/vary.py bench --engine --model /tmp/m1b --concurrency 4 --requests-per-level 32 --max-tokens 128 --prompt-tokens 128 --quiet --out $OUT/r$r-$cfg.json > $OUT/r$r-$cfg.log 2>&1
  P "$r $cfg rc=$? $(date +%T) $(python3 benchmarks/2026-11-29-h200/speculative/batched/summ.py $OUT/r$r-$cfg.json)"
}
for r in 1 2; do
 case $r in 1) order="off offvary ngramvary";; 2) order="ngramvary offvary off";; esac
 for cfg in $order; do run $r $cfg; done
done
python3 benchmarks/2026-11-29-h200/random-prompts-ngram/steps.py $OUT/t*.tsv | tee -a $OUT/progress.txt
cd $OUT && tar czf all.tgz *.json *.log *.tsv progress.txt 2>/dev/null; ls | head -2
