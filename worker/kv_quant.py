"""q8_0 / q4_0 rows of a KV cache in NumPy (or CuPy): the reference the C attention is
tested against, and the path of a die without the C kernels. Layouts and rounding as
llama.cpp's reference quantizers (common/kv_cache.py has the block layouts).

quantize(x [..., hd] float32, kind) → uint8 [..., row_bytes]; dequantize(rows, kind,
hd) → float32 [..., hd]. fp32 and fp16 "rows" are the arrays themselves.
"""
from __future__ import annotations

import numpy as np

from ..common.kv_cache import BLOCK, row_bytes
from .device import array_module

F32, F16 = np.float32, np.float16


def _xp(a):
    return np if isinstance(a, np.ndarray) else array_module(a)


def storage(kind: str, shape: tuple, head_dim: int):
    """(dtype, shape) of a cache of `shape` [..., head_dim] held as `kind`."""
    if kind == "f32":
        return F32, shape
    if kind == "f16":
        return F16, shape
    return np.uint8, shape[:-1] + (row_bytes(kind, head_dim),)


def quantize(x, kind: str):
    """float rows [..., hd] → stored rows of `kind`."""
    xp = _xp(x)
    if kind == "f32":
        return x.astype(F32, copy=False)
    if kind == "f16":
        return x.astype(F16)
    x = x.astype(F32, copy=False)
    lead, hd = x.shape[:-1], x.shape[-1]
    blocks = x.reshape(lead + (hd // BLOCK, BLOCK))
    if kind == "q8_0":
        d = xp.abs(blocks).max(axis=-1, keepdims=True) / F32(127)
        inv = xp.where(d != 0, F32(1) / xp.where(d != 0, d, F32(1)), F32(0)).astype(F32)
        y = blocks * inv
        qs = (xp.sign(y) * xp.floor(xp.abs(y) + F32(0.5))).astype(np.int8)  # roundf
        body = qs.view(np.uint8)
    elif kind == "q4_0":
        at = xp.abs(blocks).argmax(axis=-1)[..., None]          # the first largest |x|
        d = xp.take_along_axis(blocks, at, axis=-1) / F32(-8)
        inv = xp.where(d != 0, F32(1) / xp.where(d != 0, d, F32(1)), F32(0)).astype(F32)
        q = xp.minimum((blocks * inv + F32(8.5)).astype(np.int8), 15).astype(np.uint8)
        body = q[..., :16] | (q[..., 16:] << 4)
    else:
        raise ValueError(f"unknown KV type {kind!r}")
    scale = xp.ascontiguousarray(d.astype(F16)).view(np.uint8)  # [..., nb, 2]
    return xp.concatenate([scale, body], axis=-1).reshape(lead + (-1,))


def dequantize(rows, kind: str, head_dim: int):
    """Stored rows of `kind` → float32 [..., head_dim]."""
    xp = _xp(rows)
    if kind in ("f32", "f16"):
        return rows.astype(F32, copy=False)
    lead = rows.shape[:-1]
    per = 34 if kind == "q8_0" else 18
    blocks = xp.ascontiguousarray(rows).reshape(lead + (head_dim // BLOCK, per))
    d = blocks[..., :2].copy().view(F16).astype(F32)            # [..., nb, 1]
    if kind == "q8_0":
        q = blocks[..., 2:].copy().view(np.int8).astype(F32)
    else:
        b = blocks[..., 2:]
        q = xp.concatenate([b & 15, b >> 4], axis=-1).astype(F32) - F32(8)
    return (q * d).reshape(lead + (head_dim,))
