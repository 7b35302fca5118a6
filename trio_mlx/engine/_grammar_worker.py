"""A grammar worker process (`_grammar_pool.py` starts it): checks grammars it is sent, one at a time.

Kept out of the engine's package imports, so that `python -m` runs it as the main module.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from .._errors import InvalidRequestError
from ._grammar_pool import _read, _write


def _address_space() -> int | None:
    """This process's virtual memory size in bytes (Linux), else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _orphan_watch(parent: int) -> None:
    """Exit when the server is gone, even in the middle of a check (no read sees the
    pipe close then)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _limit_memory(limit: int) -> None:
    """Cap this process's address space at `limit` bytes (the soft limit, which the
    next check may raise again): an allocation past it fails, and llguidance aborts."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(hard, limit), hard))


def worker_main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when its workers stop
    rin, wout = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints go to stderr, not into the messages
    threading.Thread(target=_orphan_watch, args=(os.getppid(),), daemon=True).start()
    from ..actor._matcher import vocab_from_source
    from ._grammar import Draft, check_draft

    vocab = None
    while (message := _read(rin)) is not None:
        if message[0] == "init":
            _, text, eos = message
            vocab = vocab_from_source(text, eos)
            _write(wout, ("ready",))
            continue
        _, source, kind, param, memory = message
        held = _address_space()  # what this worker holds now: earlier checks may have grown it
        if held is not None:
            _limit_memory(held + memory)
        assert vocab is not None
        try:
            grammar = check_draft(vocab, Draft(source, kind, param))
        except InvalidRequestError as exc:
            _write(wout, ("invalid", exc.message, exc.param))
        except MemoryError:
            return 1  # the answer the parent gives a worker that died of it
        except Exception as exc:
            _write(wout, ("error", f"{type(exc).__name__}: {exc}"))
        else:
            _write(wout, ("ok", grammar.min_tokens))
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
