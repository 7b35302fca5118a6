"""Probe: what a matmul of a few rows costs the host on CUDA, MLX's own against a kernel of
our own, in a chain shaped like one forward of the embedded SmolLM2 (30 layers of seven
projections, float32).

    PYTHONPATH=. python benchmarks/probes/probe_skinny_matmul.py [--rows 1,4,17,33]
        [--layers 30] [--iters 20] [--dtype float32]

A speculative step's forward carries K+1 tokens a row, so each projection is a matmul of
K+1 rows; a plain step of one row is a matrix-vector product. For each row count and
each way (`mlx`: `x @ w.T`; `kernel`: one warp per output column, every row's sum in
its registers, the weight read once), the chain is built, encoded (`mx.async_eval`, where
MLX launches each kernel from the host) and waited for, `--iters` times after three
warm-ups; printed: the median milliseconds of each phase, and the largest difference
between the two ways' outputs relative to the output's scale.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

_SOURCE = """
    const int lane = threadIdx.x & 31;
    const int n = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int N = w_shape[0];
    const int K = w_shape[1];
    const int rows = x_shape[0];
    if (n >= N) return;
    float acc[MAXR];
    #pragma unroll
    for (int r = 0; r < MAXR; ++r) acc[r] = 0.0f;
    const T* wr = w + (size_t)n * K;
    for (int k = lane; k < K; k += 32) {
        const float wv = static_cast<float>(wr[k]);
        #pragma unroll
        for (int r = 0; r < MAXR; ++r) {
            if (r < rows) acc[r] += wv * static_cast<float>(x[(size_t)r * K + k]);
        }
    }
    #pragma unroll
    for (int r = 0; r < MAXR; ++r) {
        if (r < rows) {
            float s = acc[r];
            for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffff, s, off);
            if (lane == 0) out[(size_t)r * N + n] = static_cast<T>(s);
        }
    }
"""

_KERNEL = None


def skinny(x: mx.array, w: mx.array) -> mx.array:
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = mx.fast.cuda_kernel(name="probe_skinny_matmul", input_names=["x", "w"], output_names=["out"],
                                      source=_SOURCE)
    rows, n = x.shape[0], w.shape[0]
    maxr = next(m for m in (8, 16, 32, 64) if rows <= m)
    (out,) = _KERNEL(inputs=[x, w], template=[("T", x.dtype), ("MAXR", maxr)], grid=(32 * n, 1, 1),
                     threadgroup=(256, 1, 1), output_shapes=[(rows, n)], output_dtypes=[x.dtype])
    return out


def weights(layers: int, dtype: mx.Dtype) -> list[list[mx.array]]:
    d, kv, ff = 576, 192, 1536
    shapes = [(d, d), (kv, d), (kv, d), (d, d), (ff, d), (ff, d), (d, ff)]
    out = []
    for _ in range(layers):
        out.append([(mx.random.normal(s) * (1 / s[1] ** 0.5)).astype(dtype) for s in shapes])
    mx.eval(out)
    return out


def forward(x: mx.array, ws: list[list[mx.array]], way: str) -> mx.array:
    mm = (lambda a, w: a @ w.T) if way == "mlx" else skinny
    for wq, wk, wv, wo, wg, wu, wd in ws:
        q, k, v = mm(x, wq), mm(x, wk), mm(x, wv)
        o = mm(q, wo)
        g, u = mm(x, wg), mm(x, wu)
        x = x + o + mm(g * mx.sigmoid(g) * u, wd) * 0.1 + (k[:, :1] + v[:, :1]) * 0.0
        x = x / mx.sqrt(mx.mean(x * x, axis=-1, keepdims=True) + 1e-5)
    return x


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,4,17,33")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--dtype", default="float32")
    a = p.parse_args()
    dtype = getattr(mx, a.dtype)
    ws = weights(a.layers, dtype)
    print(f"device {mx.default_device()}, {a.layers} layers of 7 projections, {a.dtype}")
    for rows in (int(r) for r in a.rows.split(",")):
        x = mx.random.normal((rows, 576)).astype(dtype)
        mx.eval(x)
        outs = {}
        for way in ("mlx", "kernel", "mlx", "kernel"):  # each twice, interleaved
            build, enc, wait = [], [], []
            for i in range(3 + a.iters):
                t0 = time.perf_counter()
                y = forward(x, ws, way)
                t1 = time.perf_counter()
                mx.async_eval(y)
                t2 = time.perf_counter()
                mx.eval(y)
                t3 = time.perf_counter()
                if i >= 3:
                    build.append(t1 - t0)
                    enc.append(t2 - t1)
                    wait.append(t3 - t2)
            outs[way] = y
            print(f"rows {rows:3d} {way:7s} build {1e3 * statistics.median(build):6.2f} ms  encode "
                  f"{1e3 * statistics.median(enc):6.2f} ms  wait {1e3 * statistics.median(wait):6.2f} ms  "
                  f"total {1e3 * (statistics.median(build) + statistics.median(enc) + statistics.median(wait)):6.2f} ms",
                  flush=True)
        a_, b_ = outs["mlx"].astype(mx.float32), outs["kernel"].astype(mx.float32)
        rel = (mx.max(mx.abs(a_ - b_)) / mx.max(mx.abs(a_))).item()
        print(f"rows {rows:3d} largest difference / scale {rel:.2e}", flush=True)


if __name__ == "__main__":
    main()
