"""The one seam every projection goes through: x @ W for any way W is held.

W is a dense array [in, out] (fp32, or fp16 on a GPU), a QMatrix [out, in] in
its block format, or a list of QMatrix whose outputs are concatenated (a fused
projection whose parts differ in format). QMatrix products run the die's
kernels: worker/kernels_cpu.py on NumPy arrays, worker/kernels_cuda.py on CuPy
ones (imported only there).
"""
from __future__ import annotations

import numpy as np

from . import kernels_cpu
from .device import array_module
from .qmatrix import QMatrix

F32 = np.float32


def _kernels(a):
    if isinstance(a, np.ndarray):
        return kernels_cpu
    from . import kernels_cuda
    return kernels_cuda


def matmul(x, w):
    """x [T, in] float32 → [T, out] float32."""
    if isinstance(w, QMatrix):
        if isinstance(w.qs, np.ndarray):        # the CPU: a decode step makes ~100 calls
            if x.dtype != F32 or not x.flags.c_contiguous:
                x = np.ascontiguousarray(x, dtype=F32)
            return kernels_cpu.matmul(x, w)
        xp_x = x if x.flags.c_contiguous else x.copy()
        return _kernels(w.qs).matmul(xp_x.astype(F32, copy=False), w)
    if isinstance(w, list):
        outs = [matmul(x, part) for part in w]
        return array_module(outs[0]).concatenate(outs, axis=1)
    return (x.astype(w.dtype, copy=False) @ w).astype(F32, copy=False)


def gather_rows(w: QMatrix, ids):
    """Rows `ids` of a QMatrix as float32 [T, in] (an embedding lookup)."""
    return _kernels(w.qs).gather_rows(w, ids)


def is_quantized(w) -> bool:
    return isinstance(w, QMatrix) or isinstance(w, list)
