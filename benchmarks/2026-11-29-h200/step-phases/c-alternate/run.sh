# MLX's default CUDA graph settings against 200 kernels a graph and a cache of 1,000, three rounds (after b-graph-knobs, same machine)
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
H=benchmarks/2026-11-29-h200/step-phases
for r in 1 2 3; do for cfg in base both; do
  E=""; [ $cfg = both ] && E="MLX_MAX_OPS_PER_BUFFER=200 MLX_CUDA_GRAPH_CACHE_SIZE=1000"
  env $E PHASE_OUT=$OUT/p$r-$cfg.tsv timeout 60 python3 $H/phase.py bench --engine --model /tmp/m1b --concurrency 1,4 --requests-per-level 16 --max-tokens 96 --max-tokens-spread 0.5 --prompt-tokens 128 --quiet --out $OUT/r$r-$cfg.json > /dev/null 2>&1
  echo "$r $cfg $(python3 benchmarks/2026-11-29-h200/speculative/batched/summ.py $OUT/r$r-$cfg.json | awk '{printf "%s %s ttft %s tpot %s | ", $3, $5, $9, $12}') $(python3 $H/phases.py --brief $OUT/p$r-$cfg.tsv | cut -d'|' -f2-)"
done; done 2>&1 | tee $OUT/ab.txt
