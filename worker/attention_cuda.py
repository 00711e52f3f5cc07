"""CUDA attention over a KV cache held as f32, f16, q8_0 or q4_0 rows, read in place.

The cache (worker/sequence_state.py KVState): k, v [S, Hkv, ctx, row] per layer, a row
being head_dim floats (f32 / f16) or head_dim / 32 blocks of llama.cpp's layout
(common/kv_cache.py). A step is a list of items, one per token of the batch (a decode
is one item, a prefill chunk of n tokens n items of the same slot): item i is row
rows[i] of q / out, at position last[i] of slot slots[i], and sees that slot's keys
first[i] .. last[i] (causal; a sliding window raises first). Two launches per layer:

  write(state, k, v, items)   k, v [n, Hkv, hd] float32 → each row quantized once into
                              its (slot, position) of the cache (kv_write_<kind>: one
                              warp per block of 32 elements; rounding as
                              worker/kv_quant.py, so the bytes are llama.cpp's)
  attend(state, q, out, items)
                              q [n, Hq, hd] (scaled) → out rows [*, Hq * hd]
                              (attend_<k kind>_<v kind>)

The attention kernel: a block per (item, kv head, up to HEADS query heads of its
group), WARPS warps. Lane l holds elements l, l + 32, ... of a row (hd <= 32 * MAXE):
the reads of a row are coalesced whatever its type, and a q8_0 / q4_0 element is
one byte (or nibble) and its block's scale. Each warp walks every WARPS-th key of the
item's window with an online softmax (running max, sum and weighted values in
registers), then the block merges its warps through shared memory. Nothing is
dequantized to memory: a step's scratch is the shared memory of a block, one row of
partial sums per warp and head.

fp32 arithmetic only (compute_37: no fp16 math, no dp4a); fp16 scales convert with
cvt on the device. The same source compiles on the host under worker/simt_host.py (the
emulated die runs it, the tests check it there); NVRTC checks it for sm_37 in tests.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..common.kv_cache import KVUnreadable

HEADS = 4                # query heads of one group per block (must match the source)
MAXE = 8                 # elements per lane: heads up to 256 (must match the source)
WARPS = 4                # warps per attention block (must match the source)
MAX_HEAD_DIM = 32 * MAXE
KINDS = ("f32", "f16", "q8_0", "q4_0")

SOURCE = r"""
#if !defined(__CUDACC_RTC__)
#include <math.h>
#endif
#define KV_F32 0
#define KV_F16 1
#define KV_Q8 2
#define KV_Q4 3
#define HEADS 4
#define MAXE 8
#define WARPS 4
#define FULL_MASK 0xffffffffu
#define NO_SCORE -3.0e38f
typedef unsigned long long u64;

__device__ __forceinline__ float h2f(unsigned short h) {
#ifdef __CUDA_ARCH__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    const unsigned sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (e == 0) {                                   /* zero or subnormal: man * 2^-24 */
        const float f = (float)man * 5.9604644775390625e-08f;
        return sign ? -f : f;
    }
    const unsigned bits = sign | (e == 0x1fu ? 0x7f800000u : (e + 112u) << 23) | (man << 13);
    return __int_as_float((int)bits);
#endif
}

/* float → fp16 bits, rounding to nearest even (NumPy's astype(float16)) */
__device__ __forceinline__ unsigned short f2h(float f) {
#ifdef __CUDA_ARCH__
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    const unsigned x = (unsigned)__float_as_int(f), sign = (x >> 16) & 0x8000u;
    const unsigned a = x & 0x7fffffffu;
    if (a >= 0x7f800000u) return (unsigned short)(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0u));
    if (a >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);    /* >= 65520: inf */
    if (a < 0x38800000u)                                  /* below 2^-14: subnormal */
        return (unsigned short)(sign | (unsigned)nearbyintf(__int_as_float((int)a) * 16777216.0f));
    unsigned h = ((((a >> 23) - 112u) << 10) | ((a & 0x7fffffu) >> 13));
    const unsigned rest = a & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
    return (unsigned short)(sign | h);
#endif
}

__device__ __forceinline__ int row_bytes(int kind, int hd) {
    return kind == KV_F32 ? hd * 4 : kind == KV_F16 ? hd * 2 : kind == KV_Q8 ? hd / 32 * 34
                                                                             : hd / 32 * 18;
}

/* element e of a cached row (e < hd) */
template <int KIND>
__device__ __forceinline__ float load_element(const unsigned char* __restrict__ row, int e) {
    if (KIND == KV_F32) return __ldg((const float*)row + e);
    if (KIND == KV_F16) return h2f(__ldg((const unsigned short*)row + e));
    const int per = KIND == KV_Q8 ? 34 : 18;
    const unsigned char* b = row + (e >> 5) * per;
    const float d = h2f((unsigned short)(__ldg(b) | (__ldg(b + 1) << 8)));
    const int j = e & 31;
    if (KIND == KV_Q8) return d * (float)(signed char)__ldg(b + 2 + j);
    const unsigned byte = __ldg(b + 2 + (j & 15));
    return d * (float)((int)(j < 16 ? byte & 15u : byte >> 4) - 8);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

/* Rows of x [n, heads, hd] into the cache at (slots[i], head, pos[i]): a block of 32
   threads per 32 elements of one row, a block of q8_0 / q4_0 as llama.cpp rounds it. */
#define WRITE_PARAMS const float* __restrict__ x, unsigned char* __restrict__ cache, \
    const int* __restrict__ slots, const int* __restrict__ pos, int n, int heads, int ctx, \
    int hd
#define WRITE_ARGS x, cache, slots, pos, n, heads, ctx, hd

template <int KIND> __device__ __forceinline__ void kv_write(WRITE_PARAMS) {
    const int nblk = (hd + 31) >> 5, lane = threadIdx.x & 31;
    const u64 unit = blockIdx.x;
    const int i = (int)(unit / (u64)(heads * nblk)), h = (int)(unit / nblk % heads);
    const int b = (int)(unit % nblk), e = b * 32 + lane;
    const float v = e < hd ? x[((u64)i * heads + h) * hd + e] : 0.0f;
    unsigned char* row = cache + (((u64)slots[i] * heads + h) * ctx + pos[i]) *
                         (u64)row_bytes(KIND, hd);
    if (KIND == KV_F32) {
        if (e < hd) ((float*)row)[e] = v;
        return;
    }
    if (KIND == KV_F16) {
        if (e < hd) ((unsigned short*)row)[e] = f2h(v);
        return;
    }
    unsigned char* blk = row + b * (KIND == KV_Q8 ? 34 : 18);
    float d;
    if (KIND == KV_Q8) {
        float amax = fabsf(v);
#pragma unroll
        for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, o));
        d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f, y = __fmul_rn(v, id);
        const float r = floorf(__fadd_rn(fabsf(y), 0.5f));
        blk[2 + lane] = (unsigned char)(signed char)(int)(y < 0.0f ? -r : r);
    } else {
        /* the first element of largest magnitude, its sign kept: d = it / -8 */
        float a = fabsf(v), best = v, at = (float)lane;
#pragma unroll
        for (int o = 16; o; o >>= 1) {
            const float a2 = __shfl_xor_sync(FULL_MASK, a, o);
            const float best2 = __shfl_xor_sync(FULL_MASK, best, o);
            const float at2 = __shfl_xor_sync(FULL_MASK, at, o);
            if (a2 > a || (a2 == a && at2 < at)) { a = a2; best = best2; at = at2; }
        }
        d = best / -8.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        int q = (int)__fadd_rn(__fmul_rn(v, id), 8.5f);
        q = q < 15 ? q : 15;
        const float high = __shfl_xor_sync(FULL_MASK, (float)q, 16);
        if (lane < 16) blk[2 + lane] = (unsigned char)(q | ((int)high << 4));
    }
    if (lane == 0) {
        const unsigned short s = f2h(d);
        blk[0] = (unsigned char)(s & 0xffu);
        blk[1] = (unsigned char)(s >> 8);
    }
}

/* out[rows[i], heads c*HEADS.. of kv head h's group] = softmax(q k^T) v over keys
   first[i] .. last[i] of slot slots[i] */
#define ATTEND_PARAMS const float* __restrict__ q, const unsigned char* __restrict__ kc, \
    const unsigned char* __restrict__ vc, float* __restrict__ out, \
    const int* __restrict__ rows, const int* __restrict__ slots, \
    const int* __restrict__ first, const int* __restrict__ last, int n_heads, int n_kv, \
    int ctx, int hd
#define ATTEND_ARGS q, kc, vc, out, rows, slots, first, last, n_heads, n_kv, ctx, hd

template <int KK, int VK> __device__ __forceinline__ void attend(ATTEND_PARAMS) {
    __shared__ float sm_m[WARPS][HEADS], sm_l[WARPS][HEADS];
    __shared__ float sm_acc[WARPS][HEADS][32 * MAXE];
    const int group = n_heads / n_kv, chunks = (group + HEADS - 1) / HEADS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int i = blockIdx.x / (n_kv * chunks), h = blockIdx.x / chunks % n_kv;
    const int c = blockIdx.x % chunks, j0 = h * group + c * HEADS;
    const int count = group - c * HEADS < HEADS ? group - c * HEADS : HEADS;
    const int row = rows[i];
    float qr[HEADS][MAXE], acc[HEADS][MAXE], m[HEADS], l[HEADS];
#pragma unroll
    for (int j = 0; j < HEADS; ++j) {
        m[j] = NO_SCORE;
        l[j] = 0.0f;
#pragma unroll
        for (int t = 0; t < MAXE; ++t) {
            const int e = lane + 32 * t;
            qr[j][t] = j < count && e < hd ? q[((u64)row * n_heads + j0 + j) * hd + e] : 0.0f;
            acc[j][t] = 0.0f;
        }
    }
    const u64 kb = (u64)row_bytes(KK, hd), vb = (u64)row_bytes(VK, hd);
    const u64 base = ((u64)slots[i] * n_kv + h) * ctx;
    for (int p = first[i] + warp; p <= last[i]; p += WARPS) {
        const unsigned char* krow = kc + (base + p) * kb;
        const unsigned char* vrow = vc + (base + p) * vb;
        float kf[MAXE], vf[MAXE], s[HEADS];
#pragma unroll
        for (int t = 0; t < MAXE; ++t) {
            const int e = lane + 32 * t;
            kf[t] = e < hd ? load_element<KK>(krow, e) : 0.0f;
            vf[t] = e < hd ? load_element<VK>(vrow, e) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < HEADS; ++j) {
            if (j >= count) continue;                 /* the same for the whole block */
            s[j] = 0.0f;
#pragma unroll
            for (int t = 0; t < MAXE; ++t) s[j] += qr[j][t] * kf[t];
            s[j] = warp_sum(s[j]);
            const float mn = fmaxf(m[j], s[j]);
            const float corr = expf(m[j] - mn), w = expf(s[j] - mn);
            l[j] = l[j] * corr + w;
#pragma unroll
            for (int t = 0; t < MAXE; ++t) acc[j][t] = acc[j][t] * corr + w * vf[t];
            m[j] = mn;
        }
    }
#pragma unroll
    for (int j = 0; j < HEADS; ++j) {
        if (lane == 0) {
            sm_m[warp][j] = m[j];
            sm_l[warp][j] = l[j];
        }
#pragma unroll
        for (int t = 0; t < MAXE; ++t) sm_acc[warp][j][lane + 32 * t] = acc[j][t];
    }
    __syncthreads();
    for (int u = threadIdx.x; u < count * hd; u += blockDim.x) {
        const int j = u / hd, e = u % hd;
        float mx = NO_SCORE;
        for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sm_m[w][j]);
        float sum = 0.0f, o = 0.0f;
        for (int w = 0; w < WARPS; ++w) {
            const float f = expf(sm_m[w][j] - mx);
            sum += sm_l[w][j] * f;
            o += sm_acc[w][j][e] * f;
        }
        out[((u64)row * n_heads + j0 + j) * hd + e] = o / sum;
    }
}

#define WRITE_KERNEL(KIND, NAME) extern "C" __global__ void kv_write_##NAME(WRITE_PARAMS) \
    { kv_write<KIND>(WRITE_ARGS); }
#define ATTEND_KERNEL(KK, KN, VK, VN) extern "C" __global__ void __launch_bounds__(128) \
    attend_##KN##_##VN(ATTEND_PARAMS) { attend<KK, VK>(ATTEND_ARGS); }
#define ATTEND_KERNELS(KK, KN) ATTEND_KERNEL(KK, KN, KV_F32, f32) \
    ATTEND_KERNEL(KK, KN, KV_F16, f16) ATTEND_KERNEL(KK, KN, KV_Q8, q8_0) \
    ATTEND_KERNEL(KK, KN, KV_Q4, q4_0)

WRITE_KERNEL(KV_F32, f32)
WRITE_KERNEL(KV_F16, f16)
WRITE_KERNEL(KV_Q8, q8_0)
WRITE_KERNEL(KV_Q4, q4_0)
ATTEND_KERNELS(KV_F32, f32)
ATTEND_KERNELS(KV_F16, f16)
ATTEND_KERNELS(KV_Q8, q8_0)
ATTEND_KERNELS(KV_Q4, q4_0)
"""

KERNELS = ([f"kv_write_{k}" for k in KINDS] +
           [f"attend_{k}_{v}" for k in KINDS for v in KINDS])


def check_head(head_dim: int) -> None:
    """KVUnreadable unless the kernels read heads of `head_dim` (asked once, when a GPU
    die's KV state is built: a load error, never a failed step)."""
    if head_dim > MAX_HEAD_DIM:
        raise KVUnreadable(f"the GPU attention reads heads of up to {MAX_HEAD_DIM} "
                           f"elements; this model's are {head_dim}")


@dataclass(frozen=True)
class Items:
    """One step's queries: row, slot, first and last key position of each (int32, on the
    die), made once per step and window and shared by the layers."""

    rows: object
    slots: object
    first: object
    last: object
    n: int

    @classmethod
    def of(cls, spans, xp, window: int | None) -> "Items":
        slots = np.concatenate([np.full(s.n, s.slot) for s in spans]).astype(np.int32)
        last = np.concatenate([np.arange(s.start, s.start + s.n) for s in spans])
        first = np.zeros_like(last) if window is None else np.maximum(last - window + 1, 0)
        rows = np.arange(len(last))
        return cls(*(xp.asarray(a.astype(np.int32)) for a in (rows, slots, first, last)),
                   n=len(last))


@dataclass(frozen=True)
class Launch:
    """One kernel launch: the same plan runs on CuPy and under the host shim."""

    name: str
    grid: int
    block: int
    args: tuple


def write_launch(kind: str, x, cache, items: Items, ctx: int) -> Launch:
    n, heads, hd = x.shape
    i32 = np.int32
    return Launch(f"kv_write_{kind}", n * heads * (-(-hd // 32)), 32,
                  (x, cache, items.slots, items.last, i32(n), i32(heads), i32(ctx), i32(hd)))


def attend_launch(kinds: tuple[str, str], q, kc, vc, out, items: Items, ctx: int) -> Launch:
    n, n_heads, hd = q.shape
    n_kv = kc.shape[1]
    chunks = -(-(n_heads // n_kv) // HEADS)
    i32 = np.int32
    return Launch(f"attend_{kinds[0]}_{kinds[1]}", items.n * n_kv * chunks, 32 * WARPS,
                  (q, kc, vc, out, items.rows, items.slots, items.first, items.last,
                   i32(n_heads), i32(n_kv), i32(ctx), i32(hd)))


# -- CuPy entry points --------------------------------------------------------------------

@lru_cache(maxsize=None)
def _module(cp):
    from .kernels_cuda import keep_thread_locale
    module = cp.RawModule(code=SOURCE, options=("--std=c++17",))
    with keep_thread_locale():
        module.get_function(KERNELS[0])             # CuPy compiles on first use
    return module


@lru_cache(maxsize=None)
def _function(cp, name: str):
    return _module(cp).get_function(name)


def run(launch: Launch, cp) -> None:
    _function(cp, launch.name)((launch.grid,), (launch.block,), launch.args)


def _f32(cp, a):
    return cp.ascontiguousarray(a, dtype=cp.float32)


def write(state, k, v, items: Items) -> None:
    """Cache k, v [n, Hkv, hd] (float32) at the items' slots and positions, each row
    quantized once into the state's types."""
    from .device import array_module
    cp = array_module(state.k)
    if items.n:
        run(write_launch(state.kinds[0], _f32(cp, k), state.k, items, state.ctx), cp)
        run(write_launch(state.kinds[1], _f32(cp, v), state.v, items, state.ctx), cp)


def attend(state, q, out, items: Items) -> None:
    """out rows [n, Hq * hd] = each item's attention over its keys, q [n, Hq, hd] scaled;
    the items' own keys and values must be written first (`write`)."""
    from .device import array_module
    cp = array_module(state.k)
    if items.n:
        run(attend_launch(state.kinds, _f32(cp, q), state.k, state.v, out, items,
                          state.ctx), cp)
