"""Probe (CPU): the budget checks' llguidance work on the states a constrained batch meets, this tree's
`_matcher` against another tree's.

    PYTHONPATH=. python benchmarks/probes/probe_budget_checks.py --base /tmp/base [--rows 64]
        [--max-tokens 512] [--schema array] [--tokenizer DIR] [--cases N] [--rounds 10] [--seed 0]

One episode of `probe_grammar_host.py` (no model, no device: each row's next token drawn at random
from its mask) records, at each budget check whose completion is no longer known to complete the
grammar, a copy of the row's matcher and that completion (every such check, or the first `--cases`): the case the check then answers with
`completes`, else `resumes`, else `finish` (with the old completion as its hint), as
`GrammarProcessor._measure` does. The cases are then answered in rounds by this tree's functions
and by those of the tree at `--base` (a directory holding a `trio_mlx`, e.g. `git archive BASE
trio_mlx | tar -x -C /tmp/base`), the order alternating, one thread, nothing else running: us a
case, and a digest of the answers, which must be the same for both (the probe fails otherwise).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import pathlib
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import probe_grammar_host as host  # noqa: E402

from trio_mlx.actor import _constrain, _matcher  # noqa: E402
from trio_mlx.actor._matcher import grammar_vocab  # noqa: E402
from trio_mlx.engine import _grammar  # noqa: E402


def load_base(root: str) -> Any:
    """The `_matcher` module of the tree at `root`, under a name of its own."""
    path = pathlib.Path(root) / "trio_mlx" / "actor" / "_matcher.py"
    spec = importlib.util.spec_from_file_location("base_matcher", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["base_matcher"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def answer(mod: Any, cases: list[tuple[Any, list[int]]], vocab: Any) -> tuple[float, str]:
    """Seconds for all cases, and a digest of the answers."""
    digest = hashlib.sha256()
    t0 = time.perf_counter()
    for m, tail in cases:
        if mod.completes(m, vocab, tail):
            found: list[int] | None = tail
        else:
            found = mod.resumes(m, vocab, tail)
            if found is None:
                found = mod.finish(m, vocab, hint=tail)
        digest.update(repr(found).encode())
    return time.perf_counter() - t0, digest.hexdigest()[:12]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--schema", default="array")
    ap.add_argument("--tokenizer", default="/tmp/tok128k")
    ap.add_argument("--cases", type=int, default=0)  # 0: every case of the episode
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.pick = "any"
    tok = host.tokenizer(pathlib.Path(args.tokenizer))
    vocab = grammar_vocab(tok)
    g = _grammar.compile_response_format(tok, {"type": "json_schema", "json_schema": {"schema": host.SCHEMAS[args.schema]}})
    assert g is not None
    cases: list[tuple[Any, list[int]]] = []
    measure = _constrain.GrammarProcessor._measure

    def recorded(self: Any, m: Any, left: int) -> None:
        # past each row's first check, whose completion from the grammar's start is kept per text
        if self._calls and not self._tail_checked and (not args.cases or len(cases) < args.cases):
            cases.append((m.deep_copy(), list(self._tail)))
        measure(self, m, left)

    _constrain.GrammarProcessor._measure = recorded  # type: ignore[method-assign]
    host.episode(vocab, g.source, args, args.seed)
    _constrain.GrammarProcessor._measure = measure  # type: ignore[method-assign]
    print(f"{len(cases)} cases from one episode of {args.rows} rows ({args.schema}, {args.max_tokens} tokens)")
    trees = {"base": load_base(args.base), "this": _matcher}
    times: dict[str, list[float]] = {name: [] for name in trees}
    digests: set[str] = set()
    for r in range(args.rounds):
        for name in (trees if r % 2 == 0 else reversed(list(trees))):
            seconds, digest = answer(trees[name], cases, vocab)
            times[name].append(seconds / len(cases) * 1e6)
            digests.add(digest)
    for name, us in times.items():
        print(f"{name}: {statistics.median(us):.1f} us a case (median of {len(us)} rounds; "
              + " ".join(f"{x:.1f}" for x in us) + ")")
    print(f"answers' digest: {' '.join(sorted(digests))}")
    if len(digests) != 1:
        raise SystemExit("the two trees answered differently")


if __name__ == "__main__":
    main()
