# Sourced by a-insertions/run.sh and b-graph-knobs/run.sh: P (a line to OUT/progress.txt), the
# random bf16 1B model in /tmp/m1b, and one warm-up run through phase.py.
set -u
P() { echo "$@" | tee -a $OUT/progress.txt; }
[ -d /tmp/m1b ] || python3 -m trio_mlx.cli model build --shape llama-3.2-1b --dtype bfloat16 /tmp/m1b > /dev/null 2>&1
timeout 150 python3 benchmarks/2026-11-29-h200/step-phases/phase.py bench --engine --model /tmp/m1b --concurrency 4 --requests-per-level 4 --max-tokens 16 --prompt-tokens 128 --quiet --out $OUT/warm.json > $OUT/warm.log 2>&1
P "warm rc=$? $(date +%T)"
