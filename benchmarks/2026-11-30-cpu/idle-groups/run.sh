#!/bin/bash
# `trio-mlx bench --engine`, BASE's tree against TREE's, ROUNDS rounds in alternating order
# (`-m` runs the working directory's trio_mlx: each side from its own tree), every request's
# answer the same length, so that a level's users end together and come back as a wave; each
# run with a step trace. Each line: the tree, the round, the level's summary; then per run the
# prefill steps (`inserted` > 0): how many, and the median group.
#   BASE=/tmp/base TREE=$PWD MODEL=DIR C=64 P=128 M=32 RM=4 ROUNDS=3 bash run.sh
OUT=${OUT:-runs.txt}; : > "$OUT"
for r in $(seq 1 "${ROUNDS:-3}"); do
  if [ $((r % 2)) = 1 ]; then order="$BASE $TREE"; else order="$TREE $BASE"; fi
  for t in $order; do
    tag=$(basename "$t")-$r
    (cd "$t" && TRIO_MLX_STEP_TRACE=/tmp/idle-$tag.tsv python -m trio_mlx.cli bench --engine --model "$MODEL" \
      --concurrency "$C" --prompt-tokens "$P" --max-tokens "$M" --requests-multiple "$RM" --warmup 4 \
      --out /tmp/idle-$tag.json 2>&1 | grep "c=$C " | sed "s|^|$t $r |") >> "$OUT"
    python3 - "/tmp/idle-$tag.tsv" "$t $r" >> "$OUT" <<'PY'
import csv, statistics, sys
rows = [r for r in csv.DictReader(open(sys.argv[1]), delimiter="\t") if r["t"] != "t"]
groups = [int(r["inserted"]) for r in rows if int(r["inserted"]) > 0]
print(f"{sys.argv[2]} prefill steps {len(groups)}, median group {statistics.median(groups)}, largest {max(groups)}")
PY
    rm -f /tmp/idle-$tag.tsv /tmp/idle-$tag.tsv.requests
  done
done
