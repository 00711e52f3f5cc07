"""Dequantization of whole GGUF tensors, over an array module.

`xp` is numpy on the CPU and cupy on a GPU; a tensor is decoded chunk by chunk with
its type's reference decoder (common/formats.py, common/block_decode.py), whose float
arithmetic follows ggml's `dequantize_row_*`: bit-identical to ggml and to the `gguf`
package's numpy reference.
"""

from __future__ import annotations

from math import prod

import numpy
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..common.formats import FORMATS

QT = GGMLQuantizationType

# Elements decoded per chunk.  The output is allocated once; each chunk's
# temporaries (a few arrays of this many elements) are freed before the next,
# so the transient peak is the output plus a few chunk-sized temporaries.
# On the CPU, chunks whose temporaries stay in cache (~1 MiB) measured fastest
# (2^16..2^18; 2^19..2^20 were 2-3x slower).  On a GPU, bigger chunks mean
# fewer kernel launches.
_CHUNK_ELEMS_CPU = 1 << 18
_CHUNK_ELEMS_GPU = 1 << 22


def _float(xp, raw, qtype, out_dtype):
    # Always return a fresh array: never hand out a view of a (read-only)
    # memmap or of the caller's buffer.
    if qtype == QT.F32:
        return raw.view(xp.float32).astype(out_dtype, copy=True)
    if qtype == QT.F16:
        return raw.view(xp.float16).astype(out_dtype, copy=True)
    # BF16 is the top 16 bits of an f32; the shift already made a new array.
    x = (raw.view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)
    return x.astype(out_dtype, copy=False)


_FLOATS = frozenset({QT.F32, QT.F16, QT.BF16})

SUPPORTED: frozenset[GGMLQuantizationType] = frozenset(QT[name] for name in FORMATS)


def expected_nbytes(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of `shape` (row-major) takes in `qtype`; ValueError when
    the row length is not a whole number of blocks."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    row = shape[-1] if len(shape) else 1
    if row % block:
        raise ValueError(
            f"{qtype.name}: row length {row} (last dim of shape {tuple(shape)}) "
            f"is not a multiple of the block size {block}")
    return prod(shape) // block * type_size


def dequantize(raw, qtype: GGMLQuantizationType, shape: tuple[int, ...],
               xp=numpy, out_dtype=numpy.float32):
    """Decode one GGUF tensor.

    raw: a 1-D uint8 array (numpy memmap slice, or a cupy array already on
    the device) holding the tensor's bytes as stored in the GGUF file.  Any
    other contiguous array is taken as its bytes; a numpy array with
    xp=cupy is uploaded.
    shape: the logical shape in row-major (numpy) order, i.e. the reversed
    GGUF ne order, e.g. (n_out, n_in) for a weight matrix.
    Returns a new xp array of `shape` and `out_dtype` (computed in float32,
    then cast)."""
    try:
        qtype = GGMLQuantizationType(qtype)
    except ValueError:
        raise ValueError(f"unknown GGML type {qtype!r}") from None
    if qtype not in SUPPORTED:
        names = ", ".join(sorted(t.name for t in SUPPORTED))
        raise ValueError(f"unsupported tensor type {qtype.name}; supported: {names}")
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimension in shape {shape}")

    # (cupy only views a C-contiguous array as a dtype of another size)
    raw = xp.ascontiguousarray(xp.asarray(raw)).reshape(-1)
    if raw.dtype != xp.uint8:
        raw = raw.view(xp.uint8)
    want = expected_nbytes(qtype, shape)
    if raw.size != want:
        block, type_size = GGML_QUANT_SIZES[qtype]
        raise ValueError(
            f"{qtype.name} tensor of shape {shape} needs {want} bytes "
            f"({prod(shape)} elements / {block} per block x {type_size} B), "
            f"got {raw.size}")

    if qtype in _FLOATS:
        return _float(xp, raw, qtype, out_dtype).reshape(shape)

    block, type_size = GGML_QUANT_SIZES[qtype]
    decode = FORMATS[qtype.name].decode
    n_blocks = raw.size // type_size
    blocks = raw.reshape(n_blocks, type_size)
    out = xp.empty((n_blocks, block), dtype=out_dtype)
    chunk = _CHUNK_ELEMS_CPU if xp is numpy else _CHUNK_ELEMS_GPU
    step = max(1, chunk // block)
    for i in range(0, n_blocks, step):
        out[i:i + step] = decode(xp, blocks[i:i + step])
    return out.reshape(shape)
