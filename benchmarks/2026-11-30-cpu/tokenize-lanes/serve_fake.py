"""The app on the fake actor (no model runs; each decode step sleeps STEP seconds), with prompts
of more than TCH characters tokenized in a worker thread (the engine's `_THREAD_TOKENIZE_CHARS`).

    TCH=4096 python serve_fake.py MODEL_DIR PORT STEP
"""
import functools
import os
import sys

import hypercorn.trio
import trio

import trio_mlx.engine._lanes as lanes
from trio_mlx import Engine
from trio_mlx.actor import FakeActor
from trio_mlx.server._app import create_app
from trio_mlx.server._serve import hypercorn_config
from trio_mlx.server._settings import Settings

lanes._THREAD_TOKENIZE_CHARS = int(os.environ.get("TCH", lanes._THREAD_TOKENIZE_CHARS))
model, port, step = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])


def make(settings: Settings) -> Engine:
    return Engine(settings.model, max_batch=settings.tuning.max_batch, prefill_batch=settings.tuning.prefill_batch,
                  prefill_step=settings.tuning.prefill_step, max_queue=settings.max_queue, warmup=False,
                  actor=functools.partial(FakeActor, step_seconds=step))


app = create_app(Settings.from_env(os.environ, model=model, actor="thread", warmup=False), engine_factory=make)
config = hypercorn_config(app.settings)
config.bind = [f"127.0.0.1:{port}"]
trio.run(functools.partial(hypercorn.trio.serve, app, config))
