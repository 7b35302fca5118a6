# Three leads left by the morning's records, on one H200 (the stage in /root/gpu-stage as
# ../auto-rule/README.md says, plus SmolLM2's tokenizer.json and tokenizer_config.json in
# /root/gpu-stage/smoltok):
#   bash run.sh install        ../auto-rule/run.sh's install (the wheels, the random bf16 1B at
#                              /root/m1b), and the same shape with SmolLM2's tokenizer at /root/m1bs
#   bash run.sh grammar R TOKENS SCHEMA...
#                              probe_grammar_engine.py on /root/m1bs: 64 rows of TOKENS tokens,
#                              every row held to SCHEMA (array, string) against free rows, R rounds,
#                              `--grammar-masks auto` (the default), one engine per schema
#   bash run.sh graphs R [LEVELS]
#                              `trio-mlx bench --engine` on /root/m1b with step traces, MLX's CUDA
#                              graph cache at its default (100 graphs) against 1000
#                              (MLX_CUDA_GRAPH_CACHE_SIZE), R rounds in alternating order (START=N:
#                              from round N; call 7 had none, and ran rounds 1-4 into its limit)
#   bash run.sh fewq R [LEVELS]
#                              prompt lookup (ngram) on /root/m1b, the tree as it is against it with
#                              ../adaptive-drafts/few-query-kernel.patch applied (in a copy of the
#                              tree), each engine with a step trace, R rounds in alternating order;
#                              each variant's MLX kernel cache starts empty in round 1 (its files'
#                              times: when each kernel compiled)
# Results and progress.txt under $OUT; `python3 ../random-levels/steps.py DIR` reads the traces.
set -u
P() { echo "$@" | tee -a "$OUT/progress.txt"; }
HERE=benchmarks/2026-11-30-h200/graph-cache
bench() {  # bench NAME MODEL [env...]: one engine run (of the tree in $TREE, default here), its
           # JSON, log and trace under $OUT
  local f=$OUT/$1 model=$2; shift 2
  P "== $(basename "$f") $(date +%T)"
  ( cd "${TREE:-.}" && env "$@" TRIO_MLX_STEP_TRACE="$f.tsv" timeout "${LIMIT:-150}" python3 -m trio_mlx.cli bench --engine \
    --model "$model" --concurrency "${LEVELS:-1,4,16,64}" --requests-multiple 8 --min-requests 16 \
    --max-tokens 128 --prompt-tokens 128 --quiet --out "$f.json" > "$f.log" 2>&1 )
  [ -f "$f.json" ] && python3 - "$f.json" <<'PY' | tee -a "$OUT/progress.txt"
import json, sys
for L in json.load(open(sys.argv[1]))["levels"]:
    print(f"  c={L['concurrency']} {L['output_throughput']:.0f} tok/s ttft p50 {L['ttft_ms']['p50']:.1f} "
          f"done {L['completed']}/{L['requests']}")
PY
}
case $1 in
install)
  bash benchmarks/2026-11-30-h200/auto-rule/run.sh install
  [ -d /root/m1bs ] || python3 -m trio_mlx.cli model build --shape llama-3.2-1b --dtype bfloat16 \
    --tokenizer /root/gpu-stage/smoltok /root/m1bs > "$OUT/build-m1bs.log" 2>&1
  P "== m1bs built $(ls /root/m1bs | tr '\n' ' ') $(date +%T)";;
grammar)
  r=$2 tokens=$3; shift 3
  for schema in "$@"; do
    P "== grammar $schema $tokens tokens, $r rounds $(date +%T)"
    f=$OUT/grammar-$schema-$tokens.txt
    SHARES=1 GRAMMAR_MASKS=auto timeout "${LIMIT:-280}" python3 benchmarks/probes/probe_grammar_engine.py "${M1BS:-/root/m1bs}" 64 \
      "$tokens" "$r" "$schema" > "$f" 2>&1
    grep -E "^round|x of free|warm-up" "$f" | tee -a "$OUT/progress.txt"
  done;;
graphs)
  for r in $(seq "${START:-1}" "$2"); do  # START: a later call's first round
    if [ $((r % 2)) = 1 ]; then order="100 1000"; else order="1000 100"; fi
    for n in $order; do
      bench "graphs-r$r-$n" "${M1B:-/root/m1b}" MLX_CUDA_GRAPH_CACHE_SIZE=$n
      python3 $HERE/slow.py "$OUT/graphs-r$r-$n.tsv" | tee -a "$OUT/progress.txt"
    done
  done;;
fewq)
  rm -rf /tmp/fewq && mkdir /tmp/fewq && cp -r trio_mlx /tmp/fewq/ && cp -r tests /tmp/fewq/
  (cd /tmp/fewq && patch -p1 -s < "$OLDPWD/benchmarks/2026-11-30-h200/adaptive-drafts/few-query-kernel.patch") || P "patch failed"
  P "patched: $(cd /tmp/fewq && python3 -c 'import trio_mlx.actor._cuda_attention as m; print(m.__file__)') $(grep -c . /tmp/fewq/trio_mlx/actor/_cuda_attention.py) lines"
  for r in $(seq "${START:-1}" "$2"); do  # START: a later call's first round (the caches kept)
    if [ $((r % 2)) = 1 ]; then order="tree patched"; else order="patched tree"; fi
    for v in $order; do
      [ "$r" = 1 ] && rm -rf "/tmp/ptx-$v" && mkdir -p "/tmp/ptx-$v"  # round 1 starts cold
      if [ $v = patched ]; then pp=/tmp/fewq; else pp=$PWD; fi
      python3 -c "import time; print(time.time() - time.monotonic())" > "$OUT/fewq-r$r-$v-clock.txt"
      TREE=$pp LEVELS=${3:-1,4} bench "fewq-r$r-$v" "${M1B:-/root/m1b}" TRIO_MLX_SPECULATIVE=ngram \
        MLX_PTX_CACHE_DIR="/tmp/ptx-$v"
      find "/tmp/ptx-$v" -type f -printf '%T@\t%s\t%f\n' | sort -n > "$OUT/fewq-r$r-$v-ptx.tsv"
      P "  kernels compiled: $(wc -l < "$OUT/fewq-r$r-$v-ptx.tsv")"
      python3 $HERE/slow.py "$OUT/fewq-r$r-$v.tsv" | tee -a "$OUT/progress.txt"
    done
  done;;
esac
P "== done $1 $(date +%T)"
