"""The one place Pantheon writes its own environment: OpenBLAS's settings, which OpenBLAS
reads once, when NumPy loads it, so they must be in place before anything imports NumPy
(`pantheon`'s entry point calls `apply()` first thing). Every other setting travels as
an argument or in a wire message; the CPU kernels run all their parallel loops on their
own thread pool (no OpenMP), sized by the cores the process may use.
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


def apply() -> None:
    """Set each default the operator has not set."""
    for name, value in DEFAULTS.items():
        os.environ.setdefault(name, value)
