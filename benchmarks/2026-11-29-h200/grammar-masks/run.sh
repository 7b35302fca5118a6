# --grammar-masks after / before / auto on one H200: 64 rows, every one held to a grammar,
# against free rows given the same token counts (probe_grammar_engine.py, SHARES=1), one
# round per engine, the modes alternating (after before auto auto before after).
#   bash run.sh array|string   # results and progress.txt under $OUT
set -u
P() { echo "$@" | tee -a "$OUT/progress.txt"; }
[ -d /root/m1b ] || python3 -m trio_mlx.cli model build --shape llama-3.2-1b --dtype bfloat16 /root/m1b > /dev/null 2>&1
for m in ${MODES:-after before auto auto before after}; do
  P "== $1 $m $(date +%T)"
  SHARES=1 GRAMMAR_MASKS=$m timeout 150 python3 benchmarks/probes/probe_grammar_engine.py /root/m1b 64 256 1 "$1" \
    > "$OUT/$1-$m-$(date +%s).txt" 2>&1
  tail -2 "$(ls -t "$OUT"/$1-$m-*.txt | head -1)" | tee -a "$OUT/progress.txt"
done
P "== done $(date +%T)"
