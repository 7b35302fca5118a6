# admission: groups of 32 short prompts from 32 decoding rows (today) against from 128, c=64,128,256, 2 rounds
set -u
P() { echo "$@" | tee -a $OUT/progress.txt; }
[ -d /tmp/m1b ] || python3 -m trio_mlx.cli model build --shape llama-3.2-1b --dtype bfloat16 /tmp/m1b > /dev/null 2>&1
M=/tmp/m1b
S="--model $M --port {port} --max-batch 256 --actor thread"
timeout -s INT -k 20 ${TC:-560} python3 -m trio_mlx.cli bench compare --out "$OUT/cmp" --rounds 2 --start-timeout 180 --grace 10 \
  --side "from32=python3 benchmarks/2026-11-29-h200/admission-threshold/adm_serve.py 32 serve $S" \
  --side "from128=python3 benchmarks/2026-11-29-h200/admission-threshold/adm_serve.py 128 serve $S" \
  -- --model $M --requests-multiple 4 --warmup 8 --concurrency 64,128,256 --max-tokens 128 --prompt-tokens 128 --quiet > $OUT/compare.log 2>&1
P "compare exit $?"
cat $OUT/cmp/summary.md | tee -a $OUT/progress.txt
cd $OUT && tar czf runs.tgz cmp 2>/dev/null && rm -rf cmp
