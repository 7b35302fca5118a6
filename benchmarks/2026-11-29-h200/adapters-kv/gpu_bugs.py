"""Which ops fail on CUDA: quantized_matmul shapes (the quantized KV cache), and the named-adapter forward."""
import sys, traceback, pathlib, tempfile, os
MODEL = os.environ.get("M", "/tmp/m1b")
import mlx.core as mx

def attempt(label, fn):
    try:
        out = fn(); mx.eval(out); print("ok  ", label, flush=True)
    except Exception as e:
        print("FAIL", label, str(e)[:160], flush=True)

# 1. quantized_matmul as mlx-lm's quantized attention calls it: scores = q @ k^T (transpose), out = p @ v
for d in ((64, 128) if not os.environ.get('SKIP_QMM') else ()):
    for bits in (4, 8):
        for g in (32, 64, 128):
            if g > d: continue
            for n in (1, 32, 33, 256):
                for L in (1, 5):
                    q = mx.random.normal((1, 8, L, d)).astype(mx.bfloat16)
                    k = mx.random.normal((1, 8, n, d)).astype(mx.bfloat16)
                    kq = mx.quantize(k, group_size=g, bits=bits)
                    attempt(f"qk d={d} bits={bits} g={g} keys={n} L={L}",
                            lambda: mx.quantized_matmul(q, *kq, transpose=True, group_size=g, bits=bits))
                    p = mx.softmax(mx.random.normal((1, 8, L, n)).astype(mx.bfloat16), axis=-1)
                    vq = mx.quantize(k, group_size=g, bits=bits)
                    attempt(f"pv d={d} bits={bits} g={g} keys={n} L={L}",
                            lambda: mx.quantized_matmul(p, *vq, transpose=False, group_size=g, bits=bits))

# 2. the named-adapter forward
sys.path.insert(0, "benchmarks/probes")
from probe_adapters import make_adapters
from trio_mlx.models import _models
where = pathlib.Path(tempfile.mkdtemp())
names = make_adapters(MODEL, where, 16)
print("adapters", names, flush=True)
model, cfg = _models.load_model(MODEL, None, names)
rows = model._trio_adapter_rows
from mlx_lm.models.cache import make_prompt_cache
for label, slots, L in (("none B1 L1", [0], 1), ("none B1 L8", [0], 8), ("one B1 L1", [1], 1), ("one B1 L8", [1], 8),
                        ("mix B2 L1", [1, 2], 1), ("mix B2 L8", [0, 1], 8), ("mix B4 L1", [0, 1, 2, 1], 1), ("mix B2 L128", [1, 0], 128), ("mix B3 L128", [1, 0, 2], 128)):
    def fwd():
        rows.set(slots)
        c = make_prompt_cache(model)
        x = mx.array([[5 + i for i in range(L)]] * len(slots))
        y = model(x, cache=c)
        rows.clear()
        return y
    attempt("adapters " + label, fwd)
# gather_mm alone
for B, L in ((2, 1), (2, 8), (4, 1), (2, 64), (3, 128), (2, 512)):
    x = mx.random.normal((B, L, 2048)).astype(mx.bfloat16)
    a = mx.random.normal((3, 2048, 16)).astype(mx.bfloat16)
    idx = mx.array([i % 3 for i in range(B)], dtype=mx.uint32)
    attempt(f"gather_mm B={B} L={L}", lambda: mx.gather_mm(x, a, rhs_indices=idx))
    attempt(f"gather_mm 4d B={B} L={L}", lambda: mx.gather_mm(x[:, None], a, rhs_indices=idx[:, None]))
    attempt(f"take+matmul B={B} L={L}", lambda: x @ a[idx])

# 3. through the engine, warm-up off, then on
import trio, trio_mlx
async def engine_try(warmup):
    try:
        async with trio_mlx.open_engine(MODEL, adapters=names, warmup=warmup, max_batch=4) as eng:
            async def one(adapter):
                async with eng.generate("hello there", max_tokens=8, temperature=0.0, ignore_eos=True, adapter=adapter) as evs:
                    async for ev in evs:
                        pass
            for plan in ([None], ["a"], ["a", "b"], [None, "a", "b", None]):
                try:
                    async with trio.open_nursery() as n:
                        for ad in plan:
                            n.start_soon(one, ad)
                    print("ok   engine warmup=%s plan=%s" % (warmup, plan), flush=True)
                except BaseException as e:
                    print("FAIL engine warmup=%s plan=%s %s" % (warmup, plan, repr(e)[:300]), flush=True)
    except Exception as e:
        print("FAIL engine open warmup=%s %s" % (warmup, repr(e)[:400]), flush=True)

trio.run(engine_try, True)
