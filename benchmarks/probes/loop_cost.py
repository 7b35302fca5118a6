"""The event loop's CPU per streamed token, without a GPU: the app under hypercorn's
trio worker with `FakeActor` (no model math) stepping every STEP seconds, loaded by
`trio-mlx bench` from another process, which reads the server's main-thread CPU.

    python benchmarks/probes/loop_cost.py [--concurrency 256] [--step 0.03] [--profile FILE]

Prints the bench's line for the level and the server's main-thread CPU us per
token; with --profile, the server runs under cProfile and writes its stats there
(the figure is then the profiler's, not the server's).

The fake model counts up through the model's vocabulary from the prompt's last
token, so the tokenizer decides what the stream looks like: by default the
embedded default model's (SmolLM2, 49k tokens, so the stream walks word pieces);
`--model tiny` uses a 512-token test model built here, a third of whose tokens
are lone UTF-8 bytes that show no text until a character completes. On the
2-core CPU box the two gave the same figure within the runs' spread
(benchmarks/2026-11-25-cpu/loop-cost/).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SERVER = r"""
import cProfile, functools, logging, sys, trio, hypercorn.trio
from hypercorn.config import Config
from trio_mlx.actor import FakeActor
from trio_mlx.engine import Engine
from trio_mlx.server._app import create_app
from trio_mlx.server._settings import Settings
model, port, step, profile, vocab = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], int(sys.argv[5])
def make(settings):
    return Engine(settings.model, max_batch=settings.max_batch, warmup=False,
                  actor=functools.partial(FakeActor, step_seconds=step, vocab_size=vocab))
app = create_app(Settings(model=model, max_batch=512, warmup=False, actor="thread"), engine_factory=make)
config = Config(); config.bind = [f"127.0.0.1:{port}"]; config.accesslog = None
config.errorlog = logging.getLogger("quiet"); logging.getLogger("quiet").setLevel(logging.ERROR)
run = functools.partial(trio.run, functools.partial(hypercorn.trio.serve, app, config))
if profile:
    prof = cProfile.Profile()
    import signal
    def stop(*_):
        prof.disable(); prof.dump_stats(profile); raise SystemExit(0)
    signal.signal(signal.SIGTERM, stop)
    prof.enable()
run()
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="256")
    p.add_argument("--step", type=float, default=0.03, help="seconds per fake step")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--requests-multiple", type=int, default=2)
    p.add_argument("--model", default="embedded",
                   help="a model directory, 'embedded' (the default model's) or 'tiny' (a test model built here)")
    p.add_argument("--profile", default="")
    p.add_argument("--port", type=int, default=8931)
    args = p.parse_args()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with tempfile.TemporaryDirectory() as tmp:
        from trio_mlx.models import _models, ensure_embedded_model, load_tokenizer

        model = args.model
        if model == "embedded":
            model = str(ensure_embedded_model())
        elif model == "tiny":
            model = str(_models.build_test_model(Path(tmp) / "tiny", dtype="float32"))
        vocab = len(load_tokenizer(model)._tokenizer)
        server = subprocess.Popen([sys.executable, "-c", SERVER, model, str(args.port), str(args.step),
                                   args.profile, str(vocab)], env=env)
        try:
            for _ in range(300):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{args.port}/ready", timeout=2)
                    break
                except OSError:
                    time.sleep(0.2)
            out = Path(tmp) / "bench.json"
            subprocess.run([sys.executable, "-m", "trio_mlx.cli", "bench", "--url", f"http://127.0.0.1:{args.port}",
                            "--model", model, "--concurrency", args.concurrency, "--prompt-tokens", "16",
                            "--max-tokens", str(args.max_tokens), "--requests-multiple", str(args.requests_multiple),
                            "--warmup", "4", "--quiet", "--server-pid", str(server.pid), "--out", str(out)],
                           env=env, check=True)
            for lv in json.loads(out.read_text())["levels"]:
                print(f"c={lv['concurrency']} tok/s {lv['output_throughput']:.0f} errors {lv.get('errors')} "
                      f"main-thread us/token {lv.get('server_main_thread_cpu_us_per_token', float('nan')):.1f} "
                      f"server us/token {lv.get('server_cpu_us_per_token', float('nan')):.1f}")
        finally:
            server.terminate()
            server.wait(30)


if __name__ == "__main__":
    main()
