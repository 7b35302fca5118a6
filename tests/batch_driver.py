"""Drive mlx-lm's BatchGenerator directly with per-row grammar processors, as the actor will.

`run_rows` inserts rows (all at once, or some after the batch has started
decoding), steps until every row has finished and returns each row's tokens,
text and processor. Free rows get no processor and stop only at max_tokens
(the random test models never sample EOS by chance).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_sampler

from trio_mlx.actor._constrain import GrammarProcessor
from trio_mlx.actor._matcher import grammar_vocab


@dataclass
class Row:
    prompt: list[int]
    max_tokens: int
    grammar: str | None = None  # an engine Grammar's source
    temperature: float = 0.0
    late: bool = False  # inserted after the others have decoded a few steps
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    processor: GrammarProcessor | None = None

    def text(self, tokenizer: Any) -> str:
        ids = [t for t in self.tokens if t not in tokenizer.eos_token_ids]
        return str(tokenizer.decode(ids))


def run_rows(model: Any, tokenizer: Any, rows: list[Row], *, late_after: int = 3) -> list[Row]:
    vocab = grammar_vocab(tokenizer)
    bg = BatchGenerator(model, stop_tokens=[[t] for t in tokenizer.eos_token_ids])
    by_uid: dict[int, Row] = {}

    def insert(batch: list[Row]) -> None:
        if not batch:
            return
        for r in batch:
            r.processor = GrammarProcessor(vocab, r.grammar, r.max_tokens) if r.grammar else None
        uids = bg.insert(
            [r.prompt for r in batch],
            max_tokens=[r.max_tokens for r in batch],
            samplers=[make_sampler(r.temperature) if r.temperature else None for r in batch],
            logits_processors=[[r.processor] if r.processor else [] for r in batch],
        )
        by_uid.update(zip(uids, batch, strict=True))

    try:
        insert([r for r in rows if not r.late])
        steps = 0
        while any(r.finish_reason is None for r in rows):
            if steps == late_after:
                insert([r for r in rows if r.late])
            _, generated = bg.next()
            for resp in generated:
                row = by_uid[resp.uid]
                row.tokens.append(resp.token)
                if resp.finish_reason is not None:
                    row.finish_reason = resp.finish_reason
            steps += 1
            assert steps < 10_000, "the batch never ran dry"
    finally:
        bg.close()
    return rows
