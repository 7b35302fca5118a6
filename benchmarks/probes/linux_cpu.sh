#!/usr/bin/env bash
# The Linux CPU path on the embedded default: `trio-mlx serve` with OpenBLAS (the default
# with the `cpu` extra: float32 weights) and with TRIO_MLX_CPU_BLAS=reference (the wheel's
# BLAS, 4-bit weights), each measured by `trio-mlx bench --url` at c=1, alternated in ROUNDS.
#
#   benchmarks/probes/linux_cpu.sh OUTDIR
#
# Knobs: ROUNDS=1 PROMPT_TOKENS=128 MAX_TOKENS=64 REQUESTS=4 REF_REQUESTS=2 PORT=8831
#        PYTHON=python3 SIDES="openblas reference". Prints, per run, prompt processing
# (prompt tokens / TTFT p50) and decode (1000 / TPOT p50) in tok/s, with the load average;
# OUTDIR/*.json are the bench results, OUTDIR/*.log the servers' logs.
set -euo pipefail
out="${1:?usage: linux_cpu.sh OUTDIR}"
mkdir -p "$out" && out="$(cd "$out" && pwd)"
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py="${PYTHON:-python3}"
port="${PORT:-8831}"
prompt="${PROMPT_TOKENS:-128}"
server_pid=""
trap '[ -n "$server_pid" ] && kill -KILL "$server_pid" 2>/dev/null || true' EXIT
for round in $(seq 1 "${ROUNDS:-1}"); do
  for side in ${SIDES:-openblas reference}; do
    n="${REQUESTS:-4}"; [ "$side" = reference ] && n="${REF_REQUESTS:-2}"
    TRIO_MLX_CPU_BLAS="$side" "$py" -m trio_mlx.cli serve --port "$port" --no-access-log \
      >"$out/$side-$round.log" 2>&1 &
    server_pid=$!
    for _ in $(seq 1 600); do
      grep -q "ready:" "$out/$side-$round.log" 2>/dev/null && break
      kill -0 "$server_pid" 2>/dev/null || { cat "$out/$side-$round.log"; exit 1; }
      sleep 1
    done
    "$py" -m trio_mlx.cli bench --url "http://127.0.0.1:$port" --concurrency 1 \
      --requests-per-level "$n" --prompt-tokens "$prompt" --max-tokens "${MAX_TOKENS:-64}" \
      --warmup 1 --quiet --label "$side" --out "$out/$side-$round.json"
    kill -TERM "$server_pid"; wait "$server_pid" 2>/dev/null || true; server_pid=""
    "$py" - "$out/$side-$round.json" "$prompt" "$side" "$(grep -o 'with [^,]*kernels[^)]*)\|with reference[^)]*)' "$out/$side-$round.log" | head -1)" <<'PY'
import json, os, sys
lv = json.load(open(sys.argv[1]))["levels"][0]
ttft, tpot = lv["ttft_ms"]["p50"], lv["tpot_ms"]["p50"]
print(f"{sys.argv[3]:>9}: prompt {int(sys.argv[2]) / ttft * 1000:6.1f} tok/s  decode {1000 / tpot:5.1f} tok/s"
      f"  ({lv['completed']}/{lv['requests']} ok, load average {os.getloadavg()[0]:.1f}) {sys.argv[4]}")
PY
  done
done
