"""Building, moving and decoding QMatrix values (worker/qmatrix.py) by their types'
records (common/formats.py): a GGUF matrix held as its die's kind, chunk by chunk (no
fp32 copy of it ever exists); float weights quantized at load; a matrix moved to a GPU
(the CPU's file-layout kinds repacked first); the NumPy reference decoding (tests, the
tile path's check).
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from ..common.block_decode import iq4_levels
from ..common.block_repack import _nib, _pack4, f16_bits, half
from ..common.formats import (FORMATS, NATIVE_KINDS, NIBBLE_KINDS, Format, FormatError,
                              check_blocks, lookup)
from . import kernels_cpu
from .qmatrix import QMatrix

QT = GGMLQuantizationType
FLOATS = frozenset({QT.F32, QT.F16, QT.BF16})
CHUNK_BLOCKS = 1 << 15            # blocks repacked at a time: transients stay a few MiB
__all__ = ["FormatError", "QMatrix", "f16_bits", "half"]


def to_die(m: QMatrix, xp) -> QMatrix:
    """The same matrix with its arrays on another die (numpy → cupy). The file-layout
    kinds (q2k .. q6k, iq4xs) have no GPU kernels, nor iq4nl: they are repacked into
    the kind the type's record gives a GPU first."""
    fmt = FORMATS[m.source] if m.source in FORMATS else None
    if fmt is not None and m.kind == fmt.cpu.kind and fmt.cpu != fmt.gpu:
        raw = m.qs if fmt.cpu.native else _file_blocks(m, fmt)
        return to_die(from_gguf(raw, QT[m.source], m.shape, gpu=True), xp)
    move = (lambda a: None if a is None else xp.asarray(a))
    return QMatrix(m.kind, m.rows, m.cols, move(m.qs), move(m.scale), move(m.minv), m.bs,
                   m.source)


def _file_blocks(m: QMatrix, fmt: Format) -> np.ndarray:
    """IQ4_NL's blocks as the file had them, from a CPU's iq4nl (d, then the nibbles)."""
    n = m.rows * (m.cols // fmt.block)
    out = np.empty((n, fmt.block_bytes), dtype=np.uint8)
    out[:, :2] = np.ascontiguousarray(m.scale).reshape(n, 1).view(np.uint8)
    out[:, 2:] = np.asarray(m.qs).reshape(n, 16)
    return out.reshape(-1)


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


def from_gguf(raw, qtype, shape: tuple[int, int], name: str = "tensor",
              fast: bool = True, gpu: bool = False, copy: bool = True) -> QMatrix:
    """Hold one GGUF matrix (its bytes as stored, `shape` = (rows, cols)) as its type's
    record says a CPU (or, `gpu`, a GPU) holds it: the file's blocks as they are (a
    native kind; `copy` False: a view of `raw`), else repacked chunk by chunk. The
    repacking of Q4_K and Q6_K goes through C (worker/kernels/repack.c) when `fast` and the
    build allows, else NumPy (the same bits)."""
    qtype = QT(qtype)
    rows, cols = shape
    raw = np.asarray(raw).reshape(-1).view(np.uint8)
    fmt = lookup(qtype.name, name)
    held = fmt.gpu if gpu else fmt.cpu
    check_blocks(fmt, shape, raw.size, name)
    if held.native:
        qs = raw.reshape(rows, -1)
        return QMatrix(held.kind, rows, cols, qs.copy() if copy else qs, None, None,
                       fmt.block, qtype.name)
    if qtype in (QT.F16, QT.BF16):
        return QMatrix(held.kind, rows, cols, raw.view(np.uint16).reshape(rows, cols).copy(),
                       source=qtype.name)
    repack = fmt.repack_gpu if gpu else fmt.repack_cpu
    if repack is None:                       # F32: the loader keeps it dense
        raise FormatError(f"tensor {name}: {qtype.name} is held dense, not as a QMatrix")
    kind, bs = held.kind, held.bs
    blocks = raw.reshape(-1, fmt.block_bytes)
    n = blocks.shape[0]
    per = fmt.block // bs                              # scale entries per file block
    nibbles = kind in NIBBLE_KINDS
    qs = np.empty((n, fmt.block // 2 if nibbles else fmt.block),
                  dtype=np.uint8 if nibbles else np.int8)
    scale = np.empty((n, per), dtype=np.uint16)
    minv = None
    if qtype in (QT.Q4_K, QT.Q6_K) and fast:
        minv = np.empty((n, per), dtype=np.uint16) if qtype == QT.Q4_K else None
        if kernels_cpu.repack_k(qtype.name, blocks, qs, scale, minv):
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
        qs = np.ascontiguousarray(m.qs[sel])
        fmt = NATIVE_KINDS[m.kind]
        return fmt.decode(np, qs.reshape(-1, fmt.block_bytes)).reshape(qs.shape[0], m.cols)
    if m.kind == "f16":
        return np.asarray(m.qs[sel]).view(np.float16).astype(np.float32)
    if m.kind == "bf16":
        return (np.asarray(m.qs[sel]).astype(np.uint32) << 16).view(np.float32)
    qs = np.asarray(m.qs[sel])
    n = qs.shape[0]
    if m.kind == "q4":
        q = _nib(qs.reshape(n, -1, 16)).astype(np.float32)        # (n, nb, 32)
    elif m.kind == "iq4nl":
        q = iq4_levels(np, _nib(qs.reshape(n, -1, 16))).astype(np.float32)
    else:
        q = qs.reshape(n, -1, m.bs).astype(np.float32)
    s = half(np.asarray(m.scale[sel]))[..., None]
    out = q * s
    if m.minv is not None:
        out += half(np.asarray(m.minv[sel]))[..., None]
    return out.reshape(n, m.cols)
