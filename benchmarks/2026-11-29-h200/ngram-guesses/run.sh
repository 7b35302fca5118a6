# Prompt lookup drafting only after its guesses hit, against the code before (OLD: a tree of
# trio_mlx from before the change) and speculation off, on one H200.
#   OLD=DIR bash run.sh random   # random 1B shape, 128-token random prompts, c=1,4,16, two rounds
#   bash run.sh repeat           # the embedded SmolLM2 asked to repeat a file (probe_speculative.py)
#   bash run.sh trace            # c=4 alone, off and ngram, with step traces (TRIO_MLX_STEP_TRACE)
#   bash run.sh plain            # probe_plain_with_drafter.py: a plain step with a drafter, cold and warmed
# Results and progress.txt under $OUT.
set -u
NEW=$PWD
source benchmarks/probes/spec_ab.sh
case $1 in
random)
  model_1b
  random_round 1
  random_round 2 ;;
plain)
  model_1b
  for w in "" --warm; do
    P "== plain steps with a drafter $w $(date +%T)"
    timeout 200 python3 benchmarks/probes/probe_plain_with_drafter.py /root/m1b --rounds 2 $w 2>&1 | tail -8 | tee -a "$OUT/progress.txt"
  done ;;
trace)
  traces ;;
repeat)
  repeat repeat "$NEW" 2 off,ngram ;;
esac
P "== done $(date +%T)"
