# The budget checks of 64 constrained rows spaced by what each token may add to the completion,
# against every token counted as the most one may add (the tree at 68d1711, exported into
# .gpubase/trio_mlx and carried), on one H200 (the stage in /root/gpu-stage as
# ../../2026-11-30-h200/auto-rule/README.md says, SmolLM2's tokenizer files in /root/gpu-stage/smoltok):
#   bash run.sh install         ../../2026-11-30-h200/graph-cache/run.sh's install (/root/m1b, /root/m1bs)
#   bash run.sh engines [ORDER] probe_grammar_engine.py /root/m1bs 64 512 1 array under `auto`, its
#                               decode step's parts timed (PHASES), once per word of ORDER (default
#                               "base new new base"; base: the old tree, new: this one, off: this one
#                               with BUDGET=off, no row measuring itself), read by phases.py and thin.py
#   bash run.sh count           count.py on this tree: the budget's bookkeeping of the array's 64 rows
# Results and progress.txt under $OUT.
set -u
P() { echo "$@" | tee -a "$OUT/progress.txt"; }
stamp() { while IFS= read -r l; do echo "$(date +%T.%N | cut -c1-12) $l"; done; }
HERE=$PWD
STEPS=$HERE/benchmarks/2026-11-30-h200/grammar-steps
case $1 in
install) bash benchmarks/2026-11-30-h200/graph-cache/run.sh install;;
engines)
  n=${START:-0}
  for w in ${2:-base new new base}; do
    n=$((n+1)); f="$OUT/phases-$n-$w"
    tree=$HERE; [ "$w" = base ] && tree=$HERE/.gpubase
    P "== engine $n $w $(date +%T)"
    ( cd "$tree" && PYTHONPATH=$PWD GRAMMAR_MASKS=auto SHARES=1 PHASES="$f.tsv" TRIO_MLX_STEP_TRACE="$f-trace.tsv" \
      BUDGET=$([ "$w" = off ] && echo off || echo on) \
      timeout "${LIMIT:-200}" python3 "$HERE/benchmarks/probes/probe_grammar_engine.py" /root/m1bs 64 512 1 array ) \
      > >(stamp > "$f.txt") 2>&1
    grep -E "round|x of free|warm-up" "$f.txt" | tee -a "$OUT/progress.txt"
    python3 "$STEPS/phases.py" "$f.tsv" 64 | tee -a "$OUT/progress.txt"
    python3 "$STEPS/thin.py" "$f-trace.tsv" | tee -a "$OUT/progress.txt"
  done
  tar czf "$OUT/phases-$((${START:-0}+1)).tgz" -C "$OUT" $(cd "$OUT" && ls phases-*.tsv) && rm -f "$OUT"/phases-*.tsv;;
count)
  P "== count $(date +%T)"
  PYTHONPATH=$PWD SHARES=1 GRAMMAR_MASKS=auto timeout "${LIMIT:-200}" python3 benchmarks/2026-12-01-h200/budget-spacing/count.py \
    /root/m1bs 64 512 > "$OUT/count.txt" 2>&1
  grep -E "FAR|COUNTS|x of free" "$OUT/count.txt" | tee -a "$OUT/progress.txt";;
esac
P "== done $1 $(date +%T)"
