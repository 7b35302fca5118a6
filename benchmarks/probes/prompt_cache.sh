#!/usr/bin/env bash
# The prompt cache on multi-turn chats: trio_mlx with its cache on, with it off, and
# mlx_lm.server, on the same conversations; then distinct prompts, cache on and off.
#
#   benchmarks/probes/prompt_cache.sh OUTDIR [chat|distinct|distinct-order|both|trio-chat|trio-on|trio-off|mlx-chat]
#
# (chat and distinct can run as two calls into one OUTDIR: the summary reads every result there;
# trio-chat and mlx-chat split chat in two: trio_mlx's sides, then mlx_lm.server's; trio-on and
# trio-off split trio-chat)
# chat:     `trio-mlx bench chat` at CONVERSATIONS (1,8,64) conversations at once, each TURNS (5)
#           turns: a shared system prompt (SYSTEM_WORDS 380: ~1.8k tokens, ~4.7 a random word
#           with the test tokenizer), a new user turn (USER_WORDS 230: ~1.1k tokens) and the
#           whole history resent every turn, the answers (MAX_TOKENS, 32) as they came; the
#           model is built with --spelled-padding, so an answer's text tokenizes back to the ids
#           the model sampled, as a real model's does (but for the few of its tokenizer's own
#           512 that it samples beside 16k spelled ones), and a follow-up's new tokens are its
#           user turn; the last turn holds ~7.5k tokens (the 1B shape allows 8192); then one fresh
#           request per conversation with only a new user turn. Greedy. Servers in this order:
#           trio_mlx cache on, cache off, mlx_lm.server (--decode-concurrency 64, --prompt-cache-size 256: room for every
#           conversation, as trio_mlx's PROMPT_CACHE_GB has).
# distinct-order: distinct prompts only, the servers in DISTINCT_ORDER ("off on on off"), so
#           that the cache off can run first in a call too.
# distinct: `trio-mlx bench` at DISTINCT_CONCURRENCY (64) with random prompts (PROMPT_TOKENS 128,
#           MAX_TOKENS_DISTINCT 128): cache on, off, off, on (ROUNDS=2), the figures that must not
#           move when the cache cannot hit.
# Knobs: MODEL_SHAPE=llama-3.2-1b DTYPE=bfloat16 PROMPT_CACHE_GB=30 PORT=8831 PYTHON=python3,
#        and each size above. Results: OUTDIR/chat-*.json, OUTDIR/distinct-*.json, the servers'
#        logs, OUTDIR/summary.md and OUTDIR/chat-ttft.png (median TTFT per turn, per level).
#        About 7 minutes on an H100 (a first start compiles kernels into MLX_PTX_CACHE_DIR,
#        OUTDIR/ptx-cache by default: add a minute or two).
# On the CPU, to see it run: MODEL_SHAPE=tiny DTYPE=float32 CONVERSATIONS=1,2 TURNS=2
#        SYSTEM_WORDS=30 USER_WORDS=10 MAX_TOKENS=4 DISTINCT_CONCURRENCY=2 PROMPT_TOKENS=16
#        MAX_TOKENS_DISTINCT=8 ROUNDS=1 PROMPT_CACHE_GB=0.1 benchmarks/probes/prompt_cache.sh /tmp/pc
set -euo pipefail
out="${1:?usage: prompt_cache.sh OUTDIR [chat|distinct|distinct-order|both|...]}"
what="${2:-both}"
mkdir -p "$out" && out="$(cd "$out" && pwd)"
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py="${PYTHON:-python3}"
port="${PORT:-8831}"
url="http://127.0.0.1:$port"
dir="$out/model"
[ -d "$dir" ] || "$py" -m trio_mlx.cli model build "$dir" --shape "${MODEL_SHAPE:-llama-3.2-1b}" \
  --dtype "${DTYPE:-bfloat16}" --seed 0 --spelled-padding >/dev/null
export MLX_PTX_CACHE_DIR="${MLX_PTX_CACHE_DIR:-$out/ptx-cache}"
server_pid=""
trap '[ -n "$server_pid" ] && kill -KILL "$server_pid" 2>/dev/null || true' EXIT

start() {  # NAME PROBE COMMAND...: start a server on $port, wait until PROBE answers 200
  local name=$1 probe=$2 i
  shift 2
  "$@" >"$out/$name.log" 2>&1 &
  server_pid=$!
  for ((i = 0; i < 1200; i++)); do
    kill -0 "$server_pid" 2>/dev/null || { echo "$name exited before ready" >&2; tail "$out/$name.log" >&2; return 1; }
    curl -sf -o /dev/null --max-time 2 "$url$probe" && return 0
    sleep 0.5
  done
  return 1
}

stop() {
  kill -TERM "$server_pid" 2>/dev/null || true
  for ((i = 0; i < 60; i++)); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.5; done
  kill -KILL "$server_pid" 2>/dev/null || true
  wait "$server_pid" 2>/dev/null || true
  server_pid=""
}

trio_serve() {  # NAME PROMPT_CACHE_GB
  start "$1" /ready env "TRIO_MLX_PROMPT_CACHE_GB=$2" "$py" -m trio_mlx.cli serve --model "$dir" \
    --port "$port" --max-batch 64 --no-access-log
}

chat() {  # LABEL [ARGS...]
  local label=$1
  shift
  "$py" -m trio_mlx.cli bench chat --url "$url" --conversations "${CONVERSATIONS:-1,8,64}" \
    --turns "${TURNS:-5}" --system-words "${SYSTEM_WORDS:-380}" --user-words "${USER_WORDS:-230}" \
    --max-tokens "${MAX_TOKENS:-32}" --timeout 300 --warmup 2 --label "$label" \
    --out "$out/chat-$label.json" "$@" || echo "($label: exit $?)" >&2
}

distinct() {  # LABEL ROUND
  "$py" -m trio_mlx.cli bench --url "$url" --model "$dir" --concurrency "${DISTINCT_CONCURRENCY:-64}" \
    --prompt-tokens "${PROMPT_TOKENS:-128}" --max-tokens "${MAX_TOKENS_DISTINCT:-128}" --timeout 120 \
    --requests-multiple 4 --warmup 8 --label "$1" --out "$out/distinct-$1-$2.json" --quiet \
    --server-pid "$server_pid" || echo "($1: exit $?)" >&2
}

gb="${PROMPT_CACHE_GB:-30}"
chats=false; distincts=false; ordered=false; trio=true; mlx=false; on=true; off=true
case "$what" in
  chat) chats=true; mlx=true ;;
  distinct) distincts=true ;;
  distinct-order) ordered=true; trio=false ;;
  both) chats=true; mlx=true; distincts=true ;;
  trio-chat) chats=true ;;
  trio-on) chats=true; off=false ;;
  trio-off) chats=true; on=false ;;
  mlx-chat) chats=true; mlx=true; trio=false ;;
  *) echo "unknown: $what" >&2; exit 2 ;;
esac
if $trio && $on; then
  trio_serve cache-on "$gb"
  if $chats; then chat cache-on; fi
  if $distincts; then distinct cache-on 1; fi
  stop
fi
if $trio && $off; then
  trio_serve cache-off 0
  if $chats; then chat cache-off; fi
  if $distincts; then distinct cache-off 1; fi
  stop
fi
if $mlx; then
  # mlx_lm.server loads the model on its first request (the bench's warm-up pays it); the
  # request's "model" must name the directory it was started with
  start mlx_lm /health "$py" -m mlx_lm.server --model "$dir" --host 127.0.0.1 --port "$port" \
    --decode-concurrency 64 --prompt-concurrency 8 --prompt-cache-size 256 --max-tokens 4096
  chat mlx_lm --served-model-name "$dir"
  stop
fi
if $distincts; then
  for ((r = 2; r <= ${ROUNDS:-2}; r++)); do  # the other order, so drift weighs on both sides
    trio_serve "cache-off-$r" 0 && distinct cache-off "$r" && stop
    trio_serve "cache-on-$r" "$gb" && distinct cache-on "$r" && stop
  done
fi
if $ordered; then  # distinct-order: the servers in the order given, e.g. "off on on off"
  declare -A seen=()
  for side in ${DISTINCT_ORDER:-off on on off}; do
    seen[$side]=$((${seen[$side]:-0} + 1))
    gb_side=$gb; [ "$side" = off ] && gb_side=0
    trio_serve "cache-$side-${seen[$side]}" "$gb_side" && distinct "cache-$side" "${seen[$side]}" && stop
  done
fi

"$py" - "$out" <<'EOF' >"$out/summary.md"
import glob, json, os, sys
from collections import defaultdict
out = sys.argv[1]
runs = {}
for side in ("cache-on", "cache-off", "mlx_lm"):
    path = os.path.join(out, f"chat-{side}.json")
    if os.path.exists(path):
        runs[side] = json.load(open(path))
if runs:
    s = next(iter(runs.values()))["settings"]
    print(f"## Multi-turn chat: time to first token per turn, p50 ms (cached tokens)\n")
    print(f"{s['turns']} turns of {s['user_words']} words on a shared {s['system_words']}-word system prompt, "
          f"{s['max_tokens']} tokens an answer, greedy; 'fresh': a new conversation's first request "
          "holding only a user turn.\n")
    sides = list(runs)
    levels = [lv["conversations"] for lv in next(iter(runs.values()))["levels"]]
    for k, n in enumerate(levels):
        print(f"### {n} conversation{'s' if n > 1 else ''} at once\n")
        print("| turn | prompt tokens | " + " | ".join(sides) + " |")
        print("|---|---|" + "---|" * len(sides))
        turns = runs[sides[0]]["levels"][k]["turns"]
        for j, t in enumerate(turns):
            cells = []
            for side in sides:
                tt = runs[side]["levels"][k]["turns"][j]
                p50, cached = tt["ttft_ms"]["p50"], tt["cached_tokens"]
                cells.append("-" if p50 is None else f"{p50:,.0f}" + ("" if cached is None else f" ({cached:,.0f})"))
            prompt = t["prompt_tokens"]
            print(f"| {t['turn']} | {'-' if prompt is None else f'{prompt:,.0f}'} | " + " | ".join(cells) + " |")
        print()
        rows = []
        for side in sides:
            lv = runs[side]["levels"][k]
            r = lv["last_vs_fresh"]
            rows.append(f"{side}: {lv['output_throughput']:,.0f} tok/s, {lv['errors']['total']} errors"
                        + (f", last turn / fresh {r:.2f}x" if r else ""))
        print("; ".join(rows) + "\n")
        last = {side: runs[side]["levels"][k]["turns"][len(turns) - 2]["ttft_ms"]["p50"] for side in sides}
        if last.get("cache-on"):
            for other in ("cache-off", "mlx_lm"):
                if last.get(other):
                    print(f"- last turn's TTFT, {other} / cache on: {last[other] / last['cache-on']:.2f}x")
            print()
tps = defaultdict(list)
for path in sorted(glob.glob(os.path.join(out, "distinct-*.json"))):
    side = os.path.basename(path)[len("distinct-"):-5].rsplit("-", 1)[0]
    for lv in json.load(open(path))["levels"]:
        tps[(side, lv["concurrency"])].append(lv["output_throughput"])
if tps:
    print("## Distinct prompts (no hit possible): output tok/s per round\n")
    print("| concurrency | cache on | cache off | on / off |")
    print("|---|---|---|---|")
    for c in sorted({c for _, c in tps}):
        on, off = tps[("cache-on", c)], tps[("cache-off", c)]
        ratio = sum(on) / sum(off) if on and off and sum(off) else float("nan")
        print(f"| {c} | {' / '.join(f'{x:,.0f}' for x in on)} | {' / '.join(f'{x:,.0f}' for x in off)} | {ratio:.3f} |")
EOF
charts=()
for side in cache-on cache-off mlx_lm; do [ -f "$out/chat-$side.json" ] && charts+=("$out/chat-$side.json"); done
if [ ${#charts[@]} -gt 0 ]; then
  "$py" -m trio_mlx.cli bench chat plot "${charts[@]}" -o "$out/chat-ttft.png" >/dev/null \
    && printf '\n![TTFT per turn](chat-ttft.png)\n' >>"$out/summary.md" || echo "(no plot)" >&2
fi
cat "$out/summary.md"
