"""Probe: what a matmul of a few rows costs the host on CUDA, MLX's own against a kernel of
our own, in a chain shaped like one forward of the embedded SmolLM2 (30 layers of seven
projections, float32).

    PYTHONPATH=. python benchmarks/probes/probe_skinny_matmul.py [--rows 1,4,17,33]
        [--layers 30] [--iters 20] [--dtype float32] [--ways mlx,kernel]

A speculative step's forward carries K+1 tokens a row, so each projection is a matmul of
K+1 rows; a plain step of one row is a matrix-vector product. For each row count and
each way (`mlx`: `x @ w.T`; `kernel`: one warp per output column, every row's sum in
its registers, the weight read once; `tiled`: x's columns staged in shared memory a slice
at a time, several output columns a warp), the chain is built, encoded (`mx.async_eval`, where
MLX launches each kernel from the host) and waited for, `--iters` times after three
warm-ups; printed: the median milliseconds of each phase, and the largest difference
between each way's output and the first way's, relative to the output's scale.
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

# `tiled`: a block of 8 warps stages a slice of 128 of x's columns (every row, as float) in
# shared memory; each warp takes CPW output columns, each lane 4 of the slice's weights per
# column (the weights read once, coalesced) and keeps every row's sum for its columns in
# registers (MAXR x CPW = 64); the warp's lanes are summed at the end.
_TILED = """
    constexpr int V = 4;
    constexpr int STEP = 32 * V;
    constexpr int WARPS = 8;
    __shared__ __align__(16) float xs[MAXR * STEP];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int N = w_shape[0];
    const int K = w_shape[1];
    const int rows = x_shape[0];
    const int n0 = (blockIdx.x * WARPS + warp) * CPW;
    float acc[MAXR][CPW];
    #pragma unroll
    for (int r = 0; r < MAXR; ++r) {
        #pragma unroll
        for (int c = 0; c < CPW; ++c) acc[r][c] = 0.0f;
    }
    for (int k0 = 0; k0 < K; k0 += STEP) {
        for (int i = threadIdx.x; i < rows * STEP; i += blockDim.x) {
            const int r = i / STEP;
            const int k = k0 + (i - r * STEP);
            xs[i] = k < K ? static_cast<float>(x[(size_t)r * K + k]) : 0.0f;
        }
        __syncthreads();
        const int kb = k0 + lane * V;
        float wv[CPW][V];
        #pragma unroll
        for (int c = 0; c < CPW; ++c) {
            const int n = n0 + c;
            #pragma unroll
            for (int v = 0; v < V; ++v) {
                wv[c][v] = (n < N && kb + v < K) ? static_cast<float>(w[(size_t)n * K + kb + v]) : 0.0f;
            }
        }
        #pragma unroll
        for (int r = 0; r < MAXR; ++r) {
            if (r < rows) {
                const float4 xv = *reinterpret_cast<const float4*>(xs + r * STEP + lane * V);
                #pragma unroll
                for (int c = 0; c < CPW; ++c) {
                    acc[r][c] += wv[c][0] * xv.x + wv[c][1] * xv.y + wv[c][2] * xv.z + wv[c][3] * xv.w;
                }
            }
        }
        __syncthreads();
    }
    #pragma unroll
    for (int r = 0; r < MAXR; ++r) {
        if (r < rows) {
            #pragma unroll
            for (int c = 0; c < CPW; ++c) {
                float s = acc[r][c];
                for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffff, s, off);
                if (lane == 0 && n0 + c < N) out[(size_t)r * N + n0 + c] = static_cast<T>(s);
            }
        }
    }
"""

_KERNELS: dict[str, object] = {}


def _launch(name: str, source: str, x: mx.array, w: mx.array, template: list, grid: int) -> mx.array:
    """`source` as a kernel of its own (built once) over x (rows, K) and w (N, K): out (rows,
    N), in x's type (T) with `template`'s other arguments, `grid` threads of 256 a block."""
    kernel = _KERNELS.get(name)
    if kernel is None:
        kernel = _KERNELS[name] = mx.fast.cuda_kernel(name=name, input_names=["x", "w"], output_names=["out"],
                                                      source=source)
    (out,) = kernel(inputs=[x, w], template=[("T", x.dtype), *template], grid=(grid, 1, 1),  # type: ignore[operator]
                    threadgroup=(256, 1, 1), output_shapes=[(x.shape[0], w.shape[0])], output_dtypes=[x.dtype])
    return out


def _bucket(rows: int) -> int:
    """The most rows a kernel's registers are laid out for (MAXR): the first of 8, 16, 32, 64."""
    return next(m for m in (8, 16, 32, 64) if rows <= m)


def tiled(x: mx.array, w: mx.array) -> mx.array:
    maxr = _bucket(x.shape[0])
    cpw = 64 // maxr  # output columns a warp
    return _launch("probe_skinny_tiled", _TILED, x, w, [("MAXR", maxr), ("CPW", cpw)], 256 * -(-w.shape[0] // (8 * cpw)))


def skinny(x: mx.array, w: mx.array) -> mx.array:
    return _launch("probe_skinny_matmul", _SOURCE, x, w, [("MAXR", _bucket(x.shape[0]))], 32 * w.shape[0])


def weights(layers: int, dtype: mx.Dtype) -> list[list[mx.array]]:
    d, kv, ff = 576, 192, 1536
    shapes = [(d, d), (kv, d), (kv, d), (d, d), (ff, d), (ff, d), (d, ff)]
    out = []
    for _ in range(layers):
        out.append([(mx.random.normal(s) * (1 / s[1] ** 0.5)).astype(dtype) for s in shapes])
    mx.eval(out)
    return out


def forward(x: mx.array, ws: list[list[mx.array]], way: str) -> mx.array:
    mm = {"mlx": lambda a, w: a @ w.T, "kernel": skinny, "tiled": tiled}[way]
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
    p.add_argument("--ways", default="mlx,kernel", help="mlx, kernel (one warp a column), tiled")
    a = p.parse_args()
    dtype = getattr(mx, a.dtype)
    ws = weights(a.layers, dtype)
    print(f"device {mx.default_device()}, {a.layers} layers of 7 projections, {a.dtype}")
    for rows in (int(r) for r in a.rows.split(",")):
        x = mx.random.normal((rows, 576)).astype(dtype)
        mx.eval(x)
        outs = {}
        ways = a.ways.split(",")
        for way in ways + ways:  # each twice, interleaved
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
        ref = outs[ways[0]].astype(mx.float32)
        for way in ways[1:]:
            rel = (mx.max(mx.abs(ref - outs[way].astype(mx.float32))) / mx.max(mx.abs(ref))).item()
            print(f"rows {rows:3d} {way}: largest difference from {ways[0]} / scale {rel:.2e}", flush=True)


if __name__ == "__main__":
    main()
