B="--max-tokens 256 --prompt-tokens 128 --quiet"
mkdir -p /root/.cache/huggingface/hub
S() { python3 .gpuwork/summ.py "$@"; }
up() { for t in $(seq 180); do curl -sf localhost:$1/v1/models > /dev/null && return; sleep 1; done; echo "port $1 never came up"; }
python3 -m trio_mlx.cli model build --shape llama-3.2-1b --dtype bfloat16 /tmp/m1b > /dev/null 2>&1
python3 -m trio_mlx.cli serve --model /tmp/m1b --port 8091 > /tmp/trio1.log 2>&1 & P=$!
up 8091
python3 -m trio_mlx.cli bench --url http://127.0.0.1:8091 --model /tmp/m1b --paired $OUT/t1-ceil.json --ceiling bare --concurrency 1 --requests-per-level 12 --paired-rounds 6 $B --out $OUT/t1.json > /dev/null 2>&1; S $OUT/t1.json $OUT/t1-ceil.json
python3 -m trio_mlx.cli bench --url http://127.0.0.1:8091 --model /tmp/m1b --paired $OUT/t64-ceil.json --concurrency 64 --requests-per-level 256 --paired-rounds 2 --max-tokens 128 --prompt-tokens 128 --quiet --out $OUT/t64.json > /dev/null 2>&1; S $OUT/t64.json $OUT/t64-ceil.json
kill $P; wait $P 2>/dev/null
python3 -m mlx_lm server --model /tmp/m1b --port 8090 > /tmp/mlx1.log 2>&1 & P=$!
up 8090
python3 -m trio_mlx.cli bench --url http://127.0.0.1:8090 --model /tmp/m1b --paired $OUT/m1-ceil.json --ceiling bare --concurrency 1 --requests-per-level 12 --paired-rounds 6 $B --suppress-eos --out $OUT/m1.json > /dev/null 2>&1; S $OUT/m1.json $OUT/m1-ceil.json
kill $P; wait $P 2>/dev/null
python3 -m trio_mlx.cli model build --shape llama-3.1-8b --dtype bfloat16 /tmp/m8b > /dev/null 2>&1
python3 -m trio_mlx.cli serve --model /tmp/m8b --port 8091 > /tmp/trio8.log 2>&1 & P=$!
up 8091
python3 -m trio_mlx.cli bench --url http://127.0.0.1:8091 --model /tmp/m8b --paired $OUT/t8-ceil.json --ceiling bare --concurrency 1 --requests-per-level 8 --paired-rounds 4 $B --out $OUT/t8.json > /dev/null 2>&1; S $OUT/t8.json $OUT/t8-ceil.json
kill $P; wait $P 2>/dev/null
