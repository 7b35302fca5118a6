# (run from the repository root with PYTHONPATH=$PWD on the device; $OUT: where the results go)
set -u
[ -d /tmp/m1b ] || python3 -m trio_mlx.cli model build --shape llama-3.2-1b --dtype bfloat16 /tmp/m1b > /dev/null 2>&1
python3 benchmarks/2026-11-29-h200/random-prompts-ngram/f-mask/maskprobe.py /tmp/m1b 2>&1 | tee $OUT/maskprobe.txt
