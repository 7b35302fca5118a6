# A lone user's time to first token on this 2-core CPU: the tree before (OLD, a worktree: `git worktree
# add /tmp/wt_head 044b116`) against this one, the engine in-process with the thread actor, the tiny
# fp32 model (MODEL), 40 requests of 64 prompt tokens and 16 output tokens a round; rounds ROUNDS in the
# order ORDER (results.txt: rounds 1-3 old new, 4-6 new old).
cd "$(dirname "$0")/../../.."
HERE=$PWD
for r in ${ROUNDS:-1 2 3}; do
  for t in ${ORDER:-old new}; do
    d=$HERE; [ $t = old ] && d=${OLD:-/tmp/wt_head}
    (cd $d && "$HERE/.venv/bin/python" -m trio_mlx.cli bench --engine --actor thread --model "${MODEL:-/tmp/tinyfp32/model}" --concurrency 1 --requests-per-level 40 --max-tokens 16 --prompt-tokens 64 --quiet --out /tmp/ttft-$t-$r.json > /tmp/ttft-$t-$r.log 2>&1)
    python3 -c "
import json; L=json.load(open('/tmp/ttft-$t-$r.json'))['levels'][0]; print('$t $r', round(L['output_throughput'],1), 'ttft p50', round(L['ttft_ms']['p50'],2), 'p90', round(L['ttft_ms']['p90'],2), 'tpot', round(L['tpot_ms']['p50'],2))"
  done
done
