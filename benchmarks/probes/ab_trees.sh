#!/usr/bin/env bash
# Two source trees of trio_mlx side by side on the prompt cache's loads, in one GPU call: a base
# tree (an export of an earlier commit) and this one, each serving with its own code.
#
#   git archive BASE trio_mlx benchmarks/probes pyproject.toml | tar -x -C .base   # here
#   benchmarks/probes/ab_trees.sh .base OUTDIR                                     # there
#
# Chat (`prompt_cache.sh ... trio-on`, the cache on; the agent shape of agent_rounds.sh: 1,300
# system words, TURNS 20 turns of 10 words, CONVERSATIONS 1,8) in the order base, new, new,
# base; then distinct prompts (`prompt_cache.sh ... distinct`, ROUNDS=1: cache on, then off,
# at DISTINCT_CONCURRENCY) in the order base, new. RUNS sets other runs and orders: words
# NAME:N:WHAT (NAME base or new, WHAT a prompt_cache.sh mode), e.g. "new:4:distinct base:4:distinct".
# Each run lands in OUTDIR/NAME-N/ with its step trace (a distinct run's two servers append to
# one file, each after a header line); OUTDIR/summary.md puts the figures side by side, in the
# order run. The model is built once,
# at OUTDIR/model: leave it and the kernel cache (MLX_PTX_CACHE_DIR, OUTDIR/ptx-cache by
# default) out of what comes back. About 7 minutes on an H100 with a cold kernel cache.
set -euo pipefail
base="$(cd "${1:?usage: ab_trees.sh BASE_TREE OUTDIR}" && pwd)"
out="${2:?usage: ab_trees.sh BASE_TREE OUTDIR}"
mkdir -p "$out" && out="$(cd "$out" && pwd)"
new="$(cd "$(dirname "$0")/../.." && pwd)"
export SYSTEM_WORDS="${SYSTEM_WORDS:-1300}" USER_WORDS="${USER_WORDS:-10}" TURNS="${TURNS:-20}"
export CONVERSATIONS="${CONVERSATIONS:-1,8}" MLX_PTX_CACHE_DIR="${MLX_PTX_CACHE_DIR:-$out/ptx-cache}"

run() {  # NAME N WHAT: one prompt_cache.sh run of tree NAME into OUTDIR/NAME-N
  local tree dir="$out/$1-$2"
  [ "$1" = base ] && tree="$base" || tree="$new"
  mkdir -p "$dir"
  [ -e "$out/model" ] && ln -sfn "$out/model" "$dir/model"
  TRIO_MLX_STEP_TRACE="$dir/trace-$3.tsv" ROUNDS=1 bash "$tree/benchmarks/probes/prompt_cache.sh" "$dir" "$3" \
    >"$dir/console-$3.txt" 2>&1 || echo "($1-$2 $3: exit $?)" >&2
  [ -e "$out/model" ] || mv "$dir/model" "$out/model"
}

for r in ${RUNS:-base:1:trio-on new:1:trio-on new:2:trio-on base:2:trio-on base:3:distinct new:3:distinct}; do
  IFS=: read -r name n what <<<"$r"
  run "$name" "$n" "$what"
done
"${PYTHON:-python3}" - "$out" <<'EOF' | tee "$out/summary.md"
import glob, json, os, statistics, sys
out = sys.argv[1]
names = [os.path.basename(os.path.dirname(p)) for p in sorted(glob.glob(os.path.join(out, "*-*", "cache-*.log")), key=os.path.getmtime)]
names = list(dict.fromkeys(names))  # in the order run
print("## Chat, the cache on: TTFT p50 ms (last turn; median over turns 2 to the last; fresh)\n")
print("| run | conversations | last turn | turns 2- | fresh | last / fresh | tok/s | errors |")
print("|---|---|---|---|---|---|---|---|")
for name in names:
    path = os.path.join(out, name, "chat-cache-on.json")
    if not os.path.exists(path):
        continue
    for lv in json.load(open(path))["levels"]:
        p50 = [t["ttft_ms"]["p50"] for t in lv["turns"]]
        turns, fresh = p50[:-1], p50[-1]  # the last row is the fresh requests'
        print(f"| {name} | {lv['conversations']} | {turns[-1]:.0f} | {statistics.median(turns[1:]):.0f} | {fresh:.0f} |"
              f" {turns[-1] / fresh:.2f} | {lv['output_throughput']:.0f} | {lv['errors']['total']} |")
print("\n## Distinct prompts: output tok/s\n\n| run | concurrency | cache on | cache off |\n|---|---|---|---|")
for name in names:
    tps = {}
    for side in ("cache-on", "cache-off"):
        path = os.path.join(out, name, f"distinct-{side}-1.json")
        for lv in json.load(open(path))["levels"] if os.path.exists(path) else []:
            tps.setdefault(lv["concurrency"], {})[side] = f"{lv['output_throughput']:.0f}"
    for c, row in sorted(tps.items()):
        print(f"| {name} | {c} | {row.get('cache-on', '-')} | {row.get('cache-off', '-')} |")
EOF
