# What the grammar budget's checks cost the served constrained step, and where the step's
# time goes, on one H200 (the stage in /root/gpu-stage as ../auto-rule/README.md says, with
# SmolLM2's tokenizer files in /root/gpu-stage/smoltok and py-spy's static binary there):
#   bash run.sh install   ../graph-cache/run.sh's install (/root/m1b, /root/m1bs)
#   bash run.sh engine    probe_grammar_engine.py /root/m1bs 64 512 1 array, every row constrained,
#                         `after` and `auto` paired in one engine (MODES), the budget on, off, on
#                         (BUDGET=off: no row measures itself), each engine with a step trace;
#                         py-spy samples the first engine's threads (--idle) in 5 s windows
#   bash run.sh upload    probe_mask_upload.py: the masks handed over by copy or through a view,
#                         64 rows, SmolLM2's vocabulary (49,152) and Llama 3's (128,256)
#   bash run.sh native    py-spy --native (5 s windows) on the grammar engine under `auto` (the
#                         server's default), then on a server at c=1 (the bench at c=1 for 40 s)
#   bash run.sh pool [SIZES]   probe_grammar_engine.py as `engine`, under `auto` alone, llguidance's pool
#                         at each of SIZES threads in turn (POOL; default "12 4 12 4"), each with a trace
#   bash run.sh blocking  `native`'s grammar engine, py-spy --native without --nonblocking, which
#                         `native` took nothing with: it pauses the process for each sample (50 Hz),
#                         so every sampled step runs longer by a pause
#   bash run.sh handover [WAYS]   probe_grammar_engine.py as `pool`, the masks filled in place (view)
#                         or handed over as a copy (MASK_COPY=1), in the order WAYS (default
#                         "view copy view"), each with a trace
# Results and progress.txt under $OUT; each probe line carries the time it was printed.
set -u
P() { echo "$@" | tee -a "$OUT/progress.txt"; }
stamp() { while IFS= read -r l; do echo "$(date +%T.%N | cut -c1-12) $l"; done; }
SPY=${SPY:-/root/gpu-stage/py-spy}
case $1 in
install) bash benchmarks/2026-11-30-h200/graph-cache/run.sh install;;
engine)
  export PYTHONPATH=$PWD
  n=0
  for budget in on off on; do
    n=$((n+1)); f="$OUT/engine-$n-budget-$budget.txt"
    P "== engine $n budget $budget $(date +%T)"
    env $( [ $budget = off ] && echo BUDGET=off ) SHARES=1 MODES=after,auto TRIO_MLX_STEP_TRACE="$OUT/trace-$n-$budget.tsv" \
      timeout "${LIMIT:-170}" python3 benchmarks/probes/probe_grammar_engine.py /root/m1bs 64 512 1 array > >(stamp > "$f") 2>&1 &
    PID=$!
    if [ $n = 1 ] && [ -x $SPY ]; then
      for w in $(seq 30); do
        kill -0 $PID 2>/dev/null || break
        CH=$(pgrep -P $PID python3 | head -1); [ -n "$CH" ] || { sleep 1; continue; }
        $SPY record -p $CH -d 5 -r 250 --threads --idle --nonblocking -f raw -o "$OUT/spy-$(date +%H%M%S).txt" \
          > /dev/null 2>> "$OUT/spy-errors.txt"
      done
    fi
    wait $PID
    sleep 1
    grep -E "round|x of free|warm-up|after|auto" "$f" | tee -a "$OUT/progress.txt"
  done;;
pool)
  export PYTHONPATH=$PWD
  n=0
  for p in ${2:-12 4 12 4}; do
    n=$((n+1)); f="$OUT/pool-$n-$p.txt"
    P "== pool $n: $p threads $(date +%T)"
    POOL=$p GRAMMAR_MASKS=auto SHARES=1 TRIO_MLX_STEP_TRACE="$OUT/trace-pool-$n-$p.tsv" timeout "${LIMIT:-150}" \
      python3 benchmarks/probes/probe_grammar_engine.py /root/m1bs 64 512 1 array > "$f" 2>&1
    grep -E "^round|x of free" "$f" | tee -a "$OUT/progress.txt"
  done;;
handover)
  export PYTHONPATH=$PWD
  n=0
  for w in ${2:-view copy view}; do
    n=$((n+1)); f="$OUT/handover-$n-$w.txt"
    P "== handover $n: $w $(date +%T)"
    env $( [ $w = copy ] && echo MASK_COPY=1 ) GRAMMAR_MASKS=auto SHARES=1 TRIO_MLX_STEP_TRACE="$OUT/trace-handover-$n-$w.tsv" \
      timeout "${LIMIT:-150}" python3 benchmarks/probes/probe_grammar_engine.py /root/m1bs 64 512 1 array > "$f" 2>&1
    grep -E "^round|x of free" "$f" | tee -a "$OUT/progress.txt"
  done;;
upload)
  for v in 49152 128256; do
    P "== upload vocab $v $(date +%T)"
    timeout 120 python3 benchmarks/probes/probe_mask_upload.py --rows 64 --vocab $v --rounds 3 2>&1 | tee -a "$OUT/progress.txt"
  done;;
native)
  export PYTHONPATH=$PWD
  spy() {  # spy PID NAME N [direct]: N windows of 5 s, native frames, of PID's python3 child (direct: PID's own)
    for w in $(seq $3); do
      kill -0 $1 2>/dev/null || break
      CH=$1; [ -n "${4:-}" ] || CH=$(pgrep -P $1 python3 | head -1); [ -n "$CH" ] || { sleep 1; continue; }
      $SPY record -p $CH -d 5 -r 200 --threads --idle --native --nonblocking -f raw -o "$OUT/$2-$(date +%H%M%S).txt" \
        > /dev/null 2>> "$OUT/spy-errors.txt"
    done; }
  P "== native grammar auto $(date +%T)"
  GRAMMAR_MASKS=auto SHARES=1 TRIO_MLX_STEP_TRACE="$OUT/trace-native.tsv" timeout 150 python3 \
    benchmarks/probes/probe_grammar_engine.py /root/m1bs 64 512 1 array > >(stamp > "$OUT/native-grammar.txt") 2>&1 &
  PID=$!; spy $PID grammar 30; wait $PID
  grep -E "round|x of free|warm-up" "$OUT/native-grammar.txt" | tee -a "$OUT/progress.txt"
  P "== native c1 $(date +%T)"
  python3 -m trio_mlx.cli serve --model /root/m1b --port 8091 > "$OUT/serve-c1.log" 2>&1 & SP=$!
  for t in $(seq 240); do curl -sf localhost:8091/v1/models > /dev/null && break; sleep 1; done
  timeout 60 python3 -m trio_mlx.cli bench --url http://127.0.0.1:8091 --model /root/m1b --concurrency 1 \
    --requests-per-level 40 --max-tokens 256 --prompt-tokens 128 --quiet --out "$OUT/c1.json" > "$OUT/c1.log" 2>&1 & BP=$!
  sleep 8; spy $SP c1 4 direct; wait $BP; kill $SP; wait $SP 2>/dev/null
  tail -3 "$OUT/c1.log" | tee -a "$OUT/progress.txt";;
blocking)
  export PYTHONPATH=$PWD
  P "== blocking grammar auto $(date +%T)"
  GRAMMAR_MASKS=auto SHARES=1 TRIO_MLX_STEP_TRACE="$OUT/trace-blocking.tsv" timeout "${LIMIT:-150}" python3 \
    benchmarks/probes/probe_grammar_engine.py /root/m1bs 64 512 1 array > >(stamp > "$OUT/blocking-grammar.txt") 2>&1 &
  PID=$!
  for w in $(seq 30); do
    kill -0 $PID 2>/dev/null || break
    CH=$(pgrep -P $PID python3 | head -1); [ -n "$CH" ] || { sleep 1; continue; }
    P "spy window $w $(date +%T.%N | cut -c1-12)"
    $SPY record -p $CH -d 5 -r 50 --threads --idle --native -f raw -o "$OUT/blocking-$(date +%H%M%S).txt" \
      > /dev/null 2>> "$OUT/spy-errors.txt"
  done
  wait $PID
  grep -E "round|x of free|warm-up" "$OUT/blocking-grammar.txt" | tee -a "$OUT/progress.txt";;
esac
P "== done $1 $(date +%T)"
