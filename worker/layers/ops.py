"""Pure operations every layer uses, over the array module of their input (NumPy or
CuPy). Activations are float32 throughout; Python-float constants stay weak, so they
never promote an array to float64."""
from __future__ import annotations

import numpy as np

from .. import kernels_cpu
from ..device import array_module
from ..linear import matmul

F32 = np.float32


def xp_of(a):
    return np if isinstance(a, np.ndarray) else array_module(a)


def rms_norm(x, w, eps: float):
    """x [..., d] normalized by its root mean square, times w [d]."""
    if isinstance(x, np.ndarray):       # the CPU: one C call (another layout: a copy first,
        y = kernels_cpu.rms_norm(x, w, eps)     # so a row's result never depends on it)
        if y is None and x.ndim >= 1 and x.size and x.dtype == F32:
            y = kernels_cpu.rms_norm(np.ascontiguousarray(x).reshape(-1, x.shape[-1]), w, eps)
            y = None if y is None else y.reshape(x.shape)
        if y is not None:
            return y
    xp = xp_of(x)
    ms = (x * x).mean(axis=-1, keepdims=True)
    return x * (1.0 / xp.sqrt(ms + eps)) * w


def linear(x, w, b=None):
    """x [T, in] @ W (+ b) → [T, out] float32, W held any way (worker/linear.py)."""
    y = matmul(x, w)
    if b is not None:
        y += b
    return y


def rope(x, cos, sin, scale: float = 1.0):
    """Rotate-half rotary embedding of the first 2 * cos.shape[-1] dims of each head,
    times scale.

    x [T, H, hd]; cos, sin [T, 1, r/2] with r <= hd (r < hd: partial rotary, the rest
    passes through)."""
    if isinstance(x, np.ndarray):       # the CPU: one C call where the layout allows
        y = kernels_cpu.rope(x, cos, sin, scale)
        if y is not None:
            return y
    xp = xp_of(x)
    half = cos.shape[-1]
    if 2 * half == x.shape[-1]:
        x1, x2 = x[..., :half], x[..., half:]
        y = xp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    else:
        x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
        y = xp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
    return y if scale == 1.0 else y * scale


def silu(x):
    """x * sigmoid(x), written with tanh so large |x| never overflows exp."""
    return x * (0.5 + 0.5 * xp_of(x).tanh(0.5 * x))


def sigmoid(x):
    """1 / (1 + exp(-x)), as tanh: no overflow."""
    return 0.5 + 0.5 * xp_of(x).tanh(0.5 * x)


def softplus(x):
    """log(1 + exp(x)) without overflow."""
    xp = xp_of(x)
    return xp.maximum(x, 0) + xp.log1p(xp.exp(-xp.abs(x)))


def l2_normalize(x, eps: float = 1e-6):
    """x [..., d] * rsqrt(sum(x²) + eps), as transformers' (and FLA's) l2norm."""
    return x * (1.0 / xp_of(x).sqrt((x * x).sum(axis=-1, keepdims=True) + eps))


def gated_rms_norm(o, z, w, eps: float):
    """rms_norm(o, w) * silu(z): a gated output norm. o, z [..., d]; w [d]."""
    return rms_norm(o, w, eps) * silu(z)


GELU_C = float(np.sqrt(2.0 / np.pi))


def gelu_tanh(x):
    """GELU, tanh approximation (PyTorch's gelu(approximate="tanh"))."""
    return 0.5 * x * (1.0 + xp_of(x).tanh(GELU_C * (x + 0.044715 * (x * x * x))))


ACTIVATIONS = {"silu": silu, "gelu_tanh": gelu_tanh}
