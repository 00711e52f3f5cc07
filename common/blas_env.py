"""The one place Pantheon writes its own environment: OpenBLAS's settings, which OpenBLAS
reads once, when NumPy loads it, so they must be in place before anything imports NumPy
(`pantheon`'s entry point calls `apply()` first thing). Every other setting travels as
an argument or in a wire message; the CPU kernels run all their parallel loops on their
own thread pool (no OpenMP), sized by the cores the process may use. `apply()` also sets
the C allocator's one setting the engine depends on (`TOP_PAD_BYTES`, below).
"""
from __future__ import annotations

import os

DEFAULTS = {
    # OpenBLAS's idle threads spin 2^28 cycles (~0.1 s) after each call by default, on
    # the cores the worker's own kernels need next (a Qwen2.5-1.5B prefill: 40 tok/s with
    # that spin, 51 with 2^16 cycles)
    "OPENBLAS_THREAD_TIMEOUT": "16",
    # One owner of a worker's cores: the kernels' pool. BLAS runs one thread per caller
    # (the tile products split W's rows over the kernels' threads themselves); OpenBLAS's
    # own threads fought the pool for the cores (SmolLM2, AVX2 build, 2 cores: TTFT of a
    # 64-token prompt 3.3 s with them, 0.27 s without)
    "OPENBLAS_NUM_THREADS": "1",
}


# glibc's malloc keeps this much free memory at the top of its heap when it trims it,
# and takes this much more when it grows it. Without it a prefill chunk's temporaries
# (Qwen2.5-1.5B, 128 tokens: tens of MB) were handed back to the kernel at each free and
# faulted in again, zeroed, at the next allocation: 6 % of a prefill in clear_page
# (perf), and `bench engine` prefill 105.7-107.9 -> 117.0-119.1 tok/s with 64 MiB,
# native build, alternated, the same peak RSS. (The operator's MALLOC_TOP_PAD_, read by
# glibc at start, wins.)
TOP_PAD_BYTES = 64 << 20
M_TOP_PAD = -2                  # mallopt's parameter number (malloc.h)


def tune_malloc() -> bool:
    """Set glibc's top pad (where the C library is glibc and the operator has not set
    it); whether it was set."""
    import ctypes
    import ctypes.util
    if "MALLOC_TOP_PAD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_TOP_PAD, TOP_PAD_BYTES))
    except (OSError, AttributeError):        # not glibc: its allocator as it is
        return False


def apply() -> None:
    """Set each default the operator has not set, and the allocator's top pad."""
    for name, value in DEFAULTS.items():
        os.environ.setdefault(name, value)
    tune_malloc()
