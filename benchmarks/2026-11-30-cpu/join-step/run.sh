#!/bin/bash
# `trio-mlx bench --engine`, BASE's tree against TREE's, three rounds in alternating order
# (`-m` runs the working directory's trio_mlx: each side from its own tree). Each line: the
# tree, the round, the level's summary.
#   BASE=/tmp/base TREE=$PWD MODEL=DIR C=16 P=32 M=16 RM=16 bash run.sh
OUT=${OUT:-runs.txt}; : > $OUT
for r in 1 2 3; do
  if [ $((r % 2)) = 1 ]; then order="$BASE $TREE"; else order="$TREE $BASE"; fi
  for t in $order; do
    (cd $t && python -m trio_mlx.cli bench --engine --model $MODEL --concurrency $C \
      --prompt-tokens $P --max-tokens $M --max-tokens-spread 0.5 --requests-multiple $RM --warmup 4 --out /tmp/join-$r.json 2>&1 \
      | grep "c=$C " | sed "s|^|$t $r |") >> $OUT
  done
done
