"""Repacking GGUF blocks into the kinds a die holds (worker/qmatrix.py), in NumPy.

Each repacker takes blocks (n, block bytes) uint8 and returns (qs, scale, minv): the
values already in the kind's layout, fp16 bits of a scale (and a min, or None) per run
of the kind's block size; common/formats.py names the repacker of each type and die.
A K-quant's sub-block scale is the product of an fp16 and a small integer, stored here
as one fp16 (a relative error below 2^-11; the format's own step is 1/4 to 1/64 of the
block's range); every other repack is exact.
"""
from __future__ import annotations

import numpy as np

from .block_decode import _q3_k_codes, _q3_k_scales, _two_bits, iq4_levels, iq4_xs_scales

# -- fp16 helpers -------------------------------------------------------------------

def f16_bits(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).astype(np.float16).view(np.uint16)


def half(bits) -> np.ndarray:
    return np.asarray(bits).view(np.float16).astype(np.float32)


# -- reading GGUF blocks --------------------------------------------------------------

def _h(b, off):
    """The fp16 field at byte `off` of each block, as float32 (n, 1)."""
    return np.ascontiguousarray(b[:, off:off + 2]).view(np.float16).astype(np.float32)


def _hbits(b, off):
    return np.ascontiguousarray(b[:, off:off + 2]).view(np.uint16)


def _nib(qs):
    """(..., k) bytes → (..., 2k): low nibbles, then high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _pack4(v):
    """(..., 32) values 0..15 → (..., 16) bytes: element i low, i + 16 high."""
    return (v[..., :16] | (v[..., 16:] << 4)).astype(np.uint8)


def _bits32(qh):
    return ((qh[:, :, None] >> np.arange(8, dtype=np.uint8)) & 1).reshape(qh.shape[0], 32)


def _k_scales(s):
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


# Each repacker: blocks (n, type_size) uint8 → (qs, scale, minv) per 32 (or 16) elements,
# qs already in the kind's layout, rows of the result = n * (elements per block) / bs.
def _r_q8_0(b):
    return b[:, 2:34].view(np.int8), _hbits(b, 0), None


def _r_q4_0(b):
    d = _h(b, 0)
    return b[:, 2:18], _hbits(b, 0), f16_bits(-8.0 * d)


def _r_q4_1(b):
    return b[:, 4:20], _hbits(b, 0), _hbits(b, 2)


def _r_q5_0(b):
    q = (_nib(b[:, 6:22]) | (_bits32(b[:, 2:6]) << 4)).view(np.int8) - np.int8(16)
    return q, _hbits(b, 0), None


def _r_q5_1(b):
    q = (_nib(b[:, 8:24]) | (_bits32(b[:, 4:8]) << 4)).view(np.int8)
    return q, _hbits(b, 0), _hbits(b, 2)


def _r_q4_k(b, out=None):
    # group g of 32 bytes holds sub-block 2g in its low nibbles, 2g + 1 in its high ones;
    # a q4 block wants element i low and i + 16 high: move nibbles, never unpack them
    n = b.shape[0]
    d, dmin = _h(b, 0), _h(b, 2)
    sc, mn = _k_scales(b[:, 4:16])
    g = b[:, 16:144].reshape(n, 4, 32)
    out = np.empty((n, 128), dtype=np.uint8) if out is None else out
    q = out.reshape(n, 4, 2, 16)
    lo, hi = g[:, :, :16], g[:, :, 16:]
    np.left_shift(hi, 4, out=q[:, :, 0])
    q[:, :, 0] |= lo & 0x0F
    np.bitwise_and(hi, 0xF0, out=q[:, :, 1])
    q[:, :, 1] |= lo >> 4
    return out, f16_bits(d * sc), f16_bits(-(dmin * mn))


def _r_q5_k(b):
    n = b.shape[0]
    d, dmin = _h(b, 0), _h(b, 2)
    sc, mn = _k_scales(b[:, 4:16])
    qh = (b[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    q = _nib(b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32) | (qh << 4)
    return q.reshape(n, 256).view(np.int8), f16_bits(d * sc), f16_bits(-(dmin * mn))


def _r_q6_k(b, out=None):
    # per half of 128: y[l] = lo4(ql[l]) | qh[l] bits 0-1 << 4, y[l+32] = lo4(ql[l+32]) |
    # bits 2-3, y[l+64] = hi4(ql[l]) | bits 4-5, y[l+96] = hi4(ql[l+32]) | bits 6-7
    n = b.shape[0]
    d = _h(b, 208)
    scale = b[:, 192:208].view(np.int8).astype(np.float32)
    ql, qh = b[:, 0:128].reshape(n, 2, 64), b[:, 128:192].reshape(n, 2, 32)
    res = np.empty((n, 256), dtype=np.int8) if out is None else out
    q = res.view(np.uint8).reshape(n, 2, 4, 32)
    q[:, :, 0] = (ql[:, :, :32] & 0x0F) | ((qh & 0x03) << 4)
    q[:, :, 1] = (ql[:, :, 32:] & 0x0F) | ((qh & 0x0C) << 2)
    q[:, :, 2] = (ql[:, :, :32] >> 4) | (qh & 0x30)
    q[:, :, 3] = (ql[:, :, 32:] >> 4) | ((qh & 0xC0) >> 2)
    res -= np.int8(32)
    return res, f16_bits(d * scale), None


def _r_q3_k(b):
    n = b.shape[0]
    scale = _h(b, 108) * (_q3_k_scales(np, b[:, 96:108]).astype(np.float32) - 32.0)
    q = _q3_k_codes(np, b).view(np.int8) - np.int8(4)
    return q.reshape(n, 256), f16_bits(scale), None


def _r_q2_k(b):
    n = b.shape[0]
    sc = b[:, 0:16]
    return (_two_bits(np, b[:, 16:80]).reshape(n, 256).view(np.int8),
            f16_bits(_h(b, 80) * (sc & 15)), f16_bits(-(_h(b, 82) * (sc >> 4))))


def _r_iq4_nl(b):
    # a CPU's iq4nl: the file's nibbles and fp16 d, split into two arrays (no copy of
    # the levels: the kernels look them up)
    return b[:, 2:18], _hbits(b, 0), None


def _r_iq4_nl_q8(b):
    # a GPU's q8: the levels as int8 values, d as the scale (exact)
    return iq4_levels(np, _nib(b[:, 2:18])), _hbits(b, 0), None


def _r_iq4_xs_q8(b):
    n = b.shape[0]
    q = iq4_levels(np, _nib(b[:, 8:136].reshape(n, 8, 16)))
    return q.reshape(n, 256), f16_bits(_h(b, 0) * iq4_xs_scales(np, b).astype(np.float32)), None
