"""Which NCCL collectives run: on which stream, and on which thread the group was joined.

    mlx.launch --backend nccl -n 2 -- python streams.py main|thread|cross

main: the group joined and used on the main thread; thread: joined and used on another
thread; cross: joined on the main thread, used on another (its default stream and a stream
of its own). Each tries `all_sum` on the GPU stream, on the CPU stream (`stream=mx.cpu`, as
mlx-lm's `sharded_load` ends) and with no stream (the group picks). Every rank prints.
"""

import sys
import threading
import traceback

import mlx.core as mx


def body(tag: str) -> None:
    try:
        group = mx.distributed.init(backend="nccl")
        print(tag, "rank", group.rank(), flush=True)
        for name in ("gpu", "cpu", "none"):
            try:
                kwargs = {} if name == "none" else {"stream": getattr(mx, name)}
                y = mx.distributed.all_sum(mx.ones(4), **kwargs)
                mx.eval(y)
                print(tag, name, "ok", y.tolist(), flush=True)
            except Exception as exc:
                print(tag, name, "FAIL", repr(exc), flush=True)
    except Exception:
        traceback.print_exc()


def cross() -> None:
    mx.distributed.init(backend="nccl")
    mx.eval(mx.distributed.all_sum(mx.ones(2)))
    print("main-thread use ok", flush=True)

    def other() -> None:
        for tag, own in (("default", False), ("own-stream", True)):
            try:
                if own:
                    with mx.stream(mx.new_stream(mx.gpu)):
                        y = mx.distributed.all_sum(mx.ones(2))
                else:
                    y = mx.distributed.all_sum(mx.ones(2))
                mx.eval(y)
                print("other thread", tag, "ok", y.tolist(), flush=True)
            except Exception as exc:
                print("other thread", tag, "FAIL", repr(exc), flush=True)

    t = threading.Thread(target=other)
    t.start()
    t.join()


mode = sys.argv[1]
if mode == "main":
    body("main")
elif mode == "thread":
    t = threading.Thread(target=body, args=("thread",))
    t.start()
    t.join()
else:
    cross()
