# Where a constrained 64-row step's time goes at this tree, on one H200 (the stage in
# /root/gpu-stage as ../auto-rule/README.md says, SmolLM2's tokenizer files in
# /root/gpu-stage/smoltok, py-spy installed from its wheel):
#   bash run.sh install   ../graph-cache/run.sh's install (/root/m1b, /root/m1bs)
#   bash run.sh spy       ../grammar-budget/run.sh blocking (the grammar engine under `auto` with a step
#                         trace, py-spy --native, blocking, 50 Hz, in 5 s windows, raw files kept)
#   bash run.sh engine [R] [TREES]
#                         probe_grammar_engine.py as `spy`, no py-spy, R rounds (default 2), once per
#                         tree in TREES (default "."; another tree: a directory holding its trio_mlx),
#                         each with a step trace
#   bash run.sh phases [MODES]
#                         probe_grammar_engine.py as `engine`, one round, once per masks mode in MODES
#                         (default "auto after"), each with the decode step's parts timed (PHASES)
#                         and read by phases.py at 64 rows
#   bash run.sh lexers [ORDER]
#                         a grammar's rows over 12 lexers (one per thread of llguidance's pool, the
#                         rule until now) against 64: probe_grammar_host.py --split (one round), then
#                         `phases`'s engine under `auto` with LEXERS=N for each N in ORDER (default
#                         "12 64 64 12")
#   bash run.sh budget [ORDER]
#                         `phases`'s engine under `auto`, the array schema, with the rows' budget checks
#                         on and off (BUDGET=off: no row measures itself against max_tokens) in ORDER
#                         (default "on off off on")
#   bash run.sh default  the rule now (four lexers per pool thread: 48 on this host) against 12:
#                         probe_grammar_host.py (array and string schemas, two rounds, lexers 48,12),
#                         then `phases`'s engine under `auto` with the string schema (256 tokens)
#                         and the array schema (512), each at the default and at LEXERS=12
# Results and progress.txt under $OUT; ../grammar-budget/steps64.py and thin.py read the traces.
set -u
P() { echo "$@" | tee -a "$OUT/progress.txt"; }
stamp() { while IFS= read -r l; do echo "$(date +%T.%N | cut -c1-12) $l"; done; }
HERE=$PWD
run_phases() {  # run_phases MODE NAME [TOKENS SCHEMA]: one engine under GRAMMAR_MASKS=MODE, its parts timed
  local f="$OUT/phases-$2"
  P "== phases $2 (masks $1${LEXERS:+, lexers $LEXERS}) $(date +%T)"
  PYTHONPATH=$PWD GRAMMAR_MASKS=$1 SHARES=1 PHASES="$f.tsv" TRIO_MLX_STEP_TRACE="$f-trace.tsv" \
    timeout "${LIMIT:-200}" python3 benchmarks/probes/probe_grammar_engine.py /root/m1bs 64 "${3:-512}" 1 "${4:-array}" \
    > >(stamp > "$f.txt") 2>&1
  grep -E "round|x of free|warm-up" "$f.txt" | tee -a "$OUT/progress.txt"
  python3 benchmarks/2026-11-30-h200/grammar-steps/phases.py "$f.tsv" 64 | tee -a "$OUT/progress.txt"
  python3 benchmarks/2026-11-30-h200/grammar-steps/thin.py "$f-trace.tsv" | tee -a "$OUT/progress.txt"
}
case $1 in
install) bash benchmarks/2026-11-30-h200/graph-cache/run.sh install;;
spy) SPY=$(command -v py-spy) bash benchmarks/2026-11-30-h200/grammar-budget/run.sh blocking;;
engine)
  n=0
  for tree in ${3:-.}; do
    n=$((n+1)); name=$(basename "$(cd "$tree" && pwd)")
    f="$OUT/engine-$n-$name.txt"
    P "== engine $n $name $(date +%T)"
    ( cd "$tree" && PYTHONPATH=$PWD GRAMMAR_MASKS=auto SHARES=1 TRIO_MLX_STEP_TRACE="$OUT/trace-$n-$name.tsv" \
      timeout "${LIMIT:-200}" python3 "$HERE/benchmarks/probes/probe_grammar_engine.py" /root/m1bs 64 512 "${2:-2}" array ) \
      > >(stamp > "$f") 2>&1
    grep -E "round|x of free|warm-up" "$f" | tee -a "$OUT/progress.txt"
    python3 benchmarks/2026-11-30-h200/grammar-steps/thin.py "$OUT/trace-$n-$name.tsv" | tee -a "$OUT/progress.txt"
  done;;
lexers)
  P "== host lexers 12,64 $(date +%T)"
  PYTHONPATH=$PWD timeout 200 python3 benchmarks/probes/probe_grammar_host.py --rows 64 --max-tokens 512 \
    --schemas array --rounds 1 --split --tokenizer /root/gpu-stage/smoltok --pool-threads 12 --lexers 12,64 \
    > "$OUT/host-lexers.txt" 2>&1
  grep -E "^round|split|consume_many|fill_many|measure  " "$OUT/host-lexers.txt" | tee -a "$OUT/progress.txt"
  n=0
  for lx in ${2:-12 64 64 12}; do
    n=$((n+1)); LEXERS=$lx run_phases auto "lexers$lx-$n"
  done
  tar czf "$OUT/phases.tgz" -C "$OUT" $(cd "$OUT" && ls phases-*.tsv) && rm -f "$OUT"/phases-*.tsv;;
default)
  P "== host lexers 48,12 $(date +%T)"
  PYTHONPATH=$PWD timeout 200 python3 benchmarks/probes/probe_grammar_host.py --rows 64 --max-tokens 512 \
    --schemas array,string --rounds 2 --tokenizer /root/gpu-stage/smoltok --pool-threads 12 --lexers 48,12 \
    > "$OUT/host-default.txt" 2>&1
  grep -E "^round" "$OUT/host-default.txt" | tee -a "$OUT/progress.txt"
  run_phases auto string-default 256 string
  LEXERS=12 run_phases auto string-lexers12 256 string
  LEXERS=12 run_phases auto array-lexers12
  run_phases auto array-default
  tar czf "$OUT/phases.tgz" -C "$OUT" $(cd "$OUT" && ls phases-*.tsv) && rm -f "$OUT"/phases-*.tsv;;
budget)
  n=0
  for b in ${2:-on off off on}; do
    n=$((n+1)); BUDGET=$b run_phases auto "array-budget-$b-$n"
  done
  tar czf "$OUT/phases.tgz" -C "$OUT" $(cd "$OUT" && ls phases-*.tsv) && rm -f "$OUT"/phases-*.tsv;;
phases)
  for mode in ${2:-auto after}; do
    run_phases "$mode" "$mode"
  done
  tar czf "$OUT/phases.tgz" -C "$OUT" $(cd "$OUT" && ls phases-*.tsv) && rm -f "$OUT"/phases-*.tsv;;
esac
P "== done $1 $(date +%T)"
