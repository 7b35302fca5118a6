"""One query's attention under an array mask, in CUDA kernels of our own: the decode step
of a batch whose rows are left-padded (`_shapes.few_queries` hands it here).

MLX 0.32.4's CUDA backend runs a one-query attention through its fused vector kernel only
without an array mask (`ScaledDotProductAttention::use_fallback`); with one, the scores
are materialized through its fallback (matmul, mask, softmax, matmul: several kernels per
layer). mlx-lm's `BatchKVCache` hands every decode step the rows' left padding as an
array mask, and a batch whose rows differ in length (rows that came in at different
times, or kept different numbers of drafts) is padded at every step: on an H200 the mask
cost a decode step 20-30% (BENCHMARKS.md, "The actor's decode step"). These kernels read
the mask beside the keys, one value per key, in the same pass.

The algorithm is the one-pass attention of a single query (as MLX's own vector kernel and
FlashDecoding compute it). A block takes a row, the query heads that share one key head
(as many as fit its registers: their keys and values are read once) and a split of the
keys; each of its warps walks every WARPS-th key of the split, keeping per head a running
maximum, sum and weighted sum of values (an online softmax), its 32 lanes each holding
D/32 of the head's dimensions. The warps' partials are combined once, in a fixed order
(the same inputs give the same output). Where the rows and heads alone would leave most
SMs idle (a narrow batch over a long context), the keys are split across blocks and a
second kernel combines the splits, as FlashDecoding does. Keys and values are read
through their strides (the cache's slices of a larger buffer, not copied); the mask may
broadcast over rows and heads. Where it does not apply (`applies`) the caller keeps MLX's
attention.
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx

_WARPS = 16  # warps of a block: 512 threads, up to 128 registers each
_TARGET_BLOCKS = 264  # about two blocks per SM of an H100 or H200 (132 SMs)
MIN_KEYS = 256  # the fewest keys a split of the keys takes

_HEADER = """
__device__ __forceinline__ float trio_warp_sum(float x) {
    for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffff, x, off);
    return x;
}
"""

# One block per (group of HG query heads that share a key head, row, split of the keys).
_PASS = """
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int b = blockIdx.y;
    const int split = blockIdx.z;
    const int splits = gridDim.z;
    const int heads = q_shape[1];
    const int h0 = blockIdx.x * HG;
    const int kv_head = h0 / (heads / k_shape[1]);
    const int total = k_shape[2];
    constexpr int PER = D / 32;
    const float log2e = 1.44269504088896340736f;
    const float neg_inf = __int_as_float(0xff800000);
    const float scale_log2 = scale[0] * log2e;
    const int chunk = (total + splits - 1) / splits;
    const int first = split * chunk;
    const int end = min(total, first + chunk);

    float qv[HG][PER];
    float o[HG][PER];
    float best[HG];
    float sum[HG];
    #pragma unroll
    for (int g = 0; g < HG; ++g) {
        const int64_t q_at = b * q_strides[0] + (h0 + g) * q_strides[1];
        #pragma unroll
        for (int i = 0; i < PER; ++i) {
            qv[g][i] = static_cast<float>(q[q_at + (lane * PER + i) * q_strides[3]]) * scale_log2;
            o[g][i] = 0.0f;
        }
        best[g] = neg_inf;
        sum[g] = 0.0f;
    }
    const T* kp = k + b * k_strides[0] + kv_head * k_strides[1];
    const T* vp = v + b * v_strides[0] + kv_head * v_strides[1];
    const int64_t m_row = mask_shape[0] > 1 ? b * mask_strides[0] : 0;
    const int64_t m_head = mask_shape[1] > 1 ? mask_strides[1] : 0;
    const int64_t m_step = mask_strides[3];

    for (int t = first + warp; t < end; t += WARPS) {
        float kt[PER];
        float vt[PER];
        const T* kr = kp + t * k_strides[2];
        const T* vr = vp + t * v_strides[2];
        #pragma unroll
        for (int i = 0; i < PER; ++i) {
            kt[i] = static_cast<float>(kr[(lane * PER + i) * k_strides[3]]);
            vt[i] = static_cast<float>(vr[(lane * PER + i) * v_strides[3]]);
        }
        #pragma unroll
        for (int g = 0; g < HG; ++g) {
            // Both branches compile for either mask type: the function is no template.
            float add = static_cast<float>(mask[m_row + (h0 + g) * m_head + t * m_step]);
            if (MASK_BOOL) {
                if (add == 0.0f) continue;
                add = 0.0f;
            } else {
                if (add == neg_inf) continue;
                add *= log2e;
            }
            float score = 0.0f;
            #pragma unroll
            for (int i = 0; i < PER; ++i) score += qv[g][i] * kt[i];
            score = trio_warp_sum(score) + add;
            const float top = fmaxf(best[g], score);
            const float keep = exp2f(best[g] - top);
            const float w = exp2f(score - top);
            sum[g] = sum[g] * keep + w;
            #pragma unroll
            for (int i = 0; i < PER; ++i) o[g][i] = o[g][i] * keep + w * vt[i];
            best[g] = top;
        }
    }

    // The warps' partials, combined in a fixed order, one head at a time.
    __shared__ float parts[WARPS][D + 1];
    __shared__ float bests[WARPS];
    __shared__ float sums[WARPS];
    #pragma unroll
    for (int g = 0; g < HG; ++g) {
        if (lane == 0) {
            bests[warp] = best[g];
            sums[warp] = sum[g];
        }
        #pragma unroll
        for (int i = 0; i < PER; ++i) parts[warp][lane * PER + i] = o[g][i];
        __syncthreads();
        const int h = h0 + g;
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
            float top = neg_inf;
            for (int j = 0; j < WARPS; ++j) top = fmaxf(top, bests[j]);
            float den = 0.0f;
            float acc = 0.0f;
            for (int j = 0; j < WARPS; ++j) {
                if (sums[j] == 0.0f) continue;
                const float f = exp2f(bests[j] - top);
                den += sums[j] * f;
                acc += parts[j][d] * f;
            }
            STORE
        }
        __syncthreads();
    }
"""

# The whole of the keys in one block: the normalized output.
_STORE_OUT = "out[(b * heads + h) * D + d] = static_cast<T>(den > 0.0f ? acc / den : 0.0f);"
# A split of the keys: its unnormalized sum, the maximum it is relative to, and its
# softmax denominator, for `_COMBINE`.
_STORE_SPLIT = """
            const int64_t at = (static_cast<int64_t>(b) * heads + h) * splits + split;
            part_out[at * D + d] = acc;
            if (d == 0) {
                part_best[at] = top;
                part_sum[at] = den;
            }
"""

_COMBINE = """
    const int64_t bh = blockIdx.y;
    const int d = threadIdx.x;
    const int splits = part_best_shape[2];
    const float neg_inf = __int_as_float(0xff800000);
    float top = neg_inf;
    for (int s = 0; s < splits; ++s) top = fmaxf(top, part_best[bh * splits + s]);
    float den = 0.0f;
    float acc = 0.0f;
    for (int s = 0; s < splits; ++s) {
        const float n = part_sum[bh * splits + s];
        if (n == 0.0f) continue;
        const float f = exp2f(part_best[bh * splits + s] - top);
        den += n * f;
        acc += part_out[(bh * splits + s) * D + d] * f;
    }
    out[bh * D + d] = static_cast<T>(den > 0.0f ? acc / den : 0.0f);
"""

_FLOATS = (mx.float16, mx.bfloat16, mx.float32)


@functools.cache
def _kernels() -> tuple[Any, Any, Any]:
    inputs = ["q", "k", "v", "mask", "scale"]
    whole = mx.fast.cuda_kernel(name="trio_masked_one_query", input_names=inputs, output_names=["out"],
                                source=_PASS.replace("STORE", _STORE_OUT), header=_HEADER,
                                ensure_row_contiguous=False)
    split = mx.fast.cuda_kernel(name="trio_masked_one_query_split", input_names=inputs,
                                output_names=["part_out", "part_best", "part_sum"],
                                source=_PASS.replace("STORE", _STORE_SPLIT), header=_HEADER,
                                ensure_row_contiguous=False)
    combine = mx.fast.cuda_kernel(name="trio_masked_one_query_combine",
                                  input_names=["part_out", "part_best", "part_sum"], output_names=["out"],
                                  source=_COMBINE)
    return whole, split, combine


@functools.cache
def available() -> bool:
    """Whether the kernel can run: MLX's default device is a CUDA GPU."""
    return mx.default_device().type == mx.DeviceType.gpu and mx.cuda.is_available()


def applies(queries: Any, keys: Any, values: Any, mask: Any) -> bool:
    """Whether `attention` takes these: one query (B, H, 1, D) over keys and values
    (B, H_kv, T, D) of the queries' float type, H a multiple of H_kv, D a multiple of 32 up
    to 256; `mask` an array of shape (1 or B, 1 or H, 1, T), boolean (True: attend) or of a
    float type (added to the scores)."""
    if not isinstance(mask, mx.array) or queries.ndim != 4 or keys.ndim != 4 or mask.ndim != 4:
        return False
    b, h, n, d = queries.shape
    kb, kv, total, kd = keys.shape
    return (n == 1 and kb == b and kd == d and values.shape == keys.shape and d % 32 == 0 and d <= 256
            and kv > 0 and h % kv == 0 and queries.dtype in _FLOATS and keys.dtype == queries.dtype
            and values.dtype == queries.dtype and (mask.dtype == mx.bool_ or mask.dtype in _FLOATS)
            and mask.shape[0] in (1, b) and mask.shape[1] in (1, h) and mask.shape[2] == 1
            and mask.shape[3] == total)


@functools.lru_cache(maxsize=8)
def _scale(scale: float) -> Any:
    return mx.array([scale], dtype=mx.float32)


def _heads_per_block(group: int, d: int) -> int:
    """Query heads a block takes: the most that divide `group` (the query heads of one key
    head, whose keys and values it then reads once) with their queries and sums in 16
    registers a lane."""
    most = max(1, 16 // (d // 32))
    return max(g for g in range(1, min(group, most) + 1) if group % g == 0)


def key_splits(rows: int, heads: int, kv_heads: int, d: int, total: int) -> int:
    """Into how many blocks `attention` splits `total` keys: enough for about
    _TARGET_BLOCKS blocks in all, each with at least MIN_KEYS keys; 1 is no split."""
    blocks = rows * (heads // _heads_per_block(heads // kv_heads, d))
    return max(1, min(-(-_TARGET_BLOCKS // blocks), -(-total // MIN_KEYS)))


def attention(queries: Any, keys: Any, values: Any, scale: float, mask: Any) -> Any:
    """Scaled dot-product attention of one query per row and head under `mask` (see
    `applies`), as `mx.fast.scaled_dot_product_attention` computes it: (B, H, 1, D). The
    keys are split between blocks where the rows and key heads alone would leave the
    device's SMs idle (a narrow batch over a long context); a second kernel then combines
    the splits."""
    b, h, _, d = queries.shape
    kv, total = keys.shape[1], keys.shape[2]
    hg = _heads_per_block(h // kv, d)
    splits = key_splits(b, h, kv, d, total)
    whole, split, combine = _kernels()
    inputs = [queries, keys, values, mask, _scale(float(scale))]
    # M is in no source: MLX keys a compiled kernel by its name and these arguments alone,
    # and the mask's type is in the kernel's signature.
    template = [("T", queries.dtype), ("M", mask.dtype), ("D", d), ("HG", hg), ("WARPS", _WARPS),
                ("MASK_BOOL", mask.dtype == mx.bool_)]
    grid = (h // hg * 32 * _WARPS, b, splits)
    threads = (32 * _WARPS, 1, 1)
    if splits == 1:
        (out,) = whole(inputs=inputs, template=template, grid=grid, threadgroup=threads,
                       output_shapes=[(b, h, 1, d)], output_dtypes=[queries.dtype])
        return out
    parts = split(inputs=inputs, template=template, grid=grid, threadgroup=threads,
                  output_shapes=[(b, h, splits, d), (b, h, splits), (b, h, splits)],
                  output_dtypes=[mx.float32] * 3)
    (out,) = combine(inputs=parts, template=[("T", queries.dtype), ("D", d)], grid=(d, b * h, 1),
                     threadgroup=(d, 1, 1), output_shapes=[(b, h, 1, d)], output_dtypes=[queries.dtype])
    return out
