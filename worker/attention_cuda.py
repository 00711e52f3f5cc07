"""CUDA attention over a KV cache held as f32, f16, q8_0 or q4_0 rows, read in place.

The cache (worker/sequence_state.py KVState): k, v [S, Hkv, ctx, row] per layer, a row
being head_dim floats (f32 / f16) or head_dim / 32 blocks of llama.cpp's layout
(common/kv_cache.py); keys and values may differ in type (the kernels take both as
arguments). A step (StepPlan, made once and shared by the layers) is every token of
the batch at its slot and position; per layer:

  write(state, k, v, plan)    kv_write: k, v [n, Hkv, hd] float32 → each row quantized
                              once into its (slot, position) of the cache, a warp per
                              block of 32 elements, rounded as worker/kv_quant.py
                              (llama.cpp's reference quantizer) rounds
  attend(state, q, out, plan, window)
                              q [n, Hq, hd] (scaled) → out rows [*, Hq * hd], each query
                              over its slot's keys up to its own position (causal),
                              from position - window + 1 with a sliding window:
    attend        the decodes: a block per (query, kv head, up to HEADS query heads of
                  its group), WARPS warps. Lane l holds elements l, l + 32, ... of a row
                  (hd <= 32 * MAXE), so a row's reads are coalesced whatever its type;
                  each warp walks every WARPS-th key with an online softmax (running
                  max, sum and weighted values in registers), then the block merges its
                  warps through shared memory. Few queries over long windows: the
                  keys are cut into segments, a block each (enough blocks for the die),
                  and attend_merge combines the segments' (max, sum, values).
    attend_chunk  the prefill chunks, in tiles of consecutive queries of one slot that
                  share every key read: keys come TK at a time, widened into shared
                  memory; lane l scores key l for each (query, head) pair of its warp,
                  a pair's softmax update takes two reductions per tile, values are read
                  once per warp and key.
Nothing is dequantized to device memory: a step's scratch is a block's shared memory
(16.5 KiB, or 32 KiB for a tile of keys), and with segments one row of hd + 2 floats
per query head and segment (at most MAX_SPLITS).

fp32 arithmetic only (compute_37: no fp16 math, no dp4a); fp16 scales convert with cvt
on the device. The same source compiles on the host under worker/simt_host.py (the
emulated die runs it, the tests check it there); NVRTC checks it for sm_37 in tests.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..common.kv_cache import KVUnreadable
from .kernels_cuda import HALF_TO_FLOAT, compiled

HEADS = 4                # query heads of one group per block (must match the source)
MAXE = 8                 # elements per lane: heads up to 256 (must match the source)
WARPS = 4                # warps per attention block (must match the source)
MAX_HEAD_DIM = 32 * MAXE
TARGET_BLOCKS = 104      # decode blocks a step aims at: 8 per multiprocessor of a K80 die
SPLIT_KEYS = 256         # the fewest keys a decode's segment takes
MAX_SPLITS = 32
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

""" + HALF_TO_FLOAT + r"""
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
__device__ __forceinline__ float load_element(int kind, const unsigned char* __restrict__ row,
                                              int e) {
    if (kind == KV_F32) return __ldg((const float*)row + e);
    if (kind == KV_F16) return half_to_float(__ldg((const unsigned short*)row + e));
    const int per = kind == KV_Q8 ? 34 : 18;
    const unsigned char* b = row + (e >> 5) * per;
    const float d = half_to_float((unsigned short)(__ldg(b) | (__ldg(b + 1) << 8)));
    const int j = e & 31;
    if (kind == KV_Q8) return d * (float)(signed char)__ldg(b + 2 + j);
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
extern "C" __global__ void kv_write(const float* __restrict__ x,
                                    unsigned char* __restrict__ cache,
                                    const int* __restrict__ slots, const int* __restrict__ pos,
                                    int n, int heads, int ctx, int hd, int kind) {
    const int nblk = (hd + 31) >> 5, lane = threadIdx.x & 31;
    const u64 unit = blockIdx.x;
    const int i = (int)(unit / (u64)(heads * nblk)), h = (int)(unit / nblk % heads);
    const int b = (int)(unit % nblk), e = b * 32 + lane;
    const float v = e < hd ? x[((u64)i * heads + h) * hd + e] : 0.0f;
    unsigned char* row = cache + (((u64)slots[i] * heads + h) * ctx + pos[i]) *
                         (u64)row_bytes(kind, hd);
    if (kind == KV_F32) {
        if (e < hd) ((float*)row)[e] = v;
        return;
    }
    if (kind == KV_F16) {
        if (e < hd) ((unsigned short*)row)[e] = f2h(v);
        return;
    }
    unsigned char* blk = row + b * (kind == KV_Q8 ? 34 : 18);
    float d;
    if (kind == KV_Q8) {
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
   first[i] .. last[i] of slot slots[i]. With splits > 1 the keys are cut into `splits`
   segments, a block each, and each block leaves its segment's (max, sum, weighted
   values) in part[(i, head, segment)] for attend_merge (long windows, few queries: the
   die's multiprocessors all get work). */
#define ATTEND_PARAMS const float* __restrict__ q, const unsigned char* __restrict__ kc, \
    const unsigned char* __restrict__ vc, float* __restrict__ out, \
    float* __restrict__ part, const int* __restrict__ rows, \
    const int* __restrict__ slots, const int* __restrict__ first, \
    const int* __restrict__ last, int n_heads, int n_kv, int ctx, int hd, int kk, int vk, \
    int splits

extern "C" __global__ void __launch_bounds__(128) attend(ATTEND_PARAMS) {
    __shared__ float sm_m[WARPS][HEADS], sm_l[WARPS][HEADS];
    __shared__ float sm_acc[WARPS][HEADS][32 * MAXE];
    const int group = n_heads / n_kv, chunks = (group + HEADS - 1) / HEADS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int sp = blockIdx.x % splits, unit = blockIdx.x / splits;
    const int i = unit / (n_kv * chunks), h = unit / chunks % n_kv;
    const int c = unit % chunks, j0 = h * group + c * HEADS;
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
    const u64 kb = (u64)row_bytes(kk, hd), vb = (u64)row_bytes(vk, hd);
    const u64 base = ((u64)slots[i] * n_kv + h) * ctx;
    const int seg = (last[i] - first[i] + splits) / splits;
    const int lo = first[i] + sp * seg, hi = lo + seg - 1 < last[i] ? lo + seg - 1 : last[i];
    for (int p = lo + warp; p <= hi; p += WARPS) {
        const unsigned char* krow = kc + (base + p) * kb;
        const unsigned char* vrow = vc + (base + p) * vb;
        float kf[MAXE], vf[MAXE], s[HEADS];
#pragma unroll
        for (int t = 0; t < MAXE; ++t) {
            const int e = lane + 32 * t;
            kf[t] = e < hd ? load_element(kk, krow, e) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < HEADS; ++j) {
            s[j] = 0.0f;
#pragma unroll
            for (int t = 0; t < MAXE; ++t) s[j] += qr[j][t] * kf[t];
            if (j < count) s[j] = warp_sum(s[j]);     /* the same for the whole block */
        }
#pragma unroll
        for (int t = 0; t < MAXE; ++t) {
            const int e = lane + 32 * t;
            vf[t] = e < hd ? load_element(vk, vrow, e) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < HEADS; ++j) {
            if (j >= count) continue;
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
        if (splits == 1) {
            out[((u64)row * n_heads + j0 + j) * hd + e] = o / sum;
        } else {
            float* dst = part + (((u64)i * n_heads + j0 + j) * splits + sp) * (hd + 2);
            if (e == 0) {
                dst[0] = mx;
                dst[1] = sum;
            }
            dst[2 + e] = o;
        }
    }
}

/* out[rows[i], head] from the `splits` segments' partial results of attend */
extern "C" __global__ void attend_merge(const float* __restrict__ part, float* __restrict__ out,
                                        const int* __restrict__ rows, int n_heads, int hd,
                                        int splits) {
    const int i = blockIdx.x / n_heads, head = blockIdx.x % n_heads;
    const float* src = part + ((u64)i * n_heads + head) * splits * (hd + 2);
    float mx = NO_SCORE;
    for (int s = 0; s < splits; ++s) mx = fmaxf(mx, src[s * (hd + 2)]);
    float sum = 0.0f;
    for (int s = 0; s < splits; ++s) sum += src[s * (hd + 2) + 1] * expf(src[s * (hd + 2)] - mx);
    for (int e = threadIdx.x; e < hd; e += blockDim.x) {
        float o = 0.0f;
        for (int s = 0; s < splits; ++s)
            o += src[s * (hd + 2) + 2 + e] * expf(src[s * (hd + 2)] - mx);
        out[((u64)rows[i] * n_heads + head) * hd + e] = o / sum;
    }
}

/* A prefill chunk's queries in tiles: a block per (tile of up to 32 / group queries of
   one slot, kv head, up to 32 query heads of its group): every (query, head) pair of
   the tile reads the same keys, so they are read once per block. Keys come in tiles of
   TK, widened to fp32 in shared memory (a row per key, padded: no bank conflicts); lane
   l scores key l of the tile for each of its warp's pairs (a pair's whole row of q
   against it), the tile's softmax update takes two reductions per pair, and the values
   are read once per warp and key, each pair's weight broadcast from the key's lane. */
#define TK 32
#define PPW 8
#define SK_STRIDE (32 * MAXE + 1)
#define CHUNK_PARAMS const float* __restrict__ q, const unsigned char* __restrict__ kc, \
    const unsigned char* __restrict__ vc, float* __restrict__ out, \
    const int* __restrict__ tiles, int n_heads, int n_kv, int ctx, int hd, int window, \
    int head_chunks, int kk, int vk

__device__ __forceinline__ int first_key(int pos, int window) {
    return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
}

extern "C" __global__ void __launch_bounds__(128) attend_chunk(CHUNK_PARAMS) {
    __shared__ float sk[TK * SK_STRIDE];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int c = blockIdx.x % head_chunks, h = blockIdx.x / head_chunks % n_kv;
    const int* tile = tiles + 4 * (blockIdx.x / (head_chunks * n_kv));
    const int row0 = tile[0], nq = tile[1], pos0 = tile[3];
    const int group = n_heads / n_kv, j0 = h * group + c * 32;
    const int hc = group - c * 32 < 32 ? group - c * 32 : 32, pairs = nq * hc;
    const int kend = pos0 + nq - 1;
    const u64 kb = (u64)row_bytes(kk, hd), vb = (u64)row_bytes(vk, hd);
    const u64 base = ((u64)tile[2] * n_kv + h) * ctx;
    float m[PPW], l[PPW], acc[PPW][MAXE];
#pragma unroll
    for (int k = 0; k < PPW; ++k) {
        m[k] = NO_SCORE;
        l[k] = 0.0f;
#pragma unroll
        for (int t = 0; t < MAXE; ++t) acc[k][t] = 0.0f;
    }
    for (int k0 = first_key(pos0, window); k0 <= kend; k0 += TK) {
        __syncthreads();                                  /* the last tile is read */
        for (int u = threadIdx.x; u < TK * hd; u += blockDim.x) {
            const int r = u / hd, e = u % hd;
            sk[r * SK_STRIDE + e] = k0 + r <= kend ?
                load_element(kk, kc + (base + k0 + r) * kb, e) : 0.0f;
        }
        __syncthreads();
        const int kp = k0 + lane;                         /* this lane's key */
        float pv[PPW];
#pragma unroll
        for (int k = 0; k < PPW; ++k) {
            pv[k] = 0.0f;
            const int u = warp + WARPS * k;
            if (u >= pairs) continue;                     /* the same for the whole warp */
            const int qi = u / hc, pos = pos0 + qi;
            const float* qrow = q + ((u64)(row0 + qi) * n_heads + j0 + u % hc) * hd;
            float s = 0.0f;
            for (int e = 0; e < hd; ++e) s += __ldg(qrow + e) * sk[lane * SK_STRIDE + e];
            const bool seen = kp >= first_key(pos, window) && kp <= pos;
            s = seen ? s : NO_SCORE;
            float mt = s;
#pragma unroll
            for (int o = 16; o; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(FULL_MASK, mt, o));
            const float mn = fmaxf(m[k], mt), corr = expf(m[k] - mn);
            pv[k] = seen ? expf(s - mn) : 0.0f;
            l[k] = l[k] * corr + warp_sum(pv[k]);
#pragma unroll
            for (int t = 0; t < MAXE; ++t) acc[k][t] *= corr;
            m[k] = mn;
        }
        const int nk = kend - k0 + 1 < TK ? kend - k0 + 1 : TK;
        for (int r = 0; r < nk; ++r) {
            const unsigned char* vrow = vc + (base + k0 + r) * vb;
            float vf[MAXE];
#pragma unroll
            for (int t = 0; t < MAXE; ++t) {
                const int e = lane + 32 * t;
                vf[t] = e < hd ? load_element(vk, vrow, e) : 0.0f;
            }
#pragma unroll
            for (int k = 0; k < PPW; ++k) {
                if (warp + WARPS * k >= pairs) continue;
                const float w = __shfl_sync(FULL_MASK, pv[k], r);
#pragma unroll
                for (int t = 0; t < MAXE; ++t) acc[k][t] += w * vf[t];
            }
        }
    }
#pragma unroll
    for (int k = 0; k < PPW; ++k) {
        const int u = warp + WARPS * k;
        if (u >= pairs) continue;
        float* o = out + ((u64)(row0 + u / hc) * n_heads + j0 + u % hc) * hd;
#pragma unroll
        for (int t = 0; t < MAXE; ++t)
            if (lane + 32 * t < hd) o[lane + 32 * t] = acc[k][t] / l[k];
    }
}

"""

KERNELS = ("kv_write", "attend", "attend_merge", "attend_chunk")
CODE = {kind: np.int32(i) for i, kind in enumerate(KINDS)}      # the source's KV_*


def check_head(head_dim: int) -> None:
    """KVUnreadable unless the kernels read heads of `head_dim` (asked once, when a GPU
    die's KV state is built: a load error, never a failed step)."""
    if head_dim > MAX_HEAD_DIM:
        raise KVUnreadable(f"the GPU attention reads heads of up to {MAX_HEAD_DIM} "
                           f"elements; this model's are {head_dim}")


@dataclass(frozen=True)
class Items:
    """Queries read one at a time (a step's decodes): row, slot, first and last key
    position of each (int32, on the die)."""

    rows: object
    slots: object
    first: object
    last: object
    n: int
    longest: int          # the most keys one query reads


class StepPlan:
    """What a step's launches read, made once per step and shared by the layers: where
    every token's key and value go, the decodes as items (per window), the prefill
    chunks as tiles (per tile size)."""

    def __init__(self, spans, xp):
        self.xp = xp
        slots = np.concatenate([np.full(s.n, s.slot) for s in spans]).astype(np.int32)
        pos = np.concatenate([np.arange(s.start, s.start + s.n) for s in spans])
        self.n = len(pos)
        self.slots, self.pos = xp.asarray(slots), xp.asarray(pos.astype(np.int32))
        rows = np.cumsum([0] + [s.n for s in spans])[:-1]
        one = [(r, s) for r, s in zip(rows, spans) if s.n == 1]
        self.decode = (np.array([r for r, _ in one], dtype=np.int32),
                       np.array([s.slot for _, s in one], dtype=np.int32),
                       np.array([s.start for _, s in one], dtype=np.int32))
        self.chunks = [(int(r), s) for r, s in zip(rows, spans) if s.n > 1]
        self._items: dict = {}
        self._tiles: dict = {}

    def items(self, window: int | None) -> Items:
        if window not in self._items:
            rows, slots, last = self.decode
            first = np.zeros_like(last) if window is None else \
                np.maximum(last - window + 1, 0).astype(np.int32)
            xp = self.xp
            self._items[window] = Items(*(xp.asarray(a) for a in (rows, slots, first, last)),
                                        n=len(rows),
                                        longest=int((last - first).max() + 1) if len(rows)
                                        else 0)
        return self._items[window]

    def tiles(self, per_tile: int):
        """int32 [tiles, 4]: (first row, queries, slot, first position) of each tile of
        up to `per_tile` consecutive queries of one chunk; None without chunks."""
        if per_tile not in self._tiles:
            out = [(row + i, min(per_tile, s.n - i), s.slot, s.start + i)
                   for row, s in self.chunks for i in range(0, s.n, per_tile)]
            self._tiles[per_tile] = (self.xp.asarray(np.array(out, dtype=np.int32))
                                     if out else None)
        return self._tiles[per_tile]


def chunk_geometry(n_heads: int, n_kv: int) -> tuple[int, int]:
    """(queries per tile, head chunks): a block holds at most 32 (query, head) pairs, 8
    per warp (the source's PPW x WARPS)."""
    group = n_heads // n_kv
    heads = min(group, 32)
    return max(1, 32 // heads), -(-group // 32)


@dataclass(frozen=True)
class Launch:
    """One kernel launch: the same plan runs on CuPy and under the host shim."""

    name: str
    grid: int
    block: int
    args: tuple


def write_launch(kind: str, x, cache, plan: StepPlan, ctx: int) -> Launch:
    n, heads, hd = x.shape
    i32 = np.int32
    return Launch("kv_write", n * heads * (-(-hd // 32)), 32,
                  (x, cache, plan.slots, plan.pos, i32(n), i32(heads), i32(ctx), i32(hd),
                   CODE[kind]))


def splits_for(blocks: int, longest: int) -> int:
    """Key segments per decode: enough blocks for the die (TARGET_BLOCKS), each segment
    at least SPLIT_KEYS keys (below that the merge costs more than it spreads)."""
    return max(1, min(-(-TARGET_BLOCKS // max(blocks, 1)), longest // SPLIT_KEYS, MAX_SPLITS))


def attend_launches(kinds: tuple[str, str], q, kc, vc, out, items: Items, ctx: int,
                    part=None) -> list[Launch]:
    """The decode kernel, and the merge of its segments when `part` (float32 [n, Hq,
    splits, hd + 2]) is given."""
    n, n_heads, hd = q.shape
    n_kv = kc.shape[1]
    chunks = -(-(n_heads // n_kv) // HEADS)
    splits = 1 if part is None else part.shape[2]
    i32 = np.int32
    part_arg = out if part is None else part              # never read with one segment
    launches = [Launch("attend", items.n * n_kv * chunks * splits, 32 * WARPS,
                       (q, kc, vc, out, part_arg, items.rows, items.slots, items.first,
                        items.last, i32(n_heads), i32(n_kv), i32(ctx), i32(hd),
                        CODE[kinds[0]], CODE[kinds[1]], i32(splits)))]
    if part is not None:
        launches.append(Launch("attend_merge", items.n * n_heads, 32 * min(4, -(-hd // 32)),
                               (part, out, items.rows, i32(n_heads), i32(hd), i32(splits))))
    return launches


def chunk_launch(kinds: tuple[str, str], q, kc, vc, out, tiles, ctx: int,
                 window: int | None) -> Launch:
    n, n_heads, hd = q.shape
    n_kv = kc.shape[1]
    head_chunks = chunk_geometry(n_heads, n_kv)[1]
    i32 = np.int32
    return Launch("attend_chunk", tiles.shape[0] * n_kv * head_chunks, 32 * WARPS,
                  (q, kc, vc, out, tiles, i32(n_heads), i32(n_kv), i32(ctx), i32(hd),
                   i32(window or 0), i32(head_chunks), CODE[kinds[0]], CODE[kinds[1]]))


# -- CuPy entry points --------------------------------------------------------------------

@lru_cache(maxsize=None)
def _function(cp, name: str):
    return compiled(cp, SOURCE, KERNELS[0]).get_function(name)


def run(launch: Launch, cp) -> None:
    _function(cp, launch.name)((launch.grid,), (launch.block,), launch.args)


def _f32(cp, a):
    return cp.ascontiguousarray(a, dtype=cp.float32)


def write(state, k, v, plan: StepPlan) -> None:
    """Cache k, v [n, Hkv, hd] (float32) at the step's slots and positions, each row
    quantized once into the state's types."""
    from .device import array_module
    cp = array_module(state.k)
    if plan.n:
        run(write_launch(state.kinds[0], _f32(cp, k), state.k, plan, state.ctx), cp)
        run(write_launch(state.kinds[1], _f32(cp, v), state.v, plan, state.ctx), cp)


def attend(state, q, out, plan: StepPlan, window: int | None) -> None:
    """out rows [n, Hq * hd] = each query's attention over its slot's keys (causal, within
    `window`), q [n, Hq, hd] scaled; the step's keys and values are written first."""
    from .device import array_module
    cp = array_module(state.k)
    q = _f32(cp, q)
    items = plan.items(window)
    if items.n:
        n_heads, hd, n_kv = q.shape[1], q.shape[2], state.k.shape[1]
        blocks = items.n * n_kv * -(-(n_heads // n_kv) // HEADS)
        splits = splits_for(blocks, items.longest)
        part = None if splits == 1 else \
            cp.empty((items.n, n_heads, splits, hd + 2), dtype=cp.float32)
        for launch in attend_launches(state.kinds, q, state.k, state.v, out, items,
                                      state.ctx, part):
            run(launch, cp)
    tiles = plan.tiles(chunk_geometry(q.shape[1], state.k.shape[1])[0])
    if tiles is not None:
        run(chunk_launch(state.kinds, q, state.k, state.v, out, tiles, state.ctx, window), cp)
