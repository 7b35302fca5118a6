# Grammar rows at 64 on one H200, the random bf16 1B shape (built at /root/m1b), every row held
# to the schema (probe_grammar_engine.py, 256 tokens, against free rows given the same counts):
#   bash run.sh RUN...         one engine per RUN, RUN = SCHEMA-MODE or SCHEMA-MODE-nobudget
#                              (SCHEMA array|string; nobudget: BUDGET=off, no budget checks)
#   bash run.sh paired SCHEMA ROUNDS MODES
#                              one engine, MODES (e.g. after,before,auto) paired in every round
# Results and progress.txt under $OUT.
set -u
P() { echo "$@" | tee -a "$OUT/progress.txt"; }
[ -d /root/m1b ] || python3 -m trio_mlx.cli model build --shape llama-3.2-1b --dtype bfloat16 /root/m1b > /dev/null 2>&1
if [ "$1" = paired ]; then
  P "== paired $2 $3 rounds $4 $(date +%T)"
  f="$OUT/paired-$2-$(date +%s).txt"
  MODES=$4 timeout 240 python3 benchmarks/probes/probe_grammar_engine.py /root/m1b 64 256 "$3" "$2" > "$f" 2>&1
  grep -E "^round|x of free" "$f" | tee -a "$OUT/progress.txt"
  exit
fi
for run in "$@"; do
  IFS=- read -r schema mode budget <<< "$run"
  P "== $run $(date +%T)"
  f="$OUT/$run-$(date +%s).txt"
  ( [ "$budget" = nobudget ] && export BUDGET=off
    SHARES=1 GRAMMAR_MASKS=$mode timeout 150 python3 benchmarks/probes/probe_grammar_engine.py /root/m1b 64 256 1 "$schema" \
      > "$f" 2>&1 )
  tail -2 "$f" | tee -a "$OUT/progress.txt"
done
P "== done $(date +%T)"
