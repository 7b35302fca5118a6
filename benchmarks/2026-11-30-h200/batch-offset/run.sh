# One offset array for every layer of the decoding batch (`_step_caches.share_offsets`), on one
# H200 (the stage in /root/gpu-stage as ../link-join/run.sh says; `bash ../link-join/run.sh install`):
#   bash run.sh probe   probe_bare_forward.py at 1 and 64 rows: the plain cache, mlx-lm's batch cache
#                       without its mask, every layer on the first layer's offset (`batch-shared`), and
#                       what the actor does (`batch-after`), 4 rounds alternating
#   bash run.sh c1      one user served: the tree without it (OLD, default .gpuold: `git archive
#                       205e701 trio_mlx`) against this one, in the order ORDER (default old new new
#                       old), each paired request by request with MLX's bare pipelined forward
#                       (../link-join/run.sh c1's recipe, 256 tokens)
#   bash run.sh padded  probe_bare_forward.py --phases at 16 and 64 rows: the plain cache, the actor's
#                       unpadded step (`batch-after`) and its padded one (`batch-padded`), 3 rounds
#   bash run.sh grammar ../graph-cache/run.sh grammar 1 512 array: 64 rows held to the array schema
#                       against free rows of the same tokens (on /root/m1bs); the old tree's from
#                       .gpuold, with `ln -s ../benchmarks .gpuold/` and this run from there
# Results and progress.txt under $OUT.
set -u
P() { echo "$@" | tee -a "$OUT/progress.txt"; }
S() { python3 benchmarks/2026-11-29-h200/speculative/batched/summ.py "$@"; }
up() { local t; for t in $(seq 240); do curl -sf "localhost:$1/v1/models" > /dev/null && return; sleep 1; done; P "port $1 never came up"; }
M=${M1B:-/root/m1b}
HERE=$PWD
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
  n=0
  for t in ${ORDER:-old new new old}; do
    n=$((n+1))
    tree=$HERE; [ "$t" = old ] && tree=$HERE/${OLD:-.gpuold}
    P "$n $t: $(cd "$tree" && python3 -c 'import trio_mlx.actor as a, os; print(os.path.dirname(a.__file__), os.path.exists(os.path.join(os.path.dirname(a.__file__), "_step_caches.py")))')"
    ( cd "$tree" && exec python3 -m trio_mlx.cli serve --model "$M" --port 8091 ) > "$OUT/serve-$n-$t.log" 2>&1 & SP=$!
    up 8091
    timeout 150 python3 -m trio_mlx.cli bench --url http://127.0.0.1:8091 --model "$M" --paired "$OUT/c1-$n-$t-ceil.json" \
      --ceiling bare --concurrency 1 --requests-per-level 12 --paired-rounds 6 --max-tokens 256 --prompt-tokens 128 \
      --quiet --out "$OUT/c1-$n-$t.json" > "$OUT/c1-$n-$t.log" 2>&1
    P "$n $t $(date +%T)"; P "$(S "$OUT/c1-$n-$t.json" "$OUT/c1-$n-$t-ceil.json")"
    kill $SP; wait $SP 2>/dev/null
  done;;
esac
P "== done $1 $(date +%T)"
