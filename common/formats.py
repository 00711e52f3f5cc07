"""The table of stored weight types: one record per GGUF type, all a type is to Pantheon.

A record says how a block is laid out (elements, bytes), what a CPU die and a GPU die
hold of a matrix of that type (a QMatrix kind, worker/qmatrix.py), what that costs in
bytes (admission counts it from a file's tensor list before any upload), how a block
decodes to floats (the NumPy / CuPy reference, common/block_decode.py) and how it is
repacked into the kind a die holds when that is not the file's own bytes
(common/block_repack.py). The C kernels know a kind by its code (worker/kernels_cpu.py
CODES, worker/kernels/codes.c): a kind held as the file's blocks (`native`) is read by the
kernels straight from them.

Adding a type: a decoder, a repacker for the GPU (to q4 or q8, which its kernels read),
one record below; a new CPU kind adds its primitives to worker/kernels/ and a row to
tests/test_kernels_cpu.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import block_decode as dec
from . import block_repack as rep


class FormatError(ValueError):
    """A tensor no die can hold (a type not in the table, a shape not made of blocks)."""


@dataclass(frozen=True, slots=True)
class Held:
    """How a die holds a matrix of one stored type."""
    kind: str                    # the QMatrix kind
    bs: int                      # elements per scale entry (per block when `native`)
    has_min: bool = False        # a min per scale entry beside the scale
    native: bool = False         # the file's blocks as they are: no scale or min arrays


@dataclass(frozen=True, slots=True)
class Format:
    name: str                    # the GGUF type name
    block: int                   # elements per block
    block_bytes: int             # bytes per block
    cpu: Held
    gpu: Held
    decode: Callable | None = None       # (xp, blocks [n, block_bytes] u8) → f32 [n, block]
    repack_cpu: Callable | None = None   # blocks → (qs, scale, minv) in cpu.kind
    repack_gpu: Callable | None = None   # blocks → (qs, scale, minv) in gpu.kind
    # where a block's fp16 fields (scale, min) lie: the only floats it holds, so a NaN or
    # Inf anywhere in its weights is one of these (worker/weights.py check_finite)
    fp16_fields: tuple[int, ...] = ()

    def held_bytes(self, elements: int, gpu: bool = False) -> int:
        """Bytes of a matrix of `elements` weights of this type on a die."""
        held = self.gpu if gpu else self.cpu
        if held.native:
            return elements // self.block * self.block_bytes
        return kind_bytes(held, elements)


# bytes per value of each non-native kind (their scales and mins are fp16 per `bs`)
VALUE_BYTES = {"q4": 0.5, "iq4nl": 0.5, "q8": 1.0, "f16": 2.0, "bf16": 2.0, "f32": 4.0}
FLOAT_KINDS = frozenset({"f16", "bf16", "f32"})
NIBBLE_KINDS = frozenset({"q4", "iq4nl"})      # two values per byte


def kind_bytes(held: Held, elements: int) -> int:
    """Bytes of `elements` weights held as a non-native kind."""
    scales = 0 if held.kind in FLOAT_KINDS else (2 + 2 * held.has_min) * elements // held.bs
    return int(elements * VALUE_BYTES[held.kind]) + scales


def _k(name: str, kind: str, block_bytes: int, gpu: Held, decode, repack,
       fields: tuple[int, ...]) -> Format:
    """A K-quant-like type: super-blocks of 256 a CPU keeps as the file has them."""
    return Format(name, 256, block_bytes, Held(kind, 256, native=True), gpu, decode,
                  None, repack, fields)


def _legacy(name: str, block_bytes: int, held: Held, decode, repack,
            fields: tuple[int, ...]) -> Format:
    """A block of 32 repacked into the same kind on either die."""
    return Format(name, 32, block_bytes, held, held, decode, repack, repack, fields)


Q4, Q8 = Held("q4", 32, True), Held("q8", 32)
FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("F32", 1, 4, Held("f32", 32), Held("f32", 32)),
    Format("F16", 1, 2, Held("f16", 32), Held("f16", 32)),
    Format("BF16", 1, 2, Held("bf16", 32), Held("bf16", 32)),
    _legacy("Q8_0", 34, Q8, dec._q8_0, rep._r_q8_0, (0,)),
    _legacy("Q4_0", 18, Q4, dec._q4_0, rep._r_q4_0, (0,)),
    _legacy("Q4_1", 20, Q4, dec._q4_1, rep._r_q4_1, (0, 2)),
    _legacy("Q5_0", 22, Q8, dec._q5_0, rep._r_q5_0, (0,)),
    _legacy("Q5_1", 24, Held("q8", 32, True), dec._q5_1, rep._r_q5_1, (0, 2)),
    _k("Q2_K", "q2k", 84, Held("q8", 16, True), dec._q2_k, rep._r_q2_k, (80, 82)),
    _k("Q3_K", "q3k", 110, Held("q8", 16), dec._q3_k, rep._r_q3_k, (108,)),
    _k("Q4_K", "q4k", 144, Q4, dec._q4_k, rep._r_q4_k, (0, 2)),
    _k("Q5_K", "q5k", 176, Held("q8", 32, True), dec._q5_k, rep._r_q5_k, (0, 2)),
    _k("Q6_K", "q6k", 210, Held("q8", 16), dec._q6_k, rep._r_q6_k, (208,)),
    # a CPU reads IQ4_NL's nibbles and fp16 d as they are (split into two arrays: 4.5
    # bits, the file's size) and looks the levels up; a GPU gets the levels as int8
    Format("IQ4_NL", 32, 18, Held("iq4nl", 32), Q8, dec._iq4_nl, rep._r_iq4_nl,
           rep._r_iq4_nl_q8, (0,)),
    _k("IQ4_XS", "iq4xs", 136, Q8, dec._iq4_xs, rep._r_iq4_xs_q8, (0,)),
)}
QUANTIZED = {name: f for name, f in FORMATS.items() if f.decode is not None}
NATIVE_KINDS = {f.cpu.kind: f for f in FORMATS.values() if f.cpu.native}
# float tensors quantized at load (`--quantize q8_0 | q4`): what either die holds
QUANTIZED_AT_LOAD = {"q8_0": Q8, "q4": Q4}


def lookup(type_name: str, tensor: str = "tensor") -> Format:
    """The record of `type_name`, or the load error naming the tensor and what is read."""
    try:
        return FORMATS[type_name]
    except KeyError:
        raise FormatError(f"tensor {tensor}: type {type_name} cannot be held in memory; "
                          f"supported: {', '.join(sorted(FORMATS))}") from None


def check_blocks(fmt: Format, shape: tuple[int, int], nbytes: int, tensor: str) -> None:
    """A load error naming the tensor when its bytes are not `shape` in whole blocks."""
    rows, cols = shape
    if cols % fmt.block:
        raise FormatError(f"tensor {tensor}: row of {cols} is not a whole number of "
                          f"{fmt.name} blocks of {fmt.block}")
    if nbytes != rows * (cols // fmt.block) * fmt.block_bytes:
        raise FormatError(f"tensor {tensor}: {nbytes} bytes do not hold {shape} in whole "
                          f"{fmt.name} blocks of {fmt.block}")
