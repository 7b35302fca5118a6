# A grammar's rows dealt across one start matcher per pool thread (their own lexers) against
# every row a copy of one start, on one H200 (the stage in /root/gpu-stage as
# ../auto-rule/README.md says, SmolLM2's tokenizer files in /root/gpu-stage/smoltok; the tree
# before the change in .gpuold, `git archive 3ff949b trio_mlx`):
#   bash run.sh install   ../graph-cache/run.sh's install (/root/m1bs: the 1B shape, bf16, SmolLM2's tokenizer)
#   bash run.sh host      probe_grammar_host.py, array and string, 64 rows, llguidance's pool at 12
#                         threads, rows over 12 lexers against 1, 2 rounds
#   bash run.sh engine    probe_grammar_engine.py /root/m1bs 64 512 1 array (every row constrained)
#                         with the tree as it is, the tree before, the tree as it is
# Results and progress.txt under $OUT.
set -u
P() { echo "$@" | tee -a "$OUT/progress.txt"; }
case $1 in
install) bash benchmarks/2026-11-30-h200/graph-cache/run.sh install;;
host)
  P "== host: nproc $(nproc) $(date +%T)"
  PYTHONPATH=$PWD timeout "${LIMIT:-200}" python3 benchmarks/probes/probe_grammar_host.py --rows 64 --max-tokens 512 \
    --schemas array,string --rounds 2 --tokenizer /root/gpu-stage/smoltok --pool-threads 12 --lexers pool,1 > "$OUT/host.txt" 2>&1
  grep -E "^round|warm-up" "$OUT/host.txt" | tee -a "$OUT/progress.txt";;
engine)
  n=0
  for tree in . .gpuold .; do
    n=$((n+1)); f="$OUT/engine-$n-$( [ $tree = . ] && echo new || echo old ).txt"
    P "== engine $n $tree $(date +%T)"
    PYTHONPATH=$PWD/$tree SHARES=1 timeout "${LIMIT:-150}" python3 benchmarks/probes/probe_grammar_engine.py /root/m1bs 64 512 1 array > "$f" 2>&1
    grep -E "^round|x of free" "$f" | tee -a "$OUT/progress.txt"
  done;;
esac
P "== done $1 $(date +%T)"
