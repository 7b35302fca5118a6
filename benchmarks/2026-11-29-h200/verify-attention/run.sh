# A speculative step's attention as matmuls (`_shapes.few_queries`) against query by query
# (OLD: a trio_mlx tree from before the change), on one H200. Results and progress.txt under $OUT.
#   bash run.sh probe          # probe_verify_phases.py: the attention alone, and the actor's steps
#   OLD=DIR bash run.sh random R  # random 1B shape, 128-token random prompts, c=1,4,16; round R (1 or 2)
#   bash run.sh trace          # c=4, off / ngram / ngram / off, with step traces (TRIO_MLX_STEP_TRACE)
#   bash run.sh repeat         # the embedded SmolLM2 asked to repeat a passage (probe_speculative.py)
#   OLD=DIR bash run.sh repeat-old  # the same, prompt lookup alone, with the OLD tree (one round)
set -u
NEW=$PWD
source benchmarks/probes/spec_ab.sh
model_1b
case $1 in
probe)
  P "== probe_verify_phases $(date +%T)"
  timeout 280 python3 benchmarks/probes/probe_verify_phases.py /root/m1b --rows 4 --tokens 160 2>&1 \
    | grep -v '^\[' | tee -a "$OUT/progress.txt" ;;
random)
  random_round "$2" ;;
trace)
  traces ;;
repeat)
  repeat repeat "$NEW" 2 off,ngram ;;
repeat-old)
  repeat repeat-old "$OLD" 1 ngram ;;
esac
P "== done $1 $(date +%T)"
