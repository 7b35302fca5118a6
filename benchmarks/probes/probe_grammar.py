"""Probe: what grammar masking costs a shared batch, by the share of constrained rows.

    python benchmarks/probes/probe_grammar.py MODEL_DIR [BATCH] [STEPS] [ROUNDS]

Decodes BATCH rows for STEPS steps with mlx-lm's BatchGenerator, with 0%,
50% and 100% of the rows constrained by `actor/_constrain.GrammarProcessor`
(a JSON string that may not end before the run does: the mask of a long
string, where most tokens are allowed, every step), alternating the three in
ROUNDS rounds because the host's speed drifts. Prints decode tokens/s per
round and the median ratio to 0%. Run it with a random-weight model
(`trio-mlx model build DIR --shape llama-3.2-1b --dtype bfloat16`), whose free
rows never sample EOS.
"""

import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from trio_mlx.actor._constrain import GrammarProcessor
from trio_mlx.actor._matcher import grammar_vocab
from trio_mlx.engine._grammar import compile_json_schema
from trio_mlx.models import load_model, load_tokenizer

path = sys.argv[1]
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 32
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 128
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 3
model, _ = load_model(path)
tokenizer = load_tokenizer(path)
t0 = time.perf_counter()
vocab = grammar_vocab(tokenizer)
print(f"grammar vocab: {vocab.size} tokens, built in {time.perf_counter() - t0:.2f} s")
grammar = compile_json_schema(tokenizer, {"type": "string", "minLength": 100_000})
prompt = tokenizer.encode("Write a long JSON string about the weather in the mountains.")
shares = (0.0, 0.5, 1.0)


def run(share: float) -> float:
    """Decode tokens/s over `steps` steps after the prefill, `share` of the rows constrained."""
    constrained = round(batch * share)
    bg = BatchGenerator(model, completion_batch_size=batch, prefill_batch_size=batch)
    processors = [
        [GrammarProcessor(vocab, grammar.source, steps + 8)] if i < constrained else []
        for i in range(batch)
    ]
    bg.insert([prompt] * batch, max_tokens=[steps + 8] * batch, logits_processors=processors)
    while not bg.next()[1]:  # prefill
        pass
    mx.synchronize()
    start, tokens = time.perf_counter(), 0
    for _ in range(steps):
        tokens += len(bg.next()[1])
    mx.synchronize()
    elapsed = time.perf_counter() - start
    bg.close()
    return tokens / elapsed


run(1.0)  # warm-up: kernels for every shape and path
results: dict[float, list[float]] = {s: [] for s in shares}
for r in range(rounds):
    for share in shares if r % 2 == 0 else reversed(shares):
        results[share].append(run(share))
    print(f"round {r + 1}: " + ", ".join(f"{int(s * 100)}%: {results[s][-1]:.0f} tok/s" for s in shares))
base = statistics.median(results[0.0])
for s in shares:
    med = statistics.median(results[s])
    print(f"{int(s * 100):3d}% constrained: median {med:.0f} tok/s, {med / base:.2f}x of free "
          f"(batch {batch}, {steps} steps, {mx.default_device()})")
