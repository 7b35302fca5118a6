# A lone user's time to first token on this 2-core CPU: the tree before (OLD, a worktree: `git worktree
# add /tmp/wt_head da48cb4`) against this one, the engine in-process with the thread actor, at c=1:
#   TAG=tiny bash run.sh                     the tiny fp32 test model, 40 requests of 64 prompt tokens, 16 out
#   MODEL=<the embedded model's MLX dir> TAG=smol N=10 TOK=4 ROUNDS="1 2" bash run.sh
#                                            SmolLM2-135M-Instruct (`trio_mlx.models.ensure_embedded_model()`)
# Rounds ROUNDS (default 1 2 3), each in the order ORDER (default old new). Output: one line a run.
cd "$(dirname "$0")/../../.."
HERE=$PWD M=${MODEL:-/tmp/tinyfp32/model}
for r in ${ROUNDS:-1 2 3}; do
  for t in ${ORDER:-old new}; do
    d=$HERE; [ "$t" = old ] && d=${OLD:-/tmp/wt_head}
    (cd "$d" && "$HERE/.venv/bin/python" -m trio_mlx.cli bench --engine --actor thread --model "$M" --concurrency 1 \
      --requests-per-level "${N:-40}" --max-tokens "${TOK:-16}" --prompt-tokens "${PT:-64}" --quiet \
      --out "/tmp/tt-$TAG-$t-$r.json" > "/tmp/tt-$TAG-$t-$r.log" 2>&1)
    python3 -c "
import json; L=json.load(open('/tmp/tt-$TAG-$t-$r.json'))['levels'][0]; print('$TAG $t $r', round(L['output_throughput'],1), 'ttft p50', round(L['ttft_ms']['p50'],2), 'p90', round(L['ttft_ms']['p90'],2), 'tpot', round(L['tpot_ms']['p50'],2), 'done', L['completed'])"
  done
done
