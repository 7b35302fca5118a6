"""How much of a tokenizer's encode holds the GIL, and what a worker thread's hop costs the loop.

    python gil.py MODEL_DIR [MODEL_DIR ...]

For prompts of about 200, 800 and 3,000 tokens: the encode's time, and how fast a thread
spinning in pure Python ran meanwhile against its rate alone (100%: the encode never held the
GIL; 0%: it held it throughout; the box has two cores). Then, on a trio loop, the loop thread's
CPU per prompt of ~400 tokens encoded inline against handed to a worker thread.
"""
import functools
import random
import sys
import threading
import time

import trio
from transformers import AutoTokenizer

WORDS = ["hello", "world", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "server", "token"]


def spin_rate(seconds: float, work=None) -> float:
    """Iterations per second of a spinning thread, over `work()` or `seconds` of sleep."""
    stop, count = [False], [0]

    def spin() -> None:
        while not stop[0]:
            count[0] += 1

    th = threading.Thread(target=spin)
    th.start()
    time.sleep(0.05)
    c0, t0 = count[0], time.perf_counter()
    work() if work else time.sleep(seconds)
    c1, t1 = count[0], time.perf_counter()
    stop[0] = True
    th.join()
    return (c1 - c0) / (t1 - t0)


def encodes(path: str, tok: object) -> None:
    random.seed(0)
    for words in (130, 500, 1900):
        text = " ".join(random.choice(WORDS) for _ in range(words))
        n = len(tok.encode(text))
        reps = 200
        t0 = time.perf_counter()
        for _ in range(reps):
            tok.encode(text)
        each = (time.perf_counter() - t0) / reps
        during = spin_rate(0, functools.partial(repeat, tok.encode, text, reps))
        alone = spin_rate(0.3)
        print(f"{path}: {n} tokens, encode {each * 1e6:.0f} us, a Python thread meanwhile at {100 * during / alone:.0f}% of its rate alone")


def repeat(fn, arg, reps: int) -> None:
    for _ in range(reps):
        fn(arg)


async def loop_cost(path: str, tok: object) -> None:
    text = " ".join(["hello world the quick brown fox"] * 33)
    limiter = trio.CapacityLimiter(1)
    for name in ("inline", "worker thread"):
        reps = 500
        c0 = time.thread_time()
        for _ in range(reps):
            if name == "inline":
                tok.encode(text)
            else:
                await trio.to_thread.run_sync(tok.encode, text, limiter=limiter)
        print(f"{path}: {len(tok.encode(text))} tokens {name}: the loop thread's CPU {(time.thread_time() - c0) / reps * 1e6:.0f} us a prompt")


sys.setswitchinterval(0.0001)
for path in sys.argv[1:]:
    tokenizer = AutoTokenizer.from_pretrained(path)
    encodes(path, tokenizer)
    trio.run(loop_cost, path, tokenizer)
