# The same question on this project's CPU machine (2 cores, mlx[cpu]): the tiny random test
# model (the `tiny` shape of `models/_test_models.py`, fp32, at /tmp/tinyfp32/model: `trio-mlx
# model build --shape tiny /tmp/tinyfp32/model`) at 16 users,
# 8 rounds of three engines in rotating order: off, ngram, and ngram with
# speculative_max_rows 1 (`one`). Run from the repository root; JSON and step traces under
# /tmp/c16x (cpu-c16.txt: what the runs gave).
run() { # name env...
  name=$1; shift; r=$1; shift
  env "$@" TRIO_MLX_STEP_TRACE=/tmp/c16x/$name-$r.tsv PYTHONPATH=. timeout 300 python3 -m trio_mlx.cli bench --engine --model /tmp/tinyfp32/model --concurrency 16 --requests-multiple 12 --min-requests 24 --max-tokens 128 --prompt-tokens 128 --quiet --out /tmp/c16x/$name-$r.json > /dev/null 2>&1
}
for r in 1 2 3 4 5 6 7 8; do
  case $((r % 3)) in
    0) order="off ngram one";; 1) order="ngram one off";; 2) order="one off ngram";;
  esac
  for m in $order; do
    case $m in
      off) run off $r X=1;;
      ngram) run ngram $r TRIO_MLX_SPECULATIVE=ngram;;
      one) run one $r TRIO_MLX_SPECULATIVE=ngram TRIO_MLX_SPECULATIVE_MAX_ROWS=1;;
    esac
  done
done
