#!/bin/bash
# The fake-actor server with prompts tokenized inline up to 4096 characters (the default) against
# NEW, 4 rounds in alternating order: `trio-mlx bench` at C users, P-token prompts, 2 new tokens,
# 768 requests a run, and the server process's CPU ticks over the run.
#   NEW=1024 P=512 C=64 MODEL=tests' tiny model bash run.sh
# PY (default python) runs the server and TM (default trio-mlx) the bench: on a host where the
# project is not installed, from the tree's root, PY=python3 TM="python3 -m trio_mlx.cli" with
# PYTHONPATH=$PWD.
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PY:-python}
TM=${TM:-trio-mlx}
for r in 1 2 3 4; do
  if [ $((r % 2)) = 1 ]; then order="4096 $NEW"; else order="$NEW 4096"; fi
  for t in $order; do
    TCH=$t $PY "$HERE/serve_fake.py" "$MODEL" 8940 0.005 > /tmp/serve_fake.log 2>&1 &
    sleep 6
    pid=$!
    c0=$(awk '{print $14+$15}' /proc/$pid/stat)
    res=$($TM bench --url http://127.0.0.1:8940 --model "$MODEL" --prompt-tokens "$P" --max-tokens 2 \
      --concurrency "$C" --requests-per-level 768 --out /tmp/tokenize-lanes.json 2>&1 | tail -1)
    c1=$(awk '{print $14+$15}' /proc/$pid/stat)
    echo "threshold $t round $r: $res  server cpu $((c1 - c0)) ticks"
    kill $pid; wait $pid 2>/dev/null
  done
done
