"""Keep Python's cyclic garbage collector off what a server loads at startup.

A served model's process holds hundreds of thousands of objects that live as long as it does
(the tokenizer and its vocabulary, transformers' and mlx-lm's modules, the model's modules, the
chat template). CPython's oldest-generation collection walks every one of them, holding the
GIL: on a GPU host serving a 1B model, collections of hundreds of ms on the actor's thread and
the event loop's, during serving, each a stall of every stream and of every request's intake
(BENCHMARKS.md, "What the runtime does because of a measurement"). `gc.freeze()` moves the objects alive at that moment into a
permanent generation that collections skip, so later ones walk only what serving made since
(vLLM's `freeze_gc_heap`, in `vllm/utils/gc_utils.py`, does the same after its warm-up, and
SGLang offers a `freeze_gc` call).

Frozen objects are never collected as cycles: whatever tears a model down (an actor's end or
restart) thaws the heap first (`thaw`), so that its cycles go with it.
"""

from __future__ import annotations

import gc

# False: nothing is frozen or thawed. For a process that opens engine after engine (the test
# suite: ~90 ms of full collection at each of hundreds of starts, a quarter of some files' time,
# on the CPU dev box), not for a server, which starts once.
enabled = True


def freeze() -> None:
    """Collect what is garbage now, then freeze every object still alive out of later
    collections (startup is over: the model is loaded and warm)."""
    if enabled:
        gc.collect()
        gc.freeze()


def freeze_counted() -> int:
    """`freeze`, then the count of frozen objects (the public `trio_mlx.engine.freeze_heap`).

    The count is a walk of every frozen object (`gc.get_freeze_count` counts a linked list):
    ~30 ms for a served model's ~300k objects, so the runtime's own freezes, which never read it,
    call `freeze`."""
    freeze()
    return gc.get_freeze_count()


def thaw() -> None:
    """Put the frozen objects back into the collector's care (before a model is dropped)."""
    if enabled:
        gc.unfreeze()
