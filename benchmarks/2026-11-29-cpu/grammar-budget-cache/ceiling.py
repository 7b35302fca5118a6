"""What-if (CPU): how much of the budget checks' host work the single-byte openers' growth is, at most.

    PYTHONPATH=. python benchmarks/2026-11-29-cpu/grammar-budget-cache/ceiling.py [SCHEMA] [ROUNDS] [PICK]

`probe_grammar_host.py`'s episodes (64 rows, max_tokens 256, seed 0; SCHEMA `array` or
`string`, PICK `any` or `low`), alternating two variants: the tree as it is, and one
where `growth` answers 0 for every single-byte opener without validating anything (the
special tokens are still measured). The second is unsound (a row would never go calm
for an opener): it bounds what any saving on the openers (a cache, a carried result,
an analytic bound) could give. Prints per episode the GIL-side CPU per step (the
decode step's thread and the budget checks', whole episode and its first third), the
checks' thread alone, the completions validated per step (`completes` calls, and the
tokens they walk, EOS included: deterministic for a seed, unlike the times), and the
digest of every mask.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "probes"))

import probe_grammar_host as probe  # noqa: E402

from trio_mlx.actor import _constrain, _decode, _matcher  # noqa: E402
from trio_mlx.engine import _grammar  # noqa: E402

WALKED = [0, 0]  # completions validated, tokens they walked
STEP_CHECKS: list[float] = []  # the checks' thread CPU of each step of the episode
_completes, _growth, _masks = _matcher.completes, _constrain.growth, _decode.Decoder._masks


def counted_completes(m: Any, vocab: Any, tokens: Any) -> bool:
    WALKED[0] += 1
    WALKED[1] += len(tokens) + 1
    return _completes(m, vocab, tokens)


def no_openers_growth(m: Any, vocab: Any, tail: list[int], token: int) -> int:
    return 0 if token in vocab.openers else _growth(m, vocab, tail, token)


def timed_masks(self: Any, plan: Any, fed: Any) -> Any:
    before = probe.MEASURE_CPU[0]
    try:
        return _masks(self, plan, fed)
    finally:
        STEP_CHECKS.append(probe.MEASURE_CPU[0] - before)


def main() -> None:
    schema = sys.argv[1] if len(sys.argv) > 1 else "array"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    pick = sys.argv[3] if len(sys.argv) > 3 else "any"
    tok = probe.tokenizer(pathlib.Path("/tmp/tok128k"))
    vocab = _matcher.grammar_vocab(tok)
    g = _grammar.compile_response_format(
        tok, {"type": "json_schema", "json_schema": {"schema": probe.SCHEMAS[schema]}})
    assert g is not None
    if schema == "string":
        probe.STRING_SOURCE[0] = g.source
    args = argparse.Namespace(rows=64, max_tokens=256, pick=pick, seed=0)
    _matcher.completes = _constrain.completes = counted_completes  # type: ignore[assignment]
    _decode.Decoder._masks = timed_masks  # type: ignore[method-assign]
    probe.episode(vocab, g.source, args, 999)  # warm-up: the grammar's start tail is kept
    for _ in range(rounds):
        for variant in ("as-is", "no-openers"):
            _matcher.growth = _constrain.growth = _growth if variant == "as-is" else no_openers_growth  # type: ignore[assignment]
            WALKED[:] = [0, 0]
            STEP_CHECKS.clear()
            o = probe.episode(vocab, g.source, args, 0)
            steps, third = o["steps"], max(1, o["steps"] // 3)
            print(f"{schema} {variant:10s} GIL-side CPU {o['cpu']:.2f} ms/step (first third "
                  f"{o['cpu_thirds'][0]:.2f}), checks' thread {1e3 * sum(STEP_CHECKS) / steps:.2f} "
                  f"(first third {1e3 * sum(STEP_CHECKS[:third]) / third:.2f}), "
                  f"{WALKED[0] / steps:.1f} completions validated/step, {WALKED[1] / steps:.0f} tokens, "
                  f"wall {o['ms']:.2f} ms/step, masks {o['digest']}", flush=True)


if __name__ == "__main__":
    main()
