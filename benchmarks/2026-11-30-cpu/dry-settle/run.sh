#!/bin/bash
# BASE's tree against TREE's, ROUNDS rounds in alternating order, `waves.py` on MODEL with N rows a wave.
# MODEL: the tiny test model with 16 layers (the 1B shape's count), built once with
#   python -c 'from trio_mlx.models import _test_models as t; t.SHAPES["tiny16"] = dict(t.SHAPES["tiny"], num_hidden_layers=16); t.build_test_model("/tmp/tiny16", shape="tiny16")'
#   BASE=/tmp/base TREE=$PWD MODEL=/tmp/tiny16 N=32 ROUNDS=3 bash run.sh
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$HERE/results.txt}; : > "$OUT"
for r in $(seq 1 "${ROUNDS:-3}"); do
  if [ $((r % 2)) = 1 ]; then order="$BASE $TREE"; else order="$TREE $BASE"; fi
  for t in $order; do
    (cd "$t" && PYTHONPATH="$t" python "$HERE/waves.py" "$MODEL" "${N:-32}" 2>&1 | tail -1 | sed "s|^|$(basename "$t") $r: |") >> "$OUT"
  done
done
cat "$OUT"
