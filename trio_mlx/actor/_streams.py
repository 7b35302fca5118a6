"""The MLX streams of an actor thread's life: made when the life begins, handed back when it ends.

MLX streams belong to the thread that made them (MLX 0.31.2 on), and a thread's streams
are torn down by C++ thread-local destructors when the thread ends. trio's worker threads
are daemons kept in a cache: one that ends while the interpreter finalizes runs those
destructors without Python, and the process aborts after a clean stop ("terminate called
without an active exception", status -6). MLX's recommended teardown is `mx.clear_streams()`
at the end of a thread's MLX work, made for this; after it, the thread cannot use
the streams it had, its default stream and mlx-lm's thread-local `generation_stream` among
them. trio's cache may hand that thread to a later actor (an engine opened again, an actor
restarted), so each life makes its own: a default stream and one for the BatchGenerator
(the layout mlx-lm's `generation_stream` gives it).

`end` leaves the thread fresh, empty default streams, so that other MLX work trio runs on
it later (a model's conversion, a user's own) finds a stream. `begin` and `end` are called
on the actor's thread: by `Actor.run`, or by `ActorHost` for the actors it runs in turns.
The process's main thread (an actor in a child process) keeps its streams: MLX's own exit
handlers clean up there.
"""

from __future__ import annotations

import threading

import mlx.core as mx

_local = threading.local()


def begin() -> None:
    """On the thread starting an actor's life: a default stream and a generation stream of
    its own, made now."""
    device = mx.default_device()
    mx.set_default_stream(mx.new_stream(device))  # per thread (MLX 0.31.2 on)
    _local.generation = mx.new_stream(device)


def generation() -> mx.Stream:
    """The stream the BatchGenerator runs the model on, on this thread (mlx-lm's own where no
    life began here)."""
    stream = getattr(_local, "generation", None)
    if stream is None:
        from mlx_lm.generate import generation_stream

        return generation_stream  # type: ignore[return-value]  # a ThreadLocalStream stands in
    return stream


def end() -> None:
    """On the thread ending an actor's life, once its arrays are freed: wait for its streams'
    work and destroy them, while Python can still run their destructors."""
    stream, _local.generation = getattr(_local, "generation", None), None
    if threading.current_thread() is threading.main_thread():
        return
    if stream is not None:
        mx.synchronize(stream)
    mx.synchronize()
    mx.clear_streams()
    # Leave the thread usable by whatever trio's cache gives it next (a model's conversion, a
    # later actor, a user's own MLX work): fresh default streams, empty, hold nothing that a
    # teardown would trip on.
    for device in (mx.cpu, mx.gpu):
        if mx.is_available(device):
            mx.set_default_stream(mx.new_stream(device))
