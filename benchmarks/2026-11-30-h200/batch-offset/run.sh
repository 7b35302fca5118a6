# One offset array for every layer of the decoding batch (`_step_caches.share_offsets`), on one
# H200 (the stage in /root/gpu-stage as ../link-join/run.sh says; `bash ../link-join/run.sh install`):
#   bash run.sh probe   probe_bare_forward.py at 1 and 64 rows: the plain cache, mlx-lm's batch cache
#                       without its mask, every layer on the first layer's offset (`batch-shared`), and
#                       what the actor does (`batch-after`), 4 rounds alternating
#   bash run.sh c1      one user served: the tree without it (OLD, default .gpuold: `git archive
#                       205e701 trio_mlx`) against this one, in the order ORDER (default old new new
#                       old), each paired request by request with MLX's bare pipelined forward
#                       (../link-join/run.sh c1, the thread actor, 256 tokens; its files are named
#                       thread-.gpuold for the old tree, thread for this one)
#   bash run.sh padded  probe_bare_forward.py --phases at 16 and 64 rows: the plain cache, the actor's
#                       unpadded step (`batch-after`) and its padded one (`batch-padded`), 3 rounds
#   bash run.sh grammar ../graph-cache/run.sh grammar 1 512 array: 64 rows held to the array schema
#                       against free rows of the same tokens (on /root/m1bs); the old tree's from
#                       .gpuold, with `ln -s ../benchmarks .gpuold/` and this run from there
# Results and progress.txt under $OUT.
set -u
P() { echo "$@" | tee -a "$OUT/progress.txt"; }
M=${M1B:-/root/m1b}
case $1 in
probe)
  PYTHONPATH=$PWD python3 benchmarks/probes/probe_bare_forward.py "$M" --rows 1,64 --steps 300 --rounds 4 \
    --cache plain,batch-nomask,batch-shared,batch-after --out "$OUT/probe.json" > "$OUT/probe.txt" 2>&1
  tee -a "$OUT/progress.txt" < "$OUT/probe.txt";;
padded)
  PYTHONPATH=$PWD python3 benchmarks/probes/probe_bare_forward.py "$M" --rows 16,64 --steps 200 --rounds 3 \
    --cache plain,batch-after,batch-padded --phases --out "$OUT/padded.json" > "$OUT/padded.txt" 2>&1
  tee -a "$OUT/progress.txt" < "$OUT/padded.txt";;
grammar) PYTHONPATH=$PWD bash benchmarks/2026-11-30-h200/graph-cache/run.sh grammar 1 512 array;;
c1)
  order=""
  for t in ${ORDER:-old new new old}; do
    if [ "$t" = old ]; then order="$order thread@${OLD:-.gpuold}"; else order="$order thread"; fi
  done
  ORDER=$order bash benchmarks/2026-11-30-h200/link-join/run.sh c1;;
esac
P "== done $1 $(date +%T)"
