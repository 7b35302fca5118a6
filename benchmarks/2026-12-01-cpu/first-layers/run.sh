# The table of README.md, from the repository root on this project's CPU machine (after
# `bash scripts/serve.sh` or the test suite has converted the embedded model once).
S=$(ls -d ~/.cache/trio_mlx/smollm2-135m-instruct-* | head -1)
for n in 25 20 15; do
  PYTHONPATH=. python3 benchmarks/2026-12-01-cpu/first-layers/first_layers.py "$S" $n /tmp/smol-l$n
  PYTHONPATH=. python3 benchmarks/probes/draft_agreement.py --target "$S" --draft /tmp/smol-l$n --mode forced \
    --k 3,4 --prompts 6 --max-tokens 96 --show 0 2>&1 | grep -v Warning | tail -1
done
