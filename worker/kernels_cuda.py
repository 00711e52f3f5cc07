"""CUDA kernels for y = x @ W.T with W a `QMatrix` (q4, q8, f16, bf16), via CuPy.

What the caller passes:
  x  cupy float32 [B, K], C-contiguous (a row slice of one is fine).
  m  a QMatrix whose arrays are cupy arrays (`m.to(cupy)`), C-contiguous, in the
     dtypes and shapes worker/qmatrix.py defines: q4 qs uint8 [N, K/2], q8 qs
     int8 [N, K] (bs 32 or 16), f16/bf16 qs uint16 [N, K]; scale/minv uint16
     fp16 bits [N, K/bs] (minv may be None). K must be a multiple of 8.
Entry points (each returns a new cupy float32 array, on the CuPy the weights live on:
cupy, or the emulated die's stand-in; CuPy is imported on first use, so importing this
module never needs it):
  matmul(x, m)               y [B, N]: the GEMV kernel for B <= GEMV_MAX_B, else the
                             tile path; path="gemv" or "tile" forces one.
  dequantize_rows(m, r0, r1) W rows [r0, r1) as float32 [r1 - r0, K].
  gather_rows(m, ids)        rows `ids` (embedding lookup) as float32 [T, K]; an id
                             outside [0, N) gives a row of NaN (nothing outside the
                             matrix is read).

The GEMV: 8 warps per block; a warp owns R output rows (R * NB <= 32 partial sums
per lane, NB = B rounded up to a power of two) and reads their weights once for
all B rows of x. Lanes take consecutive 8-element groups of a row (coalesced
loads), dequantize to registers and fold the block's scale and min in after the
dot: s * sum(q * x) + m * sum(x). The NB * R sums are reduced across the warp by
halving exchanges (31 shuffles for 32 sums, not 5 * 32); when rows are few and
long, `ksplit` warps share a row and add up through shared memory.
The tile path dequantizes row tiles to fp32 and multiplies with cuBLAS: the
reference, and the faster choice for long prefills.

Everything is fp32 arithmetic (compute_37: a K80 has no fast fp16 math, no dp4a).
fp16 bits become floats with cvt.f32.f16 on the device, bytes with the
2^23 trick (byte_perm into 0x4B0000xx, minus 2^23). The same source compiles on
the host under a small shim (worker/simt_host.py): the tests check its logic there, and
the emulated die (worker/emulated.py) runs it.
"""
from __future__ import annotations

import ctypes
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

GEMV_MAX_B = 32          # larger batches go through dequantized tiles + cuBLAS
NBS = (1, 2, 4, 8, 16, 32)
WARPS = 8                # warps per GEMV block (must match the source's WARPS)
TARGET_WARPS = 4096      # split rows across warps until a launch has about this many
TILE_ELEMS = 1 << 24     # fp32 elements per dequantized tile (64 MiB)
KIND_DTYPE = {"q4": np.uint8, "q8": np.int8, "f16": np.uint16, "bf16": np.uint16}

# fp16 bits -> float: cvt on the device, bit arithmetic under the host shim (both sources)
HALF_TO_FLOAT = r"""
__device__ __forceinline__ float half_to_float(unsigned short h) {
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
"""

SOURCE = r"""
#define KIND_Q4 0
#define KIND_Q8 1
#define KIND_F16 2
#define KIND_BF16 3
#define WARPS 8
#define FULL_MASK 0xffffffffu
typedef unsigned long long u64;

#define WEIGHT_PARAMS const unsigned char* __restrict__ qs, \
    const unsigned short* __restrict__ scale, const unsigned short* __restrict__ minv, \
    int has_min
#define GEMV_PARAMS WEIGHT_PARAMS, const float* __restrict__ x, float* __restrict__ y, \
    int N, int K, int B, int sshift, int ksplit
#define GEMV_ARGS qs, scale, minv, has_min, x, y, N, K, B, sshift, ksplit
#define ROWS_PARAMS WEIGHT_PARAMS, float* __restrict__ out, int r0, int n, int K, int sshift
#define ROWS_ARGS qs, scale, minv, has_min, out, r0, n, K, sshift
#define GATHER_PARAMS WEIGHT_PARAMS, const int* __restrict__ ids, float* __restrict__ out, \
    int n, int rows, int K, int sshift
#define GATHER_ARGS qs, scale, minv, has_min, ids, out, n, rows, K, sshift

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__host__ __device__ constexpr int ilog2(int v) { return v <= 1 ? 0 : 1 + ilog2(v / 2); }

""" + HALF_TO_FLOAT + r"""
/* byte i of v as a float: 0x4B0000xx is 2^23 + xx exactly. */
__device__ __forceinline__ float byte_f(unsigned v, int i, float bias) {
    return __int_as_float((int)__byte_perm(v, 0x4B000000u, 0x7440u | (unsigned)i)) - bias;
}

/* The 8-element group g of a row: elements [lo, lo + 4) and [hi, hi + 4).
   q4 keeps element i of a block in byte i's low nibble and i + 16 in its high one,
   so its group g is bytes 4g..4g+3 of the row: elements lo.. and lo + 16.. */
template <int KIND> __device__ __forceinline__ int group_lo(int g) {
    return KIND == KIND_Q4 ? ((g >> 2) << 5) | ((g & 3) << 2) : g << 3;
}
template <int KIND> __device__ __forceinline__ int group_hi(int g) {
    return group_lo<KIND>(g) + (KIND == KIND_Q4 ? 16 : 4);
}

/* The group's raw values (q4 0..15, q8 -128..127, floats as they are). */
template <int KIND>
__device__ __forceinline__ void load_group(const unsigned char* __restrict__ qs, u64 row,
                                           int K, int g, float q[8]) {
    if (KIND == KIND_Q4) {
        const unsigned v = __ldg((const unsigned*)(qs + row * (u64)(K >> 1)) + g);
        const unsigned lo = v & 0x0F0F0F0Fu, hi = (v >> 4) & 0x0F0F0F0Fu;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            q[i] = byte_f(lo, i, 8388608.0f);
            q[i + 4] = byte_f(hi, i, 8388608.0f);
        }
    } else if (KIND == KIND_Q8) {
        const uint2 v = __ldg((const uint2*)(qs + row * (u64)K) + g);
        const unsigned a = v.x ^ 0x80808080u, b = v.y ^ 0x80808080u;   /* q + 128 */
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            q[i] = byte_f(a, i, 8388736.0f);
            q[i + 4] = byte_f(b, i, 8388736.0f);
        }
    } else {
        const uint4 v = __ldg((const uint4*)(qs + row * (u64)K * 2u) + g);
        const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (KIND == KIND_F16) {
                q[2 * i] = half_to_float((unsigned short)(w[i] & 0xffffu));
                q[2 * i + 1] = half_to_float((unsigned short)(w[i] >> 16));
            } else {
                q[2 * i] = __int_as_float((int)(w[i] << 16));
                q[2 * i + 1] = __int_as_float((int)(w[i] & 0xffff0000u));
            }
        }
    }
}

/* Scale and min of the block holding element `lo` (every group lies in one block). */
template <int KIND>
__device__ __forceinline__ void load_scale(const unsigned short* __restrict__ scale,
                                           const unsigned short* __restrict__ minv,
                                           int has_min, u64 row, int K, int sshift, int lo,
                                           float& s, float& m) {
    if (KIND >= KIND_F16) {
        s = 1.0f;
        m = 0.0f;
        return;
    }
    const u64 i = row * (u64)(K >> sshift) + (u64)(lo >> sshift);
    s = half_to_float(__ldg(scale + i));
    m = has_min ? half_to_float(__ldg(minv + i)) : 0.0f;
}

/* Dequantize group g of `row` into dst (the row's fp32 output), rounding as
   matrices.dequantize does: q * s, then + m (no fused multiply-add). */
template <int KIND>
__device__ __forceinline__ void dequant_group(WEIGHT_PARAMS, u64 row, int K, int sshift,
                                              int g, float* __restrict__ dst) {
    float q[8], s, m;
    load_group<KIND>(qs, row, K, g, q);
    load_scale<KIND>(scale, minv, has_min, row, K, sshift, group_lo<KIND>(g), s, m);
    if (KIND < KIND_F16) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            q[i] = __fmul_rn(q[i], s);
            if (has_min) q[i] = __fadd_rn(q[i], m);      /* (no + 0: -0 stays -0) */
        }
    }
    *(float4*)(dst + group_lo<KIND>(g)) = make_float4(q[0], q[1], q[2], q[3]);
    *(float4*)(dst + group_hi<KIND>(g)) = make_float4(q[4], q[5], q[6], q[7]);
}

template <int KIND> __device__ __forceinline__ void dequant_rows(ROWS_PARAMS) {
    const int groups = K >> 3;
    const u64 total = (u64)n * (u64)groups;
    for (u64 u = (u64)blockIdx.x * blockDim.x + threadIdx.x; u < total;
         u += (u64)gridDim.x * blockDim.x) {
        const u64 i = u / (u64)groups;
        dequant_group<KIND>(qs, scale, minv, has_min, (u64)r0 + i, K, sshift,
                            (int)(u % (u64)groups), out + i * (u64)K);
    }
}

template <int KIND> __device__ __forceinline__ void gather_rows(GATHER_PARAMS) {
    const int groups = K >> 3;
    const u64 total = (u64)n * (u64)groups;
    for (u64 u = (u64)blockIdx.x * blockDim.x + threadIdx.x; u < total;
         u += (u64)gridDim.x * blockDim.x) {
        const u64 i = u / (u64)groups;
        const int g = (int)(u % (u64)groups), id = __ldg(ids + i);
        float* dst = out + i * (u64)K;
        if (id >= 0 && id < rows) {
            dequant_group<KIND>(qs, scale, minv, has_min, (u64)id, K, sshift, g, dst);
        } else {
            const float nan = __int_as_float(0x7fc00000);
            *(float4*)(dst + group_lo<KIND>(g)) = make_float4(nan, nan, nan, nan);
            *(float4*)(dst + group_hi<KIND>(g)) = make_float4(nan, nan, nan, nan);
        }
    }
}

/* Sum V values per lane across the warp. Each exchange halves what a lane holds:
   the lane whose bit o is set keeps the upper half and receives its partner's, the
   other keeps the lower. Afterwards lane l holds the total of value l >> (5 - log2 V)
   (V - 1 shuffles, then plain butterflies while lanes still share a value). */
template <int V, int STEP = 0>
__device__ __forceinline__ float spread_sum(float (&v)[V], int lane) {
    constexpr int o = 16 >> STEP, half = V >> (STEP + 1);
    if constexpr (half >= 1) {
        const bool upper = (lane & o) != 0;
#pragma unroll
        for (int i = 0; i < half; ++i) {
            const float send = upper ? v[i] : v[i + half];
            const float keep = upper ? v[i + half] : v[i];
            v[i] = keep + __shfl_xor_sync(FULL_MASK, send, o);
        }
    } else {
        v[0] += __shfl_xor_sync(FULL_MASK, v[0], o);
    }
    if constexpr (STEP < 4) return spread_sum<V, STEP + 1>(v, lane);
    return v[0];
}

/* y[b, n] = sum_k x[b, k] W[n, k] for b < B <= NB. Block: WARPS warps; `ksplit` of
   them share a group of R rows, each taking every ksplit-th 32-group stretch of K. */
template <int KIND, int NB> __device__ __forceinline__ void gemv(GEMV_PARAMS) {
    constexpr int R = 32 / NB < 4 ? 32 / NB : 4;
    constexpr int V = R * NB;
    __shared__ float red[WARPS][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int per_block = WARPS / ksplit, slot = warp / ksplit, split = warp % ksplit;
    const int row0 = (blockIdx.x * per_block + slot) * R;
    const int groups = K >> 3;
    u64 row[R];
#pragma unroll
    for (int r = 0; r < R; ++r) row[r] = (u64)imin(row0 + r, N - 1);  /* past N: unused */
    float acc[V];
#pragma unroll
    for (int i = 0; i < V; ++i) acc[i] = 0.0f;

    for (int g = split * 32 + lane; g < groups; g += ksplit * 32) {
        const int lo = group_lo<KIND>(g), hi = group_hi<KIND>(g);
        float q[R][8], s[R], m[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            load_group<KIND>(qs, row[r], K, g, q[r]);
            load_scale<KIND>(scale, minv, has_min, row[r], K, sshift, lo, s[r], m[r]);
        }
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            const float* xb = x + (u64)imin(b, B - 1) * (u64)K;       /* past B: unused */
            const float4 a = __ldg((const float4*)(xb + lo));
            const float4 c = __ldg((const float4*)(xb + hi));
            const float sx = ((a.x + a.y) + (a.z + a.w)) + ((c.x + c.y) + (c.z + c.w));
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float* w = q[r];
                const float d = ((w[0] * a.x + w[1] * a.y) + (w[2] * a.z + w[3] * a.w))
                              + ((w[4] * c.x + w[5] * c.y) + (w[6] * c.z + w[7] * c.w));
                if (KIND >= KIND_F16) acc[r * NB + b] += d;
                else acc[r * NB + b] += s[r] * d + m[r] * sx;
            }
        }
    }
    const float total = spread_sum<V>(acc, lane);
    if ((lane & ((32 / V) - 1)) == 0) red[warp][lane >> (5 - ilog2(V))] = total;
    __syncthreads();
    const int t = threadIdx.x;
    if (t < per_block * V) {
        const int own = t / V, i = t % V;
        float sum = 0.0f;
        for (int k = 0; k < ksplit; ++k) sum += red[own * ksplit + k][i];
        const int b = i % NB, n = (blockIdx.x * per_block + own) * R + i / NB;
        if (b < B && n < N) y[(u64)b * (u64)N + (u64)n] = sum;
    }
}

#define GEMV_KERNEL(KIND, NAME, NB) extern "C" __global__ void __launch_bounds__(256, 2) \
    gemv_##NAME##_##NB(GEMV_PARAMS) { gemv<KIND, NB>(GEMV_ARGS); }
#define KIND_KERNELS(KIND, NAME) \
    GEMV_KERNEL(KIND, NAME, 1) GEMV_KERNEL(KIND, NAME, 2) GEMV_KERNEL(KIND, NAME, 4) \
    GEMV_KERNEL(KIND, NAME, 8) GEMV_KERNEL(KIND, NAME, 16) GEMV_KERNEL(KIND, NAME, 32) \
    extern "C" __global__ void rows_##NAME(ROWS_PARAMS) { dequant_rows<KIND>(ROWS_ARGS); } \
    extern "C" __global__ void gather_##NAME(GATHER_PARAMS) { gather_rows<KIND>(GATHER_ARGS); }

KIND_KERNELS(KIND_Q4, q4)
KIND_KERNELS(KIND_Q8, q8)
KIND_KERNELS(KIND_F16, f16)
KIND_KERNELS(KIND_BF16, bf16)
"""

# kernel name → its parameter family (GEMV, ROWS, GATHER in the source)
KERNELS = {**{f"gemv_{k}_{nb}": "GEMV" for k in KIND_DTYPE for nb in NBS},
           **{f"rows_{k}": "ROWS" for k in KIND_DTYPE},
           **{f"gather_{k}": "GATHER" for k in KIND_DTYPE}}


@dataclass(frozen=True)
class Launch:
    """One kernel launch: the same plan runs on CuPy and under the host shim."""

    name: str
    grid: int
    block: int
    args: tuple          # arrays (of either module) and np.int32 scalars, in source order


# -- plans: pure functions of shapes, no CuPy ------------------------------------------

def check(m, x=None) -> None:
    """Assert what the kernels assume: dtypes, shapes, contiguity, alignment."""
    if m.kind not in KIND_DTYPE:
        raise ValueError(f"no CUDA kernel for QMatrix kind {m.kind!r}")
    if m.cols % 8:
        raise ValueError(f"CUDA kernels need K % 8 == 0, got K = {m.cols}")
    width = m.cols // 2 if m.kind == "q4" else m.cols
    _expect(m.qs, KIND_DTYPE[m.kind], (m.rows, width), "qs", align=16)
    if m.kind in ("q4", "q8"):
        if m.bs not in ((32,) if m.kind == "q4" else (32, 16)) or m.cols % m.bs:
            raise ValueError(f"{m.kind} with block size {m.bs} over K = {m.cols}")
        assert m.scale is not None, f"{m.kind} without scales"
        for name in ("scale", "minv"):
            if getattr(m, name) is not None:
                _expect(getattr(m, name), np.uint16, (m.rows, m.cols // m.bs), name)
    if x is not None:
        _expect(x, np.float32, (x.shape[0], m.cols), "x", align=16)


def _expect(a, dtype, shape, name, align=2) -> None:
    assert a.dtype == dtype, f"{name}: dtype {a.dtype}, want {np.dtype(dtype)}"
    assert tuple(a.shape) == tuple(shape), f"{name}: shape {a.shape}, want {shape}"
    assert a.flags.c_contiguous, f"{name} must be C-contiguous"
    ptr = a.data.ptr if hasattr(a.data, "ptr") else a.ctypes.data
    assert ptr % align == 0, f"{name} must be {align}-byte aligned"


def _weights(m) -> tuple:
    minv = m.minv if m.minv is not None else m.scale if m.scale is not None else m.qs
    scale = m.scale if m.scale is not None else m.qs     # never read for f16 / bf16
    sshift = int(m.bs).bit_length() - 1
    return m.qs, scale, minv, np.int32(m.minv is not None), sshift


def gemv_geometry(n: int, k: int, nb: int, ksplit: int | None = None) -> tuple[int, int]:
    """(grid, ksplit) for N rows of K: split rows across warps while the launch
    has fewer than TARGET_WARPS warps and each share keeps two 256-element stretches."""
    r = min(4, 32 // nb)
    if ksplit is None:
        stretches = -(-k // 256)
        ksplit = 1
        while ksplit < WARPS and -(-n // r) * ksplit < TARGET_WARPS and stretches >= 4 * ksplit:
            ksplit *= 2
    assert ksplit in (1, 2, 4, 8), ksplit
    return -(-n // ((WARPS // ksplit) * r)), ksplit


def gemv_launches(x, m, y, ksplit: int | None = None) -> list[Launch]:
    """y [B, N] = x [B, K] @ W.T, at most 32 rows of x per launch."""
    qs, scale, minv, has_min, sshift = _weights(m)
    out = []
    for b0 in range(0, x.shape[0], GEMV_MAX_B):
        b = min(GEMV_MAX_B, x.shape[0] - b0)
        nb = next(v for v in NBS if v >= b)
        grid, split = gemv_geometry(m.rows, m.cols, nb, ksplit)
        i32 = np.int32
        out.append(Launch(f"gemv_{m.kind}_{nb}", grid, 32 * WARPS,
                          (qs, scale, minv, has_min, x[b0:b0 + b], y[b0:b0 + b],
                           i32(m.rows), i32(m.cols), i32(b), i32(sshift), i32(split))))
    return out


def _grid(units: int) -> int:
    return max(1, min(-(-units // 256), 8192))


def rows_launch(m, r0: int, r1: int, out) -> Launch:
    qs, scale, minv, has_min, sshift = _weights(m)
    i32 = np.int32
    return Launch(f"rows_{m.kind}", _grid((r1 - r0) * (m.cols // 8)), 256,
                  (qs, scale, minv, has_min, out, i32(r0), i32(r1 - r0), i32(m.cols),
                   i32(sshift)))


def gather_launch(m, ids, out) -> Launch:
    qs, scale, minv, has_min, sshift = _weights(m)
    i32 = np.int32
    return Launch(f"gather_{m.kind}", _grid(ids.shape[0] * (m.cols // 8)), 256,
                  (qs, scale, minv, has_min, ids, out, i32(ids.shape[0]), i32(m.rows),
                   i32(m.cols), i32(sshift)))


# -- CuPy entry points --------------------------------------------------------------------

def _cupy(a):
    """The CuPy of array `a`: cupy itself, or the emulated one (worker/emulated.py)."""
    from .device import array_module
    return array_module(a)


@contextmanager
def keep_thread_locale():
    """NVRTC's compile (seen with 11.8) leaves the calling thread on a C locale of its
    own (uselocale), which turns Python's default text encoding into ASCII for the
    rest of the thread's life: put the thread's locale back afterwards."""
    try:
        libc = ctypes.CDLL(None)
        libc.uselocale.restype, libc.uselocale.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    except (OSError, AttributeError):
        yield
        return
    before = libc.uselocale(None)
    try:
        yield
    finally:
        libc.uselocale(before)


@lru_cache(maxsize=None)
def compiled(cp, source: str, first: str):
    """`source` compiled as a CuPy module: once per process and CuPy (which also caches
    the binary on disk); `first`, one of its kernels, is asked for to compile it now."""
    module = cp.RawModule(code=source, options=("--std=c++17",))
    with keep_thread_locale():
        module.get_function(first)                    # CuPy compiles on first use
    return module


@lru_cache(maxsize=None)
def _function(cp, name: str):
    return compiled(cp, SOURCE, next(iter(KERNELS))).get_function(name)


def run(launch: Launch, cp) -> None:
    _function(cp, launch.name)((launch.grid,), (launch.block,), launch.args)


def matmul(x, m, path: str = "auto"):
    """x [B, K] float32 @ W.T → y [B, N] float32 (a new cupy array)."""
    cp = _cupy(m.qs)
    assert isinstance(x, cp.ndarray) and x.ndim == 2, "x must be a 2-D cupy array"
    check(m, x)
    if path == "auto":
        path = "gemv" if x.shape[0] <= GEMV_MAX_B else "tile"
    y = cp.empty((x.shape[0], m.rows), dtype=cp.float32)
    if x.shape[0] == 0 or m.rows == 0:
        return y
    if path == "gemv":
        for launch in gemv_launches(x, m, y):
            run(launch, cp)
    elif path == "tile":
        step = max(1, TILE_ELEMS // m.cols)
        for r0 in range(0, m.rows, step):
            r1 = min(m.rows, r0 + step)
            tile = dequantize_rows(m, r0, r1)                     # [r1 - r0, K]
            if r1 - r0 == m.rows:
                cp.matmul(x, tile.T, out=y)
            else:
                y[:, r0:r1] = cp.matmul(x, tile.T)
    else:
        raise ValueError(f"path must be auto, gemv or tile, not {path!r}")
    return y


def dequantize_rows(m, r0: int = 0, r1: int | None = None):
    """W rows [r0, r1) as a new cupy float32 [r1 - r0, K]."""
    cp = _cupy(m.qs)
    r1 = m.rows if r1 is None else r1
    if not 0 <= r0 <= r1 <= m.rows:
        raise IndexError(f"rows [{r0}, {r1}) of a {m.rows}-row matrix")
    check(m)
    out = cp.empty((r1 - r0, m.cols), dtype=cp.float32)
    if r1 > r0:
        run(rows_launch(m, r0, r1, out), cp)
    return out


def gather_rows(m, ids):
    """Rows `ids` (any integer array, host or device) as a new cupy float32 [T, K]."""
    cp = _cupy(m.qs)
    check(m)
    ids = cp.ascontiguousarray(cp.asarray(ids).reshape(-1), dtype=cp.int32)
    out = cp.empty((ids.shape[0], m.cols), dtype=cp.float32)
    if ids.shape[0]:
        run(gather_launch(m, ids, out), cp)
    return out
