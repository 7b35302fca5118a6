#!/usr/bin/env bash
# The prompt cache's goals in an agent's shape, in one GPU call: `prompt_cache.sh`'s chat runs
# (trio_mlx with its cache on, off, and mlx_lm.server) in two rounds of opposite orders, each
# trio_mlx server keeping its step and request traces, then `probe_followup.py` on the same model.
#
#   benchmarks/probes/agent_rounds.sh OUTDIR
#
# The shape of benchmarks/2026-11-27-h200/agent-turns/: a ~6.1k-token shared system prompt
# (SYSTEM_WORDS 1300), TURNS (20) turns of USER_WORDS (10) words and 32-token answers, at
# CONVERSATIONS (1,8) conversations at once. Round 1 runs cache on, cache off, mlx_lm.server;
# round 2 the other way round, so the host's drift weighs on every side. Results:
# OUTDIR/round-N/ (prompt_cache.sh's files: chat-*.json, summary.md, the plot, the servers'
# logs, trace-cache-on.tsv[.requests], trace-cache-off.tsv[.requests]) and
# OUTDIR/probe_followup.txt. The model (OUTDIR/round-1/model, ~2.5 GB) and the kernel cache
# (MLX_PTX_CACHE_DIR, OUTDIR/ptx-cache by default) are left there: leave them out of what
# comes back. About 6 minutes on an H100 with a cold kernel cache; other knobs as in
# prompt_cache.sh. On the CPU, to see it run: MODEL_SHAPE=tiny DTYPE=float32 SYSTEM_WORDS=30
# TURNS=2 CONVERSATIONS=1 PROMPT_CACHE_GB=0.1 benchmarks/probes/agent_rounds.sh /tmp/ar
set -euo pipefail
out="${1:?usage: agent_rounds.sh OUTDIR}"
mkdir -p "$out" && out="$(cd "$out" && pwd)"
here="$(cd "$(dirname "$0")" && pwd)"
export PYTHONPATH="$(cd "$here/../.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
export SYSTEM_WORDS="${SYSTEM_WORDS:-1300}" USER_WORDS="${USER_WORDS:-10}" TURNS="${TURNS:-20}"
export CONVERSATIONS="${CONVERSATIONS:-1,8}" MLX_PTX_CACHE_DIR="${MLX_PTX_CACHE_DIR:-$out/ptx-cache}"

side() {  # ROUND SIDE: one side of one round into OUTDIR/round-ROUND
  local dir="$out/round-$1"
  mkdir -p "$dir"
  [ "$1" = 1 ] || [ -e "$dir/model" ] || ln -s ../round-1/model "$dir/model"
  case "$2" in
    on) TRIO_MLX_STEP_TRACE="$dir/trace-cache-on.tsv" bash "$here/prompt_cache.sh" "$dir" trio-on ;;
    off) TRIO_MLX_STEP_TRACE="$dir/trace-cache-off.tsv" bash "$here/prompt_cache.sh" "$dir" trio-off ;;
    mlx) bash "$here/prompt_cache.sh" "$dir" mlx-chat ;;
  esac >"$dir/console-$2.txt" 2>&1 || echo "(round $1, $2: exit $?)" >&2
}

for s in on off mlx; do side 1 "$s"; done
for s in mlx off on; do side 2 "$s"; done
(cd "$here" && "${PYTHON:-python3}" probe_followup.py "$out/round-1/model") >"$out/probe_followup.txt" 2>&1 \
  || echo "(probe_followup: exit $?)" >&2
for r in 1 2; do printf '\n# round %s\n\n' "$r"; cat "$out/round-$r/summary.md"; done
cat "$out/probe_followup.txt"
