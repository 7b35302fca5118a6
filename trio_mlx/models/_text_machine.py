"""mlx-lm's text state machine for a model's tokenizer: where its tool calls and reasoning are.

mlx-lm splits generated text into "normal", "reasoning" and "tool" stretches
with a small automaton over the tokenizer's own markers (`tool_call_start` /
`tool_call_end`, `think_start` / `think_end`), matched on text, not token
ids. It lives in `mlx_lm.generate`, which imports mlx.core, so it is reached
through this package (the one besides `actor/` that touches mlx_lm);
`engine/_tools.ToolCallStream` drives it.
"""

from __future__ import annotations

from typing import Any


def text_state_machine(tokenizer: Any) -> Any:
    """mlx-lm's TextStateMachine for `tokenizer` (an mlx-lm TokenizerWrapper), as
    mlx_lm.server builds it, without stop words: the engine cuts those itself.
    Use its `make_state(initial)`, and its static `split(state, text)` and `flush(state)`."""
    from mlx_lm.generate import make_text_state_machine

    return make_text_state_machine(tokenizer)
