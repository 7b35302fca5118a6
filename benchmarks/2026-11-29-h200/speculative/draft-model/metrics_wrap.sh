#!/usr/bin/env bash
# metrics_wrap.sh PORT FILE CMD...: run the server CMD; when stopped (SIGTERM, as `trio-mlx bench
# compare` stops a side), first save its GET /metrics into FILE (the speculative counters of the
# run: draft_tokens_total, accepted_draft_tokens_total), then stop it and wait for it.
port=$1; file=$2; shift 2
"$@" &
child=$!
finish() {
  curl -s --max-time 5 "http://127.0.0.1:$port/metrics" > "$file" 2>/dev/null || true
  kill -TERM "$child" 2>/dev/null
  wait "$child"
  exit 0
}
trap finish TERM INT
wait "$child"
