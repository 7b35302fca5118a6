# the server paired with its ceilings: c=1 (bare), c=64 and c=256 (BatchGenerator), 1B bf16, with the physical limit
set -u
P() { echo "$@" | tee -a $OUT/progress.txt; }
S() { python3 .gpuwork/summ.py "$@"; }
up() { for t in $(seq 240); do curl -sf localhost:$1/v1/models > /dev/null && return; sleep 1; done; P "port $1 never came up"; }
[ -d /tmp/m1b ] || python3 -m trio_mlx.cli model build --shape llama-3.2-1b --dtype bfloat16 /tmp/m1b > /dev/null 2>&1
python3 -m trio_mlx.cli serve --model /tmp/m1b --port 8091 --max-batch 256 > $OUT/serve.log 2>&1 & SP=$!
up 8091; P "== up $(date +%T)"
BW="--bandwidth-gbs 4800"
python3 -m trio_mlx.cli bench --url http://127.0.0.1:8091 --model /tmp/m1b --paired $OUT/t1-ceil.json --ceiling bare --concurrency 1 --requests-per-level 12 --paired-rounds 6 --max-tokens 256 --prompt-tokens 128 $BW --quiet --out $OUT/t1.json > $OUT/t1.log 2>&1; P "$(S $OUT/t1.json $OUT/t1-ceil.json)"
python3 -m trio_mlx.cli bench --url http://127.0.0.1:8091 --model /tmp/m1b --paired $OUT/t64-ceil.json --concurrency 64 --requests-per-level 256 --paired-rounds 2 --max-tokens 128 --prompt-tokens 128 $BW --quiet --out $OUT/t64.json > $OUT/t64.log 2>&1; P "$(S $OUT/t64.json $OUT/t64-ceil.json)"
timeout 200 python3 -m trio_mlx.cli bench --url http://127.0.0.1:8091 --model /tmp/m1b --paired $OUT/t256-ceil.json --concurrency 256 --requests-per-level 1024 --paired-rounds 2 --max-tokens 128 --prompt-tokens 128 $BW --quiet --out $OUT/t256.json > $OUT/t256.log 2>&1; P "$(S $OUT/t256.json $OUT/t256-ceil.json)"
kill $SP; wait $SP 2>/dev/null
python3 -m trio_mlx.cli bench table $OUT/t1.json $OUT/t1-ceil.json $OUT/t64.json $OUT/t64-ceil.json $OUT/t256.json $OUT/t256-ceil.json > $OUT/table.md 2>&1; cat $OUT/table.md | tee -a $OUT/progress.txt
P "== done $(date +%T)"
