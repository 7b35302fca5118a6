# the process pinned to cores 0-7 or 8-15, three rounds (after c-alternate, same machine)
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
H=benchmarks/2026-11-29-h200/step-phases
(lscpu | grep -E "Model name|Socket|NUMA|^CPU\(s\)|MHz"; nvidia-smi topo -m 2>&1 | head -5)
for r in 1 2 3; do for cpus in 0-7 8-15; do
  timeout 50 taskset -c $cpus python3 $H/phase.py bench --engine --model /tmp/m1b --concurrency 4 --requests-per-level 16 --max-tokens 96 --max-tokens-spread 0.5 --prompt-tokens 128 --quiet --out $OUT/r$r-$cpus.json > /dev/null 2>&1
  echo "$r cpus $cpus $(python3 benchmarks/2026-11-29-h200/speculative/batched/summ.py $OUT/r$r-$cpus.json | awk '{printf "%s %s ttft %s tpot %s | ", $3, $5, $9, $12}')"
done; done 2>&1 | tee $OUT/aff.txt
