#!/bin/bash
# Rounds of loop_cost.py configurations, interleaved; the probe is copied with a hook (PATCH, run in
# its server) that sets the pacing gap for two of them. Appends to results.txt here.
OUT="$(cd "$(dirname "$0")" && pwd)/results.txt"
cd "$(dirname "$0")/../../.."  # the repository root
PY=${PY:-python}
P=/tmp/loop_cost_p.py
cp benchmarks/probes/loop_cost.py $P
sed -i 's/^model, port, step, profile, vocab = /import os; exec(os.environ.get("PATCH", ""))\nmodel, port, step, profile, vocab = /' $P
sed -i "s|ROOT = Path(__file__).resolve().parents\[2\]|ROOT = Path('$PWD')|" $P
G1="from trio_mlx.server import _completions; _completions._MAX_GAP = 1.0"
G006="from trio_mlx.server import _completions; _completions._MAX_GAP = 0.06"
one(){ name=$1; shift; pt=$1; shift; line=$(PATCH="$pt" PYTHONPATH=$PWD timeout 900 $PY $P --concurrency 256 "$@" 2>&1 | grep "^c=256"); echo "$(date -u +%H:%M:%S) round=$R $name $* | $line" | tee -a "$OUT"; }
for R in 1 2 3; do
  one embedded "" 
  one tiny "" --model tiny
  one embedded-t16 "" --max-tokens 16 --requests-multiple 8
  one embedded-t1024 "" --max-tokens 1024 --requests-multiple 1
  one embedded-gap1 "$G1"
  one embedded-gap0.06 "$G006"
done
