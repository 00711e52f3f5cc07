"""Run CUDA kernel source on the host: the emulated die's kernels, and the tests' check
of the kernels' logic where there is no GPU.

The source is compiled by g++ under a small shim. A launch runs each block in turn;
within a block every CUDA thread is a fiber (its own stack, switched cooperatively on
the calling OS thread), so __syncthreads is a barrier over the block's live threads
and __shfl_xor_sync / __shfl_sync an exchange fenced by a barrier over the warp: warp-synchronous
code behaves as on a GPU without assuming lockstep anywhere else, and a launch costs
a context switch per barrier, not an OS thread per CUDA thread. Threads that wait at
different barriers forever are a deadlock: the launch fails (LaunchError).
__shared__ becomes `static`, one block's shared memory because blocks never overlap:
launches run one at a time in a process (a lock; a worker's load thread and its loop
may both launch). Floating point is not contracted
(-ffp-contract=off): a kernel that rounds like NumPy gives NumPy's bits. Only what
worker/kernels_cuda.py and worker/attention_cuda.py use is emulated; the device-only
branches (#ifdef __CUDA_ARCH__) are not taken.

The kernels of a source are found in it (every `extern "C" __global__` function,
after the preprocessor), with their parameter types, so a launch checks what CuPy
would pass blindly: arrays must be NumPy arrays (the emulated die unwraps its own),
C-contiguous, of the parameter's element type (a byte pointer takes any); scalars of the parameter's size
(CuPy passes a Python int as 8 bytes).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..common import settings


class LaunchError(RuntimeError):
    """A kernel launch the host shim refuses or cannot finish."""


SHIM = r"""
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

struct dim3 { unsigned x, y, z; };
struct float4 { float x, y, z, w; };
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
static dim3 threadIdx, blockIdx, blockDim, gridDim;

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

/* -- fibers: one per CUDA thread of the running block -------------------------------- */
#if defined(__x86_64__)
/* the callee-saved registers and the stack pointer: all a cooperative switch keeps */
extern "C" void simt_switch(void** save_sp, void* load_sp);
asm(R"(
.text
.hidden simt_switch
.globl simt_switch
.type simt_switch,@function
simt_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
)");
#endif

enum { RUNNING, AT_BLOCK, AT_WARP, DONE };
struct Fiber {
#if defined(__x86_64__)
    void* sp;
#else
    ucontext_t ctx;
#endif
    int state;
    unsigned gen;        /* the generation of the barrier it waits at */
    unsigned shuffles;   /* exchanges made: which buffer the next one uses */
};
static const size_t STACK = 64 * 1024;
static std::vector<Fiber> fibers;
static std::vector<char*> stacks;
static const std::function<void()>* body;
static unsigned current, live, block_arrived, block_gen;
static unsigned warp_live[32], warp_arrived[32], warp_gen[32];
static float exchange[2][1024];
#if defined(__x86_64__)
static void* scheduler_sp;
#else
static ucontext_t scheduler_ctx;
#endif

static inline void to_scheduler() {
#if defined(__x86_64__)
    simt_switch(&fibers[current].sp, scheduler_sp);
#else
    swapcontext(&fibers[current].ctx, &scheduler_ctx);
#endif
}

static void release_block() {
    if (block_arrived && block_arrived == live) { block_arrived = 0; ++block_gen; }
}
static void release_warp(unsigned w) {
    if (warp_arrived[w] && warp_arrived[w] == warp_live[w]) { warp_arrived[w] = 0; ++warp_gen[w]; }
}

static inline void __syncthreads() {
    Fiber& f = fibers[current];
    f.state = AT_BLOCK;
    f.gen = block_gen;
    ++block_arrived;
    release_block();
    to_scheduler();
}
static inline void warp_barrier() {
    const unsigned w = threadIdx.x / 32;
    Fiber& f = fibers[current];
    f.state = AT_WARP;
    f.gen = warp_gen[w];
    ++warp_arrived[w];
    release_warp(w);
    to_scheduler();
}
/* One barrier per exchange: two buffers in turn, since no thread can be two exchanges
   ahead of another (it would have passed a barrier the other has not reached). */
static inline float __shfl_xor_sync(unsigned, float v, int o) {
    const unsigned t = threadIdx.x;
    float* buf = exchange[fibers[current].shuffles++ & 1];
    buf[t] = v;
    warp_barrier();
    return buf[(t & ~31u) | ((t & 31u) ^ (unsigned)o)];
}

static inline float __shfl_sync(unsigned, float v, int src) {
    const unsigned t = threadIdx.x;
    float* buf = exchange[fibers[current].shuffles++ & 1];
    buf[t] = v;
    warp_barrier();
    return buf[(t & ~31u) | ((unsigned)src & 31u)];
}

static void fiber_main() {
    (*body)();
    fibers[current].state = DONE;
    --live;
    --warp_live[threadIdx.x / 32];
    release_block();                  /* an exited thread no longer holds a barrier up */
    release_warp(threadIdx.x / 32);
#if defined(__x86_64__)
    simt_switch(&fibers[current].sp, scheduler_sp);   /* never resumed */
#endif
}

static void start_fiber(unsigned t) {
    Fiber& f = fibers[t];
    f.state = RUNNING;
    f.shuffles = 0;
#if defined(__x86_64__)
    /* the first switch pops six zero registers, then "returns" into fiber_main with the
       stack aligned as after a call */
    uintptr_t top = ((uintptr_t)(stacks[t] + STACK)) & ~(uintptr_t)15;
    void** sp = (void**)(top - 8);
    *sp = nullptr;
    *--sp = (void*)&fiber_main;
    for (int i = 0; i < 6; ++i) *--sp = nullptr;
    f.sp = sp;
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = stacks[t];
    f.ctx.uc_stack.ss_size = STACK;
    f.ctx.uc_link = &scheduler_ctx;
    makecontext(&f.ctx, fiber_main, 0);
#endif
}

static inline bool runnable(const Fiber& f, unsigned t) {
    if (f.state == RUNNING) return true;
    if (f.state == AT_BLOCK) return f.gen != block_gen;
    if (f.state == AT_WARP) return f.gen != warp_gen[t / 32];
    return false;
}

/* 0, or 1 when the block's threads wait at barriers that can never open */
static int launch(unsigned grid, unsigned block, const std::function<void()>& fn) {
    gridDim = {grid, 1, 1};
    blockDim = {block, 1, 1};
    body = &fn;
    fibers.resize(block);
    while (stacks.size() < block) stacks.push_back((char*)std::malloc(STACK));
    for (unsigned b = 0; b < grid; ++b) {
        blockIdx = {b, 0, 0};
        live = block;
        block_arrived = block_gen = 0;
        for (unsigned w = 0; w < 32; ++w) {
            warp_arrived[w] = warp_gen[w] = 0;
            warp_live[w] = w * 32 < block ? (block - w * 32 < 32 ? block - w * 32 : 32) : 0;
        }
        for (unsigned t = 0; t < block; ++t) start_fiber(t);
        while (live) {
            bool moved = false;
            for (unsigned t = 0; t < block; ++t) {
                Fiber& f = fibers[t];
                if (!runnable(f, t)) continue;
                f.state = RUNNING;
                current = t;
                threadIdx = {t, 0, 0};
#if defined(__x86_64__)
                simt_switch(&scheduler_sp, f.sp);
#else
                swapcontext(&scheduler_ctx, &f.ctx);
#endif
                moved = true;
            }
            if (!moved) return 1;
        }
    }
    return 0;
}
#define HOST_ENTRY(name, PARAMS, ARGS) extern "C" __attribute__((visibility("default"))) \
    int host_##name(unsigned grid, \
    unsigned block, PARAMS) { return launch(grid, block, [=] { name(ARGS); }); }
"""

# C element types → (NumPy kind class, bytes): "f" floats, "i" any integer (or bool)
C_TYPES = {"float": ("f", 4), "double": ("f", 8), "__half": ("f", 2), "half": ("f", 2),
           "bool": ("i", 1), "char": ("i", 1), "signed char": ("i", 1),
           "unsigned char": ("i", 1), "int8_t": ("i", 1), "uint8_t": ("i", 1),
           "short": ("i", 2), "unsigned short": ("i", 2), "int16_t": ("i", 2),
           "uint16_t": ("i", 2), "int": ("i", 4), "unsigned": ("i", 4),
           "unsigned int": ("i", 4), "int32_t": ("i", 4), "uint32_t": ("i", 4),
           "long long": ("i", 8), "unsigned long long": ("i", 8), "int64_t": ("i", 8),
           "uint64_t": ("i", 8), "size_t": ("i", 8), "long": ("i", 8),
           "unsigned long": ("i", 8)}
QUALIFIERS = re.compile(r"\b(const|volatile|__restrict__|restrict|__restrict)\b")
KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?'
                    r'(\w+)\s*\(([^)]*)\)')
TYPEDEF = re.compile(r"\btypedef\s+([\w\s]+?)\s+(\w+)\s*;")
SCALARS = {("f", 4): ctypes.c_float, ("f", 8): ctypes.c_double, ("i", 1): ctypes.c_int8,
           ("i", 2): ctypes.c_int16, ("i", 4): ctypes.c_int32, ("i", 8): ctypes.c_int64}


@dataclass(frozen=True)
class Param:
    """One kernel parameter: its C type and what an argument for it must be."""

    name: str
    ctype: str            # as declared, qualifiers dropped: "float*", "int"
    pointer: bool
    kind: str             # "f" or "i"
    size: int             # bytes of one element (or of the scalar)


def preprocess(source: str) -> str:
    done = subprocess.run(["g++", "-E", "-P", "-x", "c++", "-std=c++17", "-"], input=source,
                          capture_output=True, text=True)
    if done.returncode:
        raise LaunchError(f"g++ -E failed on the kernel source:\n{done.stderr[-4000:]}")
    return done.stdout


def kernel_params(source: str) -> dict[str, list[Param]]:
    """Every `extern "C" __global__` kernel of the (preprocessed) source → its params."""
    typedefs = {alias: " ".join(real.split()) for real, alias in TYPEDEF.findall(source)}
    out = {}
    for name, params in KERNEL.findall(source):
        out[name] = [_param(p, typedefs, name) for p in params.split(",") if p.strip()]
    return out


def _param(text: str, typedefs: dict, kernel: str) -> Param:
    words = QUALIFIERS.sub(" ", text).replace("*", " * ").split()
    name, pointer = words[-1], words.count("*")
    base = " ".join(w for w in words[:-1] if w != "*")
    base = typedefs.get(base, base)
    if pointer > 1 or base not in C_TYPES:
        raise LaunchError(f"kernel {kernel}: parameter {text.strip()!r} is not a type the "
                          "host shim passes")
    kind, size = C_TYPES[base]
    return Param(name, base + "*" * pointer, bool(pointer), kind, size)


def _kind(dtype: np.dtype) -> str:
    return "f" if dtype.kind == "f" else "i" if dtype.kind in "iub" else dtype.kind


class HostKernels:
    """The kernels of one source as a shared library; `launch` runs one as a device would."""

    running = threading.Lock()      # one launch at a time: the shim's state is global

    def __init__(self, source: str, folder: Path | None = None):
        if shutil.which("g++") is None:
            raise LaunchError("the host shim compiles kernels with g++, which is not on PATH")
        self.params = kernel_params(preprocess(source))
        entries = "\n".join(
            f"HOST_ENTRY({name}, PARAMS_ARGS({', '.join(p.ctype + ' ' + p.name for p in ps)}),"
            f" PARAMS_ARGS({', '.join(p.name for p in ps)}))"
            for name, ps in self.params.items())
        text = (SHIM + source + "\n#define PARAMS_ARGS(...) __VA_ARGS__\n" + entries + "\n")
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        folder = folder or settings.cache_dir() / "kernels"
        folder.mkdir(parents=True, exist_ok=True)
        lib = folder / f"simt-host-{digest}.so"
        if not lib.exists():
            fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so")
            os.close(fd)
            cpp = Path(tmp).with_suffix(".cpp")
            cpp.write_text(text)
            done = subprocess.run(["g++", "-std=c++17", "-O1", "-fPIC", "-shared",
                                   "-ffp-contract=off", "-fvisibility=hidden",   # no interposition
                                   "-Wno-unknown-pragmas", "-o", tmp,
                                   str(cpp)], capture_output=True, text=True)
            cpp.unlink()
            if done.returncode:
                os.unlink(tmp)
                raise LaunchError(f"g++ failed on the kernel source:\n{done.stderr[-4000:]}")
            os.replace(tmp, lib)        # atomic: a concurrent builder sees all or nothing
        self.lib = ctypes.CDLL(str(lib))

    def run(self, launch) -> None:
        """A `kernels_cuda.Launch` (name, grid, block, args)."""
        self.launch(launch.name, launch.grid, launch.block, launch.args)

    def launch(self, name: str, grid: int, block: int, args) -> None:
        params = self.params.get(name)
        if params is None:
            raise LaunchError(f"no kernel {name!r} in the source")
        if not 0 < block <= 1024 or block % 32 or grid < 1:
            raise LaunchError(f"kernel {name}: grid {grid} x block {block} (a block is 32 to "
                              "1024 threads, whole warps)")
        if len(args) != len(params):
            raise LaunchError(f"kernel {name} takes {len(params)} arguments, got {len(args)}")
        c_args = [ctypes.c_uint(grid), ctypes.c_uint(block)]
        c_args += [self.argument(name, p, a) for p, a in zip(params, args)]
        with self.running:
            failed = getattr(self.lib, f"host_{name}")(*c_args)
        if failed:
            raise LaunchError(f"kernel {name}: its threads wait at barriers that never open")

    @staticmethod
    def argument(kernel: str, p: Param, a):
        where = f"kernel {kernel}, parameter {p.name} ({p.ctype})"
        if p.pointer:
            if not isinstance(a, np.ndarray):
                raise LaunchError(f"{where}: an array is needed, got {type(a).__name__}")
            bytes_ = p.kind == "i" and p.size == 1          # a byte pointer reads anything
            if not bytes_ and (_kind(a.dtype) != p.kind or a.dtype.itemsize != p.size):
                raise LaunchError(f"{where}: dtype {a.dtype} does not match")
            if not a.flags.c_contiguous:
                raise LaunchError(f"{where}: the array is not C-contiguous")
            return ctypes.c_void_p(a.ctypes.data)
        if isinstance(a, (bool, int, float)):       # CuPy sends int as 8 bytes, float as 8
            a = np.int64(a) if isinstance(a, int) else np.float64(a)
        if not isinstance(a, np.generic) or _kind(a.dtype) != p.kind or \
                a.dtype.itemsize != p.size:
            raise LaunchError(f"{where}: got {type(a).__name__} "
                              f"({getattr(a, 'dtype', '?')}), not a scalar of its type")
        signed = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
        value = a.view(signed[p.size]) if p.kind == "i" else a
        return SCALARS[p.kind, p.size](value.item())
