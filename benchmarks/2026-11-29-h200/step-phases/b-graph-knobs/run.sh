# MLX's CUDA graph knobs against the host's async_eval time: c=1 and c=4 (lengths 64-192), per-phase timers
. benchmarks/2026-11-29-h200/step-phases/warm.sh
run() {
  local r=$1 cfg=$2
  local E="PHASE_OUT=$OUT/p$r-$cfg.tsv"
  case $cfg in
    ops100) E="$E MLX_MAX_OPS_PER_BUFFER=100";;
    ops200) E="$E MLX_MAX_OPS_PER_BUFFER=200";;
    gc1000) E="$E MLX_CUDA_GRAPH_CACHE_SIZE=1000";;
    both) E="$E MLX_MAX_OPS_PER_BUFFER=200 MLX_CUDA_GRAPH_CACHE_SIZE=1000";;
    nographs) E="$E MLX_USE_CUDA_GRAPHS=0";;
    thrash) E="$E MLX_ENABLE_CACHE_THRASHING_CHECK=1";;
  esac
  env $E timeout 75 python3 benchmarks/2026-11-29-h200/step-phases/phase.py bench --engine --model /tmp/m1b --concurrency 1,4 --requests-per-level 24 --max-tokens 96 --max-tokens-spread 0.5 --prompt-tokens 128 --quiet --out $OUT/r$r-$cfg.json > $OUT/r$r-$cfg.log 2>&1
  P "$r $cfg rc=$? $(date +%T) $(python3 benchmarks/2026-11-29-h200/speculative/batched/summ.py $OUT/r$r-$cfg.json | awk '{printf "%s %s tok/s ttft %s tpot %s | ", $3, $5, $9, $12}') $(python3 benchmarks/2026-11-29-h200/step-phases/phases.py --brief $OUT/p$r-$cfg.tsv | cut -d'|' -f2-)"
}
for r in 1 2; do
 case $r in 1) order="base ops200 gc1000 both nographs ops100";; 2) order="ops100 nographs both gc1000 ops200 base";; esac
 for cfg in $order; do run $r $cfg; done
done
run 3 thrash
grep -i -m5 "thrash\|graph" $OUT/r3-thrash.log
cd $OUT && tar czf all.tgz *.json *.log *.tsv progress.txt 2>/dev/null; ls | head -2
