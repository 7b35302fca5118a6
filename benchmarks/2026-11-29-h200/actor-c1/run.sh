# one user: the thread actor against the process actor, each paired request by request with the bare forward (1B bf16), ABBA
set -u
P() { echo "$@" | tee -a $OUT/progress.txt; }
S() { python3 .gpuwork/summ.py "$@"; }
up() { for t in $(seq 240); do curl -sf localhost:$1/v1/models > /dev/null && return; sleep 1; done; P "port $1 never came up"; }
[ -d /tmp/m1b ] || python3 -m trio_mlx.cli model build --shape llama-3.2-1b --dtype bfloat16 /tmp/m1b > /dev/null 2>&1
n=0
for a in thread process process thread; do
  n=$((n+1))
  python3 -m trio_mlx.cli serve --model /tmp/m1b --port 8091 --actor $a > $OUT/serve-$n-$a.log 2>&1 & SP=$!
  up 8091
  python3 -m trio_mlx.cli bench --url http://127.0.0.1:8091 --model /tmp/m1b --paired $OUT/c1-$n-$a-ceil.json --ceiling bare --concurrency 1 --requests-per-level 12 --paired-rounds 6 --max-tokens 256 --prompt-tokens 128 --quiet --out $OUT/c1-$n-$a.json > /dev/null 2>&1
  P "$n $a $(date +%T)"; P "$(S $OUT/c1-$n-$a.json $OUT/c1-$n-$a-ceil.json)"
  kill $SP; wait $SP 2>/dev/null
done
cd $OUT && tar czf runs.tgz c1-*.json serve-*.log && rm -f c1-*.json serve-*.log
