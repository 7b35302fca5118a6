"""Where a speculative step's time goes on CUDA: plain steps, a lazy draft chain + verify, per-piece syncs.

python spec_micro.py MODEL_DIR  (a random bf16 model; target and draft are two loads of it)
"""
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

path = sys.argv[1]
target, _ = load(path)
draft, _ = load(path)
K = 4
clock = time.perf_counter


def fresh(prompt_len=128):
    tc, dc = make_prompt_cache(target), make_prompt_cache(draft)
    p = mx.array([[7 + i % 50 for i in range(prompt_len)]])
    mx.eval(target(p, cache=tc), draft(p, cache=dc))
    return tc, dc


def show(name, ts, skip=5):
    ts = [t * 1e3 for t in ts]
    print(f"{name:42s} first {' '.join(f'{t:.1f}' for t in ts[:skip])} | median {statistics.median(ts[skip:]):.2f} ms,"
          f" max {max(ts[skip:]):.1f}, n {len(ts)}", flush=True)


# 1. plain steps, synchronous (token read each step)
tc, dc = fresh()
y = mx.array([[5]])
ts = []
for _ in range(60):
    t = clock()
    y = mx.argmax(target(y, cache=tc)[:, -1], axis=-1)[None]
    y.item()
    ts.append(clock() - t)
show("plain B=1, synchronous", ts)

# 2. plain steps pipelined
tc, dc = fresh()
y = mx.argmax(target(mx.array([[5]]), cache=tc)[:, -1], axis=-1)[None]
mx.async_eval(y)
ts = []
for _ in range(60):
    t = clock()
    nxt = mx.argmax(target(y, cache=tc)[:, -1], axis=-1)[None]
    mx.async_eval(nxt)
    y.item()
    y = nxt
    ts.append(clock() - t)
show("plain B=1, pipelined", ts)

# 3. verify forward alone over (1, K+1), synchronous
for L in (2, 5, 5, 3, 4, 5):
    tc, dc = fresh()
    ts = []
    for _ in range(30):
        x = mx.array([[5] * L])
        t = clock()
        out = mx.argmax(target(x, cache=tc), axis=-1)
        out.tolist()
        ts.append(clock() - t)
        for c in tc:
            c.trim(L - 1)
    show(f"verify (1,{L}) synchronous", ts)

# 4. draft chain alone: K lazy forwards, one eval
tc, dc = fresh()
ts = []
x = mx.array([5])
for _ in range(40):
    t = clock()
    xs = []
    for _ in range(K):
        x = mx.argmax(draft(x[None], cache=dc)[:, -1], axis=-1)
        xs.append(x)
    mx.eval(xs)
    ts.append(clock() - t)
    for c in dc:
        c.trim(K - 1)
    x = xs[0]
show(f"draft chain K={K} lazy, one eval", ts)

# 5. draft chain, eval after each forward
tc, dc = fresh()
ts = []
x = mx.array([5])
for _ in range(40):
    t = clock()
    xs = []
    for _ in range(K):
        x = mx.argmax(draft(x[None], cache=dc)[:, -1], axis=-1)
        mx.eval(x)
        xs.append(x)
    ts.append(clock() - t)
    for c in dc:
        c.trim(K - 1)
    x = xs[0]
show(f"draft chain K={K}, eval each", ts)

# 6. the whole step as _drafting builds it: draft chain + verify in one graph, one read
tc, dc = fresh()
pending = mx.array([5])
ts = []
for _ in range(40):
    t = clock()
    x = pending
    drafts = []
    for _ in range(K):
        x = mx.argmax(draft(x[None], cache=dc)[:, -1], axis=-1)
        drafts.append(x)
    d = mx.concatenate(drafts)
    inp = mx.concatenate([pending, d])[None]
    out = mx.argmax(target(inp, cache=tc), axis=-1)
    out.tolist()
    ts.append(clock() - t)
    for c in tc:
        c.trim(K)
    for c in dc:
        c.trim(K - 1)
show(f"draft+verify one graph K={K}", ts)

# 7. same, the draft chain evaluated before the verify is built
tc, dc = fresh()
ts = []
for _ in range(40):
    t = clock()
    x = pending
    drafts = []
    for _ in range(K):
        x = mx.argmax(draft(x[None], cache=dc)[:, -1], axis=-1)
        drafts.append(x)
    d = mx.concatenate(drafts)
    mx.eval(d)
    inp = mx.concatenate([pending, d])[None]
    out = mx.argmax(target(inp, cache=tc), axis=-1)
    out.tolist()
    ts.append(clock() - t)
    for c in tc:
        c.trim(K)
    for c in dc:
        c.trim(K - 1)
show(f"draft eval, then verify K={K}", ts)

# 8. history prefill of the draft at varying lengths (new shapes per request)
ts = []
for n in (129, 131, 140, 157, 200, 129, 131, 140):
    dc = make_prompt_cache(draft)
    t = clock()
    mx.eval(draft(mx.array([[5] * n]), cache=dc))
    ts.append(clock() - t)
show("draft history prefill, lengths 129..200", ts, skip=0)
