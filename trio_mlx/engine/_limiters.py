"""Capacity limiters that live as long as one trio run: the GPU actor's thread, the tokenizer
lanes and the grammar drafts each have one, shared by every engine of that run and made at
first use (a `RunVar`: a limiter belongs to the run whose tasks wait on it)."""

from __future__ import annotations

from collections.abc import Callable

import trio
from trio.lowlevel import RunVar

from .._cpus import usable_cpus


def half_the_cores() -> int:
    """Half the CPUs this process may use (`_cpus.usable_cpus`: a container's quota counts),
    at least 1."""
    return max(1, usable_cpus() // 2)


class RunLimiter:
    """`limiter()`: this run's `trio.CapacityLimiter` of `tokens()` tokens."""

    def __init__(self, name: str, tokens: Callable[[], int]):
        self._var: RunVar[trio.CapacityLimiter] = RunVar(name)
        self._tokens = tokens

    def __call__(self) -> trio.CapacityLimiter:
        try:
            return self._var.get()
        except LookupError:
            self._var.set(limiter := trio.CapacityLimiter(self._tokens()))
            return limiter
