"""QMatrix cases for the kernel tests: every kind, block size and min/no-min variant.

Each GGUF quant type is made of random blocks with sane fp16 scales and repacked
by matrices.from_gguf, so the cases hold exactly what a model file would give a GPU
(the K-quants in their repacked kinds, as QMatrix.to gives them to a device).
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from pantheon.worker import matrices as qm

# byte offsets of each type's fp16 scale fields
SCALE_FIELDS = {QT.Q8_0: [0], QT.Q4_0: [0], QT.Q4_1: [0, 2], QT.Q5_0: [0], QT.Q5_1: [0, 2],
                QT.Q4_K: [0, 2], QT.Q5_K: [0, 2], QT.Q6_K: [208], QT.Q3_K: [108], QT.Q2_K: [80, 82]}


def from_blocks(qtype, rows: int, cols: int, seed: int) -> qm.QMatrix:
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    b = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for off in SCALE_FIELDS[qtype]:
        b[:, off:off + 2] = rng.uniform(1e-3, 0.1, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return qm.from_gguf(b.reshape(-1), qtype, (rows, cols), gpu=True)


def from_floats(kind: str, rows: int, cols: int, seed: int) -> qm.QMatrix:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    if kind == "f16":
        return qm.QMatrix("f16", rows, cols, qm.f16_bits(w), source="F16")
    if kind == "bf16":
        return qm.QMatrix("bf16", rows, cols, (w.view(np.uint32) >> 16).astype(np.uint16),
                          source="BF16")
    return qm.quantize(w, kind)


def cases(rows: int = 37, cols: int = 544, k_cols: int = 768) -> dict[str, qm.QMatrix]:
    """name → QMatrix. `cols` (a multiple of 32, not of 256) for the 32-blocks,
    `k_cols` (a multiple of 256) for the K-quants."""
    out = {}
    for i, qtype in enumerate(SCALE_FIELDS):
        k = k_cols if GGML_QUANT_SIZES[qtype][0] == 256 else cols
        out[qtype.name] = from_blocks(qtype, rows, k, seed=i)
    for i, kind in enumerate(("f16", "bf16", "q8_0", "q4")):
        out[kind] = from_floats(kind, rows, cols, seed=100 + i)
    return out


def reference(x: np.ndarray, m: qm.QMatrix) -> tuple[np.ndarray, np.ndarray]:
    """(x @ W.T in float64, the fp32-accumulation error bound per element)."""
    w = qm.dequantize(m).astype(np.float64)
    x = x.astype(np.float64)
    bound = 1e-5 * (np.abs(x) @ np.abs(w).T) + 1e-6
    return x @ w.T, bound
