# c=4 random prompts, lengths 64-192: per-phase timers in the actor's step (phase.py), prompt cache on / off
. benchmarks/2026-11-29-h200/step-phases/warm.sh
run() {
  local r=$1 cfg=$2
  local E="TRIO_MLX_STEP_TRACE=$OUT/t$r-$cfg.tsv PHASE_OUT=$OUT/p$r-$cfg.tsv"
  case $cfg in nocache) E="$E TRIO_MLX_PROMPT_CACHE_GB=0";; mlxstep) E="$E TRIO_MLX_DECODE_STEP=mlx";; esac
  env $E timeout 90 python3 benchmarks/2026-11-29-h200/step-phases/phase.py bench --engine --model /tmp/m1b --concurrency 4 --requests-per-level 32 --max-tokens 128 --max-tokens-spread 0.5 --prompt-tokens 128 --quiet --out $OUT/r$r-$cfg.json > $OUT/r$r-$cfg.log 2>&1
  P "$r $cfg rc=$? $(date +%T) $(python3 benchmarks/2026-11-29-h200/speculative/batched/summ.py $OUT/r$r-$cfg.json)"
}
for r in 1 2; do
 case $r in 1) order="cache nocache mlxstep";; 2) order="mlxstep nocache cache";; esac
 for cfg in $order; do run $r $cfg; done
done
python3 benchmarks/2026-11-29-h200/step-phases/phases.py $OUT/p*.tsv | tee -a $OUT/progress.txt
python3 benchmarks/2026-11-29-h200/random-prompts-ngram/inserts.py $OUT/t*.tsv | tee -a $OUT/progress.txt
cd $OUT && tar czf all.tgz *.json *.log *.tsv progress.txt 2>/dev/null; ls | head -2
