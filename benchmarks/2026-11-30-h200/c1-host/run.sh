# One user on the 1B shape, on two H200 machines (the stage as ../auto-rule/README.md says):
#   bash run.sh spy      the first machine: `trio-mlx serve` with the thread actor, then the process
#                        actor, the bench at c=1 beside it; py-spy 8 s at 250 Hz (--nonblocking),
#                        then 8 s --native at 50 Hz (blocking: it pauses the process per sample)
#                        on the actor (the server; the process actor's child), under $OUT/c1s
#   bash run.sh probes   the second machine: the bare forward and the actor's step alone, at one
#                        row, twice in turn, then ../link-join/run.sh c1 with ORDER="thread process"
set -u
SPY=/root/gpu-stage/py-spy
export PYTHONPATH=$PWD
case $1 in
spy)
  O=$OUT/c1s; mkdir -p $O
  for a in thread process; do
    python3 -m trio_mlx.cli serve --model /root/m1b --port 8091 --actor $a > $O/serve-$a.log 2>&1 & SP=$!
    for t in $(seq 240); do curl -sf localhost:8091/v1/models > /dev/null && break; sleep 1; done
    timeout 80 python3 -m trio_mlx.cli bench --url http://127.0.0.1:8091 --model /root/m1b --concurrency 1 \
      --requests-per-level 120 --max-tokens 256 --prompt-tokens 128 --quiet --out $O/c1-$a.json > $O/c1-$a.log 2>&1 & BP=$!
    sleep 6
    T=$SP; [ $a = process ] && T=$(pgrep -P $SP | head -1)
    $SPY record -p $T -d 8 -r 250 --threads --idle --nonblocking -f raw -o $O/py-$a.txt > /dev/null 2>> $O/spy-err.txt
    $SPY record -p $T -d 8 -r 50 --threads --idle --native -f raw -o $O/nat-$a.txt > /dev/null 2>> $O/spy-err.txt
    wait $BP; kill $SP; wait $SP 2>/dev/null
  done;;
probes)
  O=$OUT/c1p; mkdir -p $O
  for r in 1 2; do
    timeout 100 python3 benchmarks/probes/probe_bare_forward.py /root/m1b --rows 1 --steps 300 --rounds 2 \
      --cache plain,batch-nomask > $O/bare-$r.txt 2>&1
    timeout 120 python3 benchmarks/probes/probe_decode_step.py /root/m1b --rows 1 --steps 300 --rounds 3 > $O/step-$r.txt 2>&1
  done
  OUT=$O ORDER="thread process" timeout 330 bash benchmarks/2026-11-30-h200/link-join/run.sh c1;;
esac
