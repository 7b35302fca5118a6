"""Time rows speculating side by side with a draft model (judges off): the actor's own steps."""
import sys, time, statistics
from pathlib import Path
from trio_mlx.actor import ActorConfig, ActorTuning, SamplingParams, Submit
from trio_mlx.actor._actor import Actor
from trio_mlx.actor._decode import Decoder

Decoder.plain_step = lambda self, width: None
if hasattr(Decoder, "wants_plain"):
    Decoder.wants_plain = lambda self, width: False

class L:
    def built(self): pass

target, draft, rows = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
def run():
    a = Actor(ActorConfig(model_path=target, tuning=ActorTuning(warmup=False, admit_window=0.0, draft_model=draft, num_draft_tokens=3)), link=L())
    a._load()
    subs = [Submit(i + 1, tuple(range(5 + i, 100 + i)), 120, SamplingParams(temperature=0.0), frozenset()) for i in range(rows)]
    failed = a._apply(subs)
    a._step(failed or [])
    t0 = time.perf_counter(); n = 0; steps = 0
    while a.schedule.seqs and steps < 500:
        r = a._step([]); n += len(r.tokens); steps += 1
    return n / (time.perf_counter() - t0), steps
out = [run() for _ in range(3)]
print(f"rows={rows} tok/s {statistics.median(t for t, _ in out):.0f} steps {out[0][1]}")
