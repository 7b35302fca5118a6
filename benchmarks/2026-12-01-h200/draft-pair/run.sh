# Speculation with a draft model, one user: SmolLM2 grown to 16 GB (grow_target.py, W=153600,
# S=0.15) verifying SmolLM2-135M's drafts, on one H200 (the stage in /root/gpu-stage: the
# three parts of prepare-wheels.sh, ../../2026-11-30-h200/graph-cache's wheels (.gpu4) and the
# embedded model's GGUF in three parts gg_1..gg_3):
#   bash run.sh install        the wheels and the GGUF (../../2026-11-30-h200/auto-rule/run.sh
#                              install), the pair under /root/pair (smol, grown-W)
#   bash run.sh pair [KS]      probe_draft_pair.py: each model's plain step, the verify and the
#                              drafts, and greedy speculation as lean as it goes (KS: 3,4)
#   bash run.sh engine [ORDER] `trio-mlx bench --engine` at c=1 (random 128-token prompts, 128
#                              tokens, 16 requests), once per word of ORDER (default "off draft
#                              draft off"; draft: TRIO_MLX_DRAFT_MODEL, K=${K:-3}), step traces
#                              read by ../../2026-11-30-h200/random-levels/steps.py; ACTOR=process:
#                              the actor in a child process (for every run; a word
#                              WHAT@ACTOR, e.g. draft@process, for that run)
#   bash run.sh phases [CONFIGS] probe_spec_phases.py on the pair: the edit workload at c=1, each
#                              speculative step's phases (CONFIGS: draft4,draft3)
#   bash run.sh profile        the draft model's chained drafts (probe_spec_phases.py --chain-only), timed, and
#                              under `py-spy record --native` (native.txt; profile_summary.py reads it)
# W=WIDTH picks the target (default 153600, 16 GB); `install` builds every width of WIDTHS.
# Results and progress.txt under $OUT.
set -u
P() { echo "$@" | tee -a "$OUT/progress.txt"; }
S=/root/gpu-stage; SMOL=/root/pair/smol; W=${W:-153600}; G=/root/pair/grown-$W  # W: the target's MLP width
export PYTHONPATH=$PWD:/root/emb PYTHONUNBUFFERED=1
case $1 in
install)
  NO_M1B=1 bash benchmarks/2026-11-30-h200/auto-rule/run.sh install  # the wheels, the GGUF
  for w in ${WIDTHS:-$W}; do  # each target width asked for (153600: 16 GB of bfloat16; 307200: 32 GB)
    [ -f /root/pair/grown-$w/config.json ] || python3 benchmarks/probes/grow_target.py --embedded --dtype bfloat16 \
      $SMOL /root/pair/grown-$w --intermediate $w --scale 0.15 >> "$OUT/build.log" 2>&1
  done
  P "== installed $(du -sh $SMOL /root/pair/grown-* 2>&1 | tr '\n' ' ') $(date +%T)";;
pair)
  P "== pair $(date +%T)"
  timeout "${LIMIT:-240}" python3 benchmarks/probes/probe_draft_pair.py $G $SMOL --ks "${2:-3,4}" \
    --tokens 256 --rounds "${ROUNDS:-2}" 2>&1 | grep -v Warning | tee -a "$OUT/progress.txt";;
engine)
  n=${START:-0}
  for w in ${2:-off draft draft off}; do
    a=${w#*@}; [ "$a" = "$w" ] && a=${ACTOR:-thread}; w=${w%@*}  # WHAT@ACTOR: this run's actor
    n=$((n+1)); f=$OUT/engine-$n-$w-$W-$a
    P "== engine $n $w $a $(date +%T)"
    extra=(); [ "$w" = draft ] && extra=(TRIO_MLX_DRAFT_MODEL=$SMOL TRIO_MLX_NUM_DRAFT_TOKENS=${K:-3})
    env "${extra[@]}" TRIO_MLX_STEP_TRACE="$f.tsv" timeout "${LIMIT:-150}" python3 -m trio_mlx.cli bench --engine \
      --actor "$a" --model $G --concurrency 1 --requests-multiple 16 --min-requests 16 --max-tokens 128 \
      --prompt-tokens 128 --quiet --out "$f.json" > "$f.log" 2>&1
    [ -f "$f.json" ] && python3 -c "
import json, sys
for L in json.load(open('$f.json'))['levels']:
    print(f\"  c={L['concurrency']} {L['output_throughput']:.0f} tok/s tpot p50 {L['tpot_ms']['p50']:.2f} ms done {L['completed']}/{L['requests']}\")
" | tee -a "$OUT/progress.txt"
  done
  python3 benchmarks/2026-11-30-h200/random-levels/steps.py "$OUT" | tee -a "$OUT/progress.txt";;
phases)
  P "== phases $(date +%T)"
  timeout "${LIMIT:-300}" python3 benchmarks/probes/probe_spec_phases.py --model $G --draft $SMOL \
    --configs "${2:-draft4,draft3}" --max-tokens 300 --repeats 3 2>&1 | grep -v Warning | tee -a "$OUT/progress.txt";;
profile)
  P "== profile $(date +%T)"
  timeout 90 python3 benchmarks/probes/probe_spec_phases.py --draft $SMOL --chain-only 300 2>&1 | grep -v Warning | tee -a "$OUT/progress.txt"
  timeout 150 py-spy record --native --format raw -r 97 -o "$OUT/native.txt" -- \
    python3 benchmarks/probes/probe_spec_phases.py --draft $SMOL --chain-only 200 > /dev/null 2>&1
  python3 benchmarks/2026-12-01-h200/draft-pair/profile_summary.py "$OUT/native.txt" 45 > "$OUT/draft-host-profile.txt";;
esac
P "== done $1 $(date +%T)"
