# Off against prompt lookup at four users, the code before (BEFORE: a tree of trio_mlx) and
# after (AFTER), in alternating order. usage: bash run.sh OUT MODEL PROMPT_TOKENS LEVELS REQUESTS ROUNDS
# The model: a random llama of 4 layers, hidden 256, vocabulary 2048, float32:
#   python -c "from trio_mlx.models import _models as m; m._SHAPES['small'] = dict(hidden_size=256,
#     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
#     vocab_size=2048, rope_theta=10000.0, max_position_embeddings=2048);
#     m.build_test_model('/tmp/ttft-small', shape='small', dtype='float32')"
out=$1; mkdir -p "$out"; cd /tmp
for r in $(seq 1 "$6"); do
  if [ $((r % 2)) = 1 ]; then order="before:off after:off before:ngram after:ngram"; else order="after:ngram before:ngram after:off before:off"; fi
  for cfg in $order; do
    code=${cfg%%:*}; m=${cfg##*:}
    if [ "$code" = before ]; then export PYTHONPATH=$BEFORE; else export PYTHONPATH=$AFTER; fi
    if [ "$m" = ngram ]; then export TRIO_MLX_SPECULATIVE=ngram; else unset TRIO_MLX_SPECULATIVE; fi
    trio-mlx bench --engine --model "$2" --concurrency "$4" --requests-per-level "$5" --max-tokens 128 \
      --prompt-tokens "$3" --quiet --out "$out/r$r-$code-$m.json" > /dev/null 2>&1
  done
done
