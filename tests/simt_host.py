"""Run CUDA kernel source on the host, to check its logic where there is no GPU.

The source is compiled by g++ under a small shim, and a launch runs each block
in turn with one real thread per CUDA thread: __syncthreads is a barrier over
the block and __shfl_xor_sync an exchange fenced by a barrier over the warp, so
warp-synchronous code behaves as on a GPU without assuming lockstep anywhere
else. __shared__ becomes `static`, which is one block's shared memory because
blocks never overlap. Floating point is not contracted (-ffp-contract=off): a
kernel that rounds like NumPy gives NumPy's bits. Only what worker/kernels_cuda.py
uses is emulated; the device-only branches (#ifdef __CUDA_ARCH__) are not taken.
"""
from __future__ import annotations

import ctypes
import hashlib
import subprocess
from pathlib import Path

import numpy as np

SHIM = r"""
#include <pthread.h>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

struct dim3 { unsigned x, y, z; };
struct float4 { float x, y, z, w; };
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
static thread_local dim3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

template <class T> static inline T __ldg(const T* p) { return *p; }
static inline float __int_as_float(int v) { float f; std::memcpy(&f, &v, 4); return f; }
static inline int __float_as_int(float f) { int v; std::memcpy(&v, &f, 4); return v; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const uint64_t bytes = x | (uint64_t)y << 32;
    unsigned r = 0;
    for (int k = 0; k < 4; ++k)
        r |= (unsigned)((bytes >> (8 * ((s >> (4 * k)) & 7))) & 0xff) << (8 * k);
    return r;
}

static pthread_barrier_t block_barrier, warp_barrier[32];
static float exchange[1024];
static inline void __syncthreads() { pthread_barrier_wait(&block_barrier); }
static inline float __shfl_xor_sync(unsigned, float v, int o) {
    const unsigned t = threadIdx.x, w = t / 32;
    exchange[t] = v;
    pthread_barrier_wait(&warp_barrier[w]);
    const float r = exchange[(t & ~31u) | ((t & 31u) ^ (unsigned)o)];
    pthread_barrier_wait(&warp_barrier[w]);
    return r;
}

struct Thread { const std::function<void()>* body; unsigned block, thread; };
static void* thread_main(void* p) {
    const Thread* t = (const Thread*)p;
    blockIdx = {t->block, 0, 0};
    threadIdx = {t->thread, 0, 0};
    (*t->body)();
    return nullptr;
}
static void launch(unsigned grid, unsigned block, const std::function<void()>& body) {
    gridDim = {grid, 1, 1};
    blockDim = {block, 1, 1};
    std::vector<pthread_t> ids(block);
    std::vector<Thread> args(block);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 1 << 18);
    for (unsigned b = 0; b < grid; ++b) {
        pthread_barrier_init(&block_barrier, nullptr, block);
        for (unsigned w = 0; w < block / 32; ++w) pthread_barrier_init(&warp_barrier[w], nullptr, 32);
        for (unsigned t = 0; t < block; ++t) {
            args[t] = {&body, b, t};
            pthread_create(&ids[t], &attr, thread_main, &args[t]);
        }
        for (unsigned t = 0; t < block; ++t) pthread_join(ids[t], nullptr);
        pthread_barrier_destroy(&block_barrier);
        for (unsigned w = 0; w < block / 32; ++w) pthread_barrier_destroy(&warp_barrier[w]);
    }
    pthread_attr_destroy(&attr);
}
#define HOST_ENTRY(name, PARAMS, ARGS) extern "C" void host_##name(unsigned grid, \
    unsigned block, PARAMS) { launch(grid, block, [=] { name(ARGS); }); }
"""


class HostKernels:
    """The kernels of one source as a shared library; `run(launch)` as on a device."""

    def __init__(self, source: str, kernels: dict[str, str], folder: Path):
        entries = "\n".join(f"HOST_ENTRY({name}, {family}_PARAMS, {family}_ARGS)"
                            for name, family in kernels.items())
        text = SHIM + source + "\n" + entries + "\n"
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        folder.mkdir(parents=True, exist_ok=True)
        cpp, lib = folder / f"kernels-{digest}.cpp", folder / f"kernels-{digest}.so"
        if not lib.exists():
            cpp.write_text(text)
            done = subprocess.run(["g++", "-std=c++17", "-O1", "-fPIC", "-shared", "-pthread",
                                   "-ffp-contract=off", "-Wno-unknown-pragmas", "-o", str(lib),
                                   str(cpp)], capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"g++ failed on {cpp}:\n{done.stderr[-4000:]}")
        self.lib = ctypes.CDLL(str(lib))

    def run(self, launch) -> None:
        assert launch.block % 32 == 0 and launch.block <= 1024, launch.block
        args = [ctypes.c_uint(launch.grid), ctypes.c_uint(launch.block)]
        for a in launch.args:
            if isinstance(a, np.ndarray):
                assert a.flags.c_contiguous
                args.append(ctypes.c_void_p(a.ctypes.data))
            else:
                args.append(ctypes.c_int(int(a)))
        getattr(self.lib, f"host_{launch.name}")(*args)
