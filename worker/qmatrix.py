"""Weight matrices that stay quantized in memory: the format the kernels read.

A `QMatrix` is one weight matrix W [rows = out, cols = in], stored row-major
in blocks along `in`, the way GGUF stores it, so `y = x @ W.T`. Kinds:

  q4    qs uint8 [rows, cols / 2]: per block of 32 elements, 16 bytes; byte i
        holds element i in its low nibble and element i + 16 in its high one
        (ggml's Q4_0 order). scale, minv: fp16 bits (uint16) [rows, cols / 32].
        w = scale * q + minv, q in 0..15.
  q8    qs int8 [rows, cols]; scale fp16 bits [rows, cols / bs] with bs 32, or 16
        (Q6_K's runs); minv the same shape, or None. w = scale * q (+ minv).
  f16   qs uint16 [rows, cols]: IEEE half bits.      w = half(qs)
  bf16  qs uint16 [rows, cols]: bfloat16 bits.       w = float32(qs << 16)
  q2k .. q6k  qs uint8 [rows, cols / 256 * (84 | 110 | 144 | 176 | 210)]: Q2_K .. Q6_K
        super-blocks exactly as the file stores them (worker/kernels.c reads them with
        integer sub-scales); no scale or minv arrays, bs 256. CPU only: moved to a GPU
        they are repacked into q4 / q8 first.

On the CPU, the K-quant tensors stay as stored (q2k .. q6k: the file's bytes).
Elsewhere GGUF tensors are repacked tensor by tensor into the closest kind, exactly but
for one rounding: a K-quant's sub-block scale is the product of an fp16 and a
4-bit (Q2_K), 6-bit (Q3_K, Q4_K, Q5_K) or 8-bit (Q6_K) integer, stored here as one
fp16 (a relative error below 2^-11 on the scale; the format's own step is 1/4 to
1/64 of the block's range). Q8_0 → q8; Q4_0, Q4_1, Q4_K → q4; Q5_0, Q5_1, Q5_K →
q8 with a min (5-bit values in int8); Q6_K, Q3_K → q8 with bs 16; Q2_K → q8 with bs
16 and a min. Float tensors stay as they are (F32 as a dense fp32 array, F16 and
BF16 as f16 / bf16), or are quantized at load to q8 (`q8_0`: absmax / 127 per 32)
or q4 (`q4`: min and step per 32).

Sizes per weight: q2k .. q6k as the file (2.6, 3.4, 4.5, 5.5, 6.56 bits); q4 5 bits,
q8 9 bits (Q8_0: 8.5), from Q5_0 / Q5_1 10 (5.5-6); on a GPU q4 from Q4_K 5 bits, q8
from Q6_K and Q3_K 9, from Q5_K and Q2_K 10.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..common.weight_format import IN_MEMORY, ON_GPU, QUANTIZE_MODES  # noqa: F401 (re-exported)
from .quants import _q3_k_codes, _q3_k_scales, _two_bits

QT = GGMLQuantizationType


class FormatError(ValueError):
    """A tensor the loader cannot hold (an IQ quant, a shape not made of blocks)."""


@dataclass
class QMatrix:
    kind: str
    rows: int
    cols: int
    qs: object                  # xp array, see the module docstring
    scale: object | None = None
    minv: object | None = None
    bs: int = 32
    source: str = ""            # the file's type, for the record

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.qs, self.scale, self.minv) if a is not None)

    def to(self, xp) -> "QMatrix":
        """The same matrix with its arrays on another die (numpy → cupy). The file-layout
        kinds (q2k .. q6k) have no GPU kernels: they are repacked into q4 / q8 first."""
        if self.kind in NATIVE_KINDS:
            return from_gguf(self.qs, QT[self.source], self.shape, native=False).to(xp)
        move = (lambda a: None if a is None else xp.asarray(a))
        return QMatrix(self.kind, self.rows, self.cols, move(self.qs), move(self.scale),
                       move(self.minv), self.bs, self.source)

    def take_rows(self, order) -> "QMatrix":
        """Rows reordered (llama's q/k un-permutation): every array follows."""
        pick = (lambda a: None if a is None else np.ascontiguousarray(a[order]))
        return QMatrix(self.kind, self.rows, self.cols, pick(self.qs), pick(self.scale),
                       pick(self.minv), self.bs, self.source)


def stack(parts: list[QMatrix]) -> QMatrix:
    """Row-stack matrices of one kind and block size (q|k|v, gate|up)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    cat = (lambda name: None if getattr(first, name) is None else
           np.concatenate([getattr(p, name) for p in parts]))

    return QMatrix(first.kind, sum(p.rows for p in parts), first.cols,
                   _copied([p.qs for p in parts]), cat("scale"), cat("minv"), first.bs,
                   "+".join(sorted({p.source for p in parts})))


def _copied(arrays: list[np.ndarray]) -> np.ndarray:
    """The row-stack of `arrays` in new memory: copied by the CPU kernels' threads (a
    load's copies out of the file's pages are bound by page faults, which two threads
    take in parallel), or by NumPy where those kernels cannot be built."""
    out = np.empty((sum(a.shape[0] for a in arrays), *arrays[0].shape[1:]), arrays[0].dtype)
    from . import kernels_cpu
    row = 0
    for a in arrays:
        kernels_cpu.copy_into(out[row:row + a.shape[0]], a)
        row += a.shape[0]
    return out


def owned(m: QMatrix) -> QMatrix:
    """`m` with memory of its own: a file-layout kind read with copy=False views the
    file's pages until copied (every other kind is built into new arrays)."""
    if m.kind not in NATIVE_KINDS or m.qs.flags.owndata:
        return m
    return QMatrix(m.kind, m.rows, m.cols, _copied([m.qs]), None, None, m.bs, m.source)


def stackable(parts: list[QMatrix]) -> bool:
    first = parts[0]
    return all(p.kind == first.kind and p.bs == first.bs and p.cols == first.cols
               and (p.minv is None) == (first.minv is None) for p in parts)


# -- fp16 helpers -------------------------------------------------------------------

def f16_bits(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).astype(np.float16).view(np.uint16)


def half(bits) -> np.ndarray:
    return np.asarray(bits).view(np.float16).astype(np.float32)


# -- reading GGUF blocks --------------------------------------------------------------

FLOATS = frozenset({QT.F32, QT.F16, QT.BF16})
CHUNK_BLOCKS = 1 << 15            # blocks repacked at a time: transients stay a few MiB


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


REPACKERS = {QT.Q8_0: _r_q8_0, QT.Q4_0: _r_q4_0, QT.Q4_1: _r_q4_1, QT.Q5_0: _r_q5_0,
             QT.Q5_1: _r_q5_1, QT.Q2_K: _r_q2_k, QT.Q3_K: _r_q3_k, QT.Q4_K: _r_q4_k,
             QT.Q5_K: _r_q5_k, QT.Q6_K: _r_q6_k}
# type → (kind, bs, repacker); kinds and block sizes as common/weight_format.py counts them
# (the K-quants repacked: what a GPU holds of them)
REPACK = {t: (*ON_GPU.get(t.name, IN_MEMORY[t.name])[:2], fn) for t, fn in REPACKERS.items()}


NATIVE = {QT.Q2_K: "q2k", QT.Q3_K: "q3k", QT.Q4_K: "q4k", QT.Q5_K: "q5k",   # held as the
          QT.Q6_K: "q6k"}                                                 # file has them on a CPU
NATIVE_KINDS = frozenset(NATIVE.values())


def from_gguf(raw, qtype, shape: tuple[int, int], name: str = "tensor",
              fast: bool = True, native: bool = True, copy: bool = True) -> QMatrix:
    """Hold one GGUF matrix (its bytes as stored, `shape` = (rows, cols)) in its kind:
    Q4_K and Q6_K as they are (`native`, the CPU's kinds), else repacked chunk by chunk:
    no fp32 copy of it ever exists. The repacking of Q4_K and Q6_K goes through C
    (worker/kernels.c) when `fast` and the build allows, else NumPy (the same bits)."""
    qtype = QT(qtype)
    rows, cols = shape
    raw = np.asarray(raw).reshape(-1).view(np.uint8)
    if native and qtype in NATIVE:
        block, type_size = GGML_QUANT_SIZES[qtype]
        if cols % block or raw.size != rows * (cols // block) * type_size:
            raise FormatError(f"tensor {name}: {raw.size} bytes do not hold {shape} in "
                              f"whole {qtype.name} blocks of {block}")
        qs = raw.reshape(rows, -1)
        return QMatrix(NATIVE[qtype], rows, cols, qs.copy() if copy else qs, None, None,
                       block, qtype.name)
    if qtype == QT.F16:
        return QMatrix("f16", rows, cols, raw.view(np.uint16).reshape(rows, cols).copy(),
                       source="F16")
    if qtype == QT.BF16:
        return QMatrix("bf16", rows, cols, raw.view(np.uint16).reshape(rows, cols).copy(),
                       source="BF16")
    if qtype not in REPACK:
        raise FormatError(f"tensor {name}: type {qtype.name} cannot be held in memory; "
                          f"supported: F32, F16, BF16, "
                          f"{', '.join(sorted(t.name for t in REPACK))}")
    block, type_size = GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise FormatError(f"tensor {name}: row of {cols} is not a whole number of "
                          f"{qtype.name} blocks of {block}")
    kind, bs, repack = REPACK[qtype]
    blocks = raw.reshape(-1, type_size)
    n = blocks.shape[0]
    if n * block != rows * cols:
        raise FormatError(f"tensor {name}: {raw.size} bytes do not hold {shape} in {qtype.name}")
    per = block // bs                                  # scale entries per file block
    qs = np.empty((n, block // 2 if kind == "q4" else block),
                  dtype=np.uint8 if kind == "q4" else np.int8)
    scale = np.empty((n, per), dtype=np.uint16)
    minv = None
    if qtype in (QT.Q4_K, QT.Q6_K) and fast:
        from .kernels_cpu import repack_k
        minv = np.empty((n, per), dtype=np.uint16) if qtype == QT.Q4_K else None
        if repack_k(qtype.name, blocks, qs, scale, minv):
            return QMatrix(kind, rows, cols, qs.reshape(rows, -1), scale.reshape(rows, -1),
                           None if minv is None else minv.reshape(rows, -1), bs, qtype.name)
        minv = None
    in_place = qtype in (QT.Q4_K, QT.Q6_K)          # these write their values straight in
    for i in range(0, n, CHUNK_BLOCKS):
        part = blocks[i:i + CHUNK_BLOCKS]
        k = part.shape[0]
        if in_place:
            q, s, m = repack(part, qs[i:i + k])
        else:
            q, s, m = repack(part)
            qs[i:i + k] = q.reshape(k, -1)
        scale[i:i + k] = s.reshape(k, per)
        if m is not None:
            if minv is None:
                minv = np.empty((n, per), dtype=np.uint16)
            minv[i:i + k] = m.reshape(k, per)
    return QMatrix(kind, rows, cols, qs.reshape(rows, -1), scale.reshape(rows, -1),
                   None if minv is None else minv.reshape(rows, -1), bs, qtype.name)


# -- quantizing float weights at load ---------------------------------------------------

def quantize(w: np.ndarray, mode: str, source: str = "F32") -> QMatrix:
    """A float matrix [rows, cols] as q8 (`q8_0`) or q4 (`q4`), 32 elements per block,
    computed in row chunks. The stored fp16 scale is the one the values are rounded
    with, so dequantizing gives the nearest grid point."""
    rows, cols = w.shape
    if cols % 32:
        raise FormatError(f"cannot quantize a row of {cols} into blocks of 32")
    nb = cols // 32
    if mode == "q8_0":
        qs = np.empty((rows, cols), dtype=np.int8)
    elif mode == "q4":
        qs = np.empty((rows, cols // 2), dtype=np.uint8)
    else:
        raise ValueError(f"unknown quantization {mode!r}")
    scale = np.empty((rows, nb), dtype=np.uint16)
    minv = np.empty((rows, nb), dtype=np.uint16) if mode == "q4" else None
    step = max(1, (1 << 20) // cols)
    for r in range(0, rows, step):
        blk = np.asarray(w[r:r + step], dtype=np.float32).reshape(-1, nb, 32)
        if mode == "q8_0":
            s = half(f16_bits(np.abs(blk).max(axis=-1) / 127.0))
            inv = np.divide(1.0, s, out=np.zeros_like(s), where=s > 0)
            qs[r:r + step] = np.clip(np.rint(blk * inv[..., None]), -127, 127).astype(
                np.int8).reshape(-1, cols)
            scale[r:r + step] = f16_bits(s)
        else:
            lo, hi = blk.min(axis=-1), blk.max(axis=-1)
            m = half(f16_bits(lo))
            s = half(f16_bits((hi - m) / 15.0))
            inv = np.divide(1.0, s, out=np.zeros_like(s), where=s > 0)
            q = np.clip(np.rint((blk - m[..., None]) * inv[..., None]), 0, 15).astype(np.uint8)
            qs[r:r + step] = _pack4(q).reshape(-1, cols // 2)
            scale[r:r + step], minv[r:r + step] = f16_bits(s), f16_bits(m)
    return QMatrix("q8" if mode == "q8_0" else "q4", rows, cols, qs, scale, minv, 32,
                   f"{source}->{mode}")


# -- the reference decoding (tests, the tile path's check) --------------------------------

def dequantize(m: QMatrix, rows: slice | None = None) -> np.ndarray:
    """float32 [rows, cols] of `m` (or of a slice of its rows), in NumPy."""
    sel = rows or slice(None)
    if m.kind in NATIVE_KINDS:
        from .quants import dequantize as decode
        qs = np.ascontiguousarray(m.qs[sel])
        return decode(qs.reshape(-1), QT[m.source], (qs.shape[0], m.cols))
    if m.kind == "f16":
        return np.asarray(m.qs[sel]).view(np.float16).astype(np.float32)
    if m.kind == "bf16":
        return (np.asarray(m.qs[sel]).astype(np.uint32) << 16).view(np.float32)
    qs = np.asarray(m.qs[sel])
    n = qs.shape[0]
    if m.kind == "q4":
        q = _nib(qs.reshape(n, -1, 16)).astype(np.float32)        # (n, nb, 32)
    else:
        q = qs.reshape(n, -1, m.bs).astype(np.float32)
    s = half(np.asarray(m.scale[sel]))[..., None]
    out = q * s
    if m.minv is not None:
        out += half(np.asarray(m.minv[sel]))[..., None]
    return out.reshape(n, m.cols)
