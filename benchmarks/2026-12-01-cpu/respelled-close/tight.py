"""Rows held to the array schema (60 strings of at most 12 characters) under a tight budget:
whether each one's output parses and ends with EOS within max_tokens.

    PYTHONPATH=. python benchmarks/2026-12-01-cpu/respelled-close/tight.py TOKENIZER_DIR MAX_TOKENS [ROWS]

TOKENIZER_DIR as `probe_grammar_host.py --tokenizer` takes it (a tokenizer with its
config.json). Each row's next token is drawn at random from its mask (the probe's `any`),
the rows stepped together through `Decoder._masks` as the decode step fills them. Prints
the first few failing rows and the count."""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "probes"))
import probe_grammar_host as probe  # noqa: E402

from trio_mlx.actor import _decode  # noqa: E402
from trio_mlx.actor._matcher import grammar_vocab  # noqa: E402
from trio_mlx.engine import _grammar  # noqa: E402


def main() -> None:
    tok = probe.tokenizer(pathlib.Path(sys.argv[1]))
    budget, count = int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 16
    vocab = grammar_vocab(tok)
    schema = probe.SCHEMAS["array"]
    g = _grammar.compile_response_format(tok, {"type": "json_schema", "json_schema": {"schema": schema}})
    assert g is not None
    print(f"least max_tokens the engine takes: {g.min_tokens}")
    rng = np.random.default_rng(0)
    rows = [probe.Row(vocab, g.source, budget) for _ in range(count)]
    eos = set(vocab.eos)
    dec, live, fed = _decode.Decoder(), list(rows), None
    while live:
        plan = dec._plan_for([r.row for r in live], probe.VOCAB)
        dec._masks(plan, fed)
        assert plan.bitmask is not None
        words = plan.bitmask.view(np.uint32)
        going = []
        for j, r in enumerate(live):
            ids = np.flatnonzero(np.unpackbits(words[j].view(np.uint8), bitorder="little"))
            t = int(ids[rng.integers(len(ids))])
            r.tokens.append(t)
            if t not in eos and len(r.tokens) < budget:
                going.append(r)
        live, fed = going, [r.tokens[-1] for r in going]
    bad = 0
    for i, r in enumerate(rows):
        body = r.tokens[:-1] if r.tokens[-1] in eos else r.tokens
        text = vocab.tokenizer.decode_bytes(body).decode("utf-8", "replace")
        try:
            json.loads(text)
            ok = r.tokens[-1] in eos
        except ValueError:
            ok = False
        if not ok:
            bad += 1
            if bad <= 3:
                print(f"row {i}: {len(r.tokens)} tokens, forced {r.proc.forced_finish}, ends {text[-40:]!r}")
    print(f"rows whose output does not parse: {bad} of {count}")


if __name__ == "__main__":
    main()
