# The decode report held until the next graph is built, and a finished prompt group joining
# the decode forward, measured on one H200 (the stage in /root/gpu-stage as ../auto-rule/README.md
# says, plus SmolLM2's tokenizer files in /root/gpu-stage/smoltok):
#   bash run.sh install   ../graph-cache/run.sh's install (/root/m1b, and /root/m1bs with SmolLM2's tokenizer)
#   bash run.sh c1        one user, thread actor against process actor in the order thread, process,
#                         process, thread (ORDER: another; KIND@TREE serves from TREE, another tree); each server paired request by request with MLX's bare
#                         pipelined forward (../../2026-11-29-h200/actor-c1/run.sh's recipe, 256 tokens)
#   bash run.sh levels    c=1 (bare), c=64 and c=256 (BatchGenerator) paired with one default server
#                         (../../2026-11-29-h200/paired-levels/run.sh's recipe) with a step trace
#   bash run.sh host      probe_grammar_host.py --split at 1, 2, 4, 8 and 12 llguidance pool threads
# Results and progress.txt under $OUT.
set -u
P() { echo "$@" | tee -a "$OUT/progress.txt"; }
S() { python3 benchmarks/2026-11-29-h200/speculative/batched/summ.py "$@"; }
up() { for t in $(seq 240); do curl -sf "localhost:$1/v1/models" > /dev/null && return; sleep 1; done; P "port $1 never came up"; }
M=${M1B:-/root/m1b}
case $1 in
install) bash benchmarks/2026-11-30-h200/graph-cache/run.sh install;;
c1)
  n=0 root=$PWD
  for item in ${ORDER:-thread process process thread}; do  # KIND, or KIND@TREE: the server from TREE
    n=$((n+1)) a=${item%@*} tree=.; [ "$item" != "$a" ] && tree=${item#*@}
    [ "$tree" != . ] && a=$a-$(basename "$tree")
    P "$n $a: $(cd "$tree" && python3 -c 'import trio_mlx, os; print(os.path.realpath(trio_mlx.__file__))')"
    ( cd "$tree" && exec python3 -m trio_mlx.cli serve --model "$M" --port 8091 --actor "${item%@*}" ) \
      > "$OUT/serve-$n-$a.log" 2>&1 & SP=$!
    up 8091
    timeout 150 python3 -m trio_mlx.cli bench --url http://127.0.0.1:8091 --model "$M" --paired "$OUT/c1-$n-$a-ceil.json" \
      --ceiling bare --concurrency 1 --requests-per-level 12 --paired-rounds 6 --max-tokens 256 --prompt-tokens 128 \
      --quiet --out "$OUT/c1-$n-$a.json" > "$OUT/c1-$n-$a.log" 2>&1
    P "$n $a $(date +%T)"; P "$(S "$OUT/c1-$n-$a.json" "$OUT/c1-$n-$a-ceil.json")"
    kill $SP; wait $SP 2>/dev/null
  done;;
levels)
  TRIO_MLX_STEP_TRACE="$OUT/levels.tsv" python3 -m trio_mlx.cli serve --model "$M" --port 8091 --max-batch 256 \
    > "$OUT/serve-levels.log" 2>&1 & SP=$!
  up 8091; P "== up $(date +%T)"
  BW="--bandwidth-gbs 4800"
  B() { timeout "$1" python3 -m trio_mlx.cli bench --url http://127.0.0.1:8091 --model "$M" --paired "$OUT/$2-ceil.json" \
          "${@:3}" --max-tokens 128 --prompt-tokens 128 $BW --quiet --out "$OUT/$2.json" > "$OUT/$2.log" 2>&1
        P "$(S "$OUT/$2.json" "$OUT/$2-ceil.json")"; }
  B 100 t1 --ceiling bare --concurrency 1 --requests-per-level 12 --paired-rounds 6
  B 120 t64 --concurrency 64 --requests-per-level 256 --paired-rounds 2
  B 200 t256 --concurrency 256 --requests-per-level 1024 --paired-rounds 2
  kill $SP; wait $SP 2>/dev/null
  python3 -m trio_mlx.cli bench table "$OUT"/t1.json "$OUT"/t1-ceil.json "$OUT"/t64.json "$OUT"/t64-ceil.json \
    "$OUT"/t256.json "$OUT"/t256-ceil.json > "$OUT/table.md" 2>&1; tee -a "$OUT/progress.txt" < "$OUT/table.md";;
host)
  P "== host: nproc $(nproc), cpu.max $(cat /sys/fs/cgroup/cpu.max 2>/dev/null) $(date +%T)"
  PYTHONPATH=$PWD timeout "${LIMIT:-300}" python3 benchmarks/probes/probe_grammar_host.py --rows 64 --max-tokens 512 \
    --schemas array --split --tokenizer /root/gpu-stage/smoltok --pool-threads 1,2,4,8,12 > "$OUT/host.txt" 2>&1
  tail -40 "$OUT/host.txt" | tee -a "$OUT/progress.txt";;
esac
P "== done $1 $(date +%T)"
