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
  iq4nl qs uint8 [rows, cols / 2] as q4; scale fp16 bits [rows, cols / 32]; no minv.
        w = scale * IQ4_LEVELS[q] (common/block_decode.py: 16 int8 levels).
  q2k .. q6k, iq4xs  qs uint8 [rows, cols / 256 * block bytes]: Q2_K .. Q6_K and IQ4_XS
        super-blocks exactly as the file stores them (worker/kernels/ reads them with
        integer sub-scales); no scale or minv arrays, bs 256. CPU only: moved to a GPU
        they are repacked into q4 / q8 first.

Which kind each stored type becomes on a CPU and on a GPU, and what it costs, is
its record in common/formats.py; worker/matrices.py builds, moves and decodes QMatrix
values. This module holds only the type, so that every other module may import it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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

    def take_rows(self, order) -> "QMatrix":
        """Rows reordered (llama's q/k un-permutation): every array follows."""
        pick = (lambda a: None if a is None else np.ascontiguousarray(a[order]))
        return QMatrix(self.kind, self.rows, self.cols, pick(self.qs), pick(self.scale),
                       pick(self.minv), self.bs, self.source)
