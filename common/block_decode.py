"""The reference decoding of every GGUF block type, written once over an array module.

`xp` is numpy on the CPU and cupy on a GPU; the same code runs on both, so this file
only uses operations the two share: views, reshape, slicing, bit operations, astype,
arithmetic, take and concatenate (no np.unpackbits, no np.frombuffer, no in-place
ufunc `out=` tricks). Each decoder takes blocks (n, block bytes) uint8 and returns
float32 (n, block elements); common/formats.py names the decoder of each type.

Block layouts are those of ggml (ggml-common.h). Every quantized type stores a tensor
row as a run of fixed-size blocks; all fields are little-endian and blocks are packed
without padding. "f16" below is an IEEE half.

The decoding order of the float arithmetic follows ggml's reference
`dequantize_row_*` (e.g. `(d * sc) * q - (dmin * m)` for Q4_K), so results are
bit-identical to ggml and to the `gguf` package's numpy reference.
"""
from __future__ import annotations

# ----------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------

def _f16(xp, blocks, offset):
    """The f16 field at byte `offset` of every block, as an (n, 1) float32.

    The two bytes are copied to a contiguous array before the view, so this
    works for strided slices and on cupy (which wants aligned, contiguous data
    for a view that changes the item size)."""
    two = xp.ascontiguousarray(blocks[:, offset:offset + 2])
    return two.view(xp.float16).astype(xp.float32)


def _nibbles(xp, qs):
    """(..., k) uint8 -> (..., 2k): the low nibbles of all k bytes, then the
    high nibbles -- ggml's order within a 4-bit group."""
    return xp.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(xp, qh):
    """(n, 4) uint8 holding a little-endian uint32 -> (n, 32) uint8 of its
    bits, bit j at column j."""
    shifts = xp.arange(8, dtype=xp.uint8)
    return ((qh[:, :, None] >> shifts) & 1).reshape(qh.shape[0], 32)


# ----------------------------------------------------------------------------
# 32-element blocks (QK = 32)
# ----------------------------------------------------------------------------

def _q8_0(xp, b):
    # block_q8_0 (34 B): f16 d | int8 qs[32]          y = d * qs
    d = _f16(xp, b, 0)
    q = b[:, 2:34].view(xp.int8).astype(xp.float32)
    return q * d


def _q4_0(xp, b):
    # block_q4_0 (18 B): f16 d | uint8 qs[16]
    # element j < 16 is the low nibble of qs[j], element j + 16 the high one.
    # y = d * (q - 8)
    d = _f16(xp, b, 0)
    q = _nibbles(xp, b[:, 2:18]).view(xp.int8) - xp.int8(8)
    return d * q.astype(xp.float32)


def _q4_1(xp, b):
    # block_q4_1 (20 B): f16 d | f16 m | uint8 qs[16]   (nibbles as Q4_0)
    # y = d * q + m
    d = _f16(xp, b, 0)
    m = _f16(xp, b, 2)
    q = _nibbles(xp, b[:, 4:20]).astype(xp.float32)
    return d * q + m


def _q5_0(xp, b):
    # block_q5_0 (22 B): f16 d | uint8 qh[4] | uint8 qs[16]
    # qh is a little-endian uint32 whose bit j is the 5th bit of element j;
    # the low 4 bits are nibbles as in Q4_0.      y = d * (q - 16)
    d = _f16(xp, b, 0)
    q = _nibbles(xp, b[:, 6:22]) | (_bits(xp, b[:, 2:6]) << 4)
    q = q.view(xp.int8) - xp.int8(16)
    return d * q.astype(xp.float32)


def _q5_1(xp, b):
    # block_q5_1 (24 B): f16 d | f16 m | uint8 qh[4] | uint8 qs[16]
    # bits as Q5_0, unsigned.                     y = d * q + m
    d = _f16(xp, b, 0)
    m = _f16(xp, b, 2)
    q = _nibbles(xp, b[:, 8:24]) | (_bits(xp, b[:, 4:8]) << 4)
    return d * q.astype(xp.float32) + m


# ----------------------------------------------------------------------------
# 256-element super-blocks (QK_K = 256)
# ----------------------------------------------------------------------------

def _k_scales_mins(xp, s):
    """Unpack the 12 bytes of 6-bit scales/mins of Q4_K and Q5_K.

    Eight sub-blocks j = 0..7, each with a 6-bit scale sc[j] and min m[j]:
        bytes 0..3  (a):  a[j]  = hi2(sc[j+4]) : sc[j]      (j < 4)
        bytes 4..7  (b):  b[j]  = hi2(m[j+4])  : m[j]
        bytes 8..11 (c):  c[j]  = lo4(m[j+4])  : lo4(sc[j+4])  (high : low nibble)
    Returns two (n, 8) uint8 arrays."""
    a, bb, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = xp.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mn = xp.concatenate([bb & 0x3F, (c >> 4) | ((bb >> 6) << 4)], axis=-1)
    return sc, mn


def _q4_k(xp, b):
    # block_q4_K (144 B): f16 d | f16 dmin | uint8 scales[12] | uint8 qs[128]
    # 8 sub-blocks of 32.  qs is 4 groups of 32 bytes; group g holds sub-block
    # 2g in its low nibbles and sub-block 2g+1 in its high nibbles.
    # y = (d * sc[j]) * q - (dmin * m[j])
    n = b.shape[0]
    d = _f16(xp, b, 0)
    dmin = _f16(xp, b, 2)
    sc, mn = _k_scales_mins(xp, b[:, 4:16])
    dl = (d * sc.astype(xp.float32))[:, :, None]
    ml = (dmin * mn.astype(xp.float32))[:, :, None]
    q = _nibbles(xp, b[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32)
    return (dl * q.astype(xp.float32) - ml).reshape(n, 256)


def _q5_k(xp, b):
    # block_q5_K (176 B): f16 d | f16 dmin | uint8 scales[12] | uint8 qh[32]
    #                     | uint8 qs[128]
    # Low 4 bits as Q4_K; the 5th bit of element l of sub-block j is bit j of
    # qh[l].              y = (d * sc[j]) * q - (dmin * m[j])
    n = b.shape[0]
    d = _f16(xp, b, 0)
    dmin = _f16(xp, b, 2)
    sc, mn = _k_scales_mins(xp, b[:, 4:16])
    dl = (d * sc.astype(xp.float32))[:, :, None]
    ml = (dmin * mn.astype(xp.float32))[:, :, None]
    shifts = xp.arange(8, dtype=xp.uint8)[:, None]
    qh = (b[:, None, 16:48] >> shifts) & 1                       # (n, 8, 32)
    ql = _nibbles(xp, b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    q = ql | (qh << 4)
    return (dl * q.astype(xp.float32) - ml).reshape(n, 256)


def _q6_k(xp, b):
    # block_q6_K (210 B): uint8 ql[128] | uint8 qh[64] | int8 scales[16] | f16 d
    # Two halves of 128 elements; half h uses ql[64h:64h+64], qh[32h:32h+32].
    # Within a half, for l = 0..31 the four groups of 32 are
    #   y[l]    <- lo4(ql[l])    | bits 0-1 of qh[l] << 4
    #   y[l+32] <- lo4(ql[l+32]) | bits 2-3 of qh[l] << 4
    #   y[l+64] <- hi4(ql[l])    | bits 4-5 of qh[l] << 4
    #   y[l+96] <- hi4(ql[l+32]) | bits 6-7 of qh[l] << 4
    # Each run of 16 elements has its own int8 scale (16 per super-block).
    # y = (d * scale) * (q - 32)
    n = b.shape[0]
    d = _f16(xp, b, 208)
    scale = b[:, 192:208].view(xp.int8).astype(xp.float32)
    dl = (d * scale)[:, :, None]                                 # (n, 16, 1)
    ql = _nibbles(xp, b[:, 0:128].reshape(n, 2, 64)).reshape(n, 2, 4, 32)
    shifts = xp.arange(0, 8, 2, dtype=xp.uint8)[:, None]
    qh = (b[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3      # (n, 2, 4, 32)
    q = (ql | (qh << 4)).view(xp.int8) - xp.int8(32)
    return (dl * q.reshape(n, 16, 16).astype(xp.float32)).reshape(n, 256)


def _q3_k_scales(xp, s):
    """Q3_K's 12 bytes → its 16 6-bit scales (n, 16) uint8, before the -32: scales i,
    4 + i take the low nibbles of bytes i, 4 + i, scales 8 + i, 12 + i their high
    nibbles; bits 0-1, 2-3, 4-5, 6-7 of byte 8 + i are the top two bits of each."""
    a, bb, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    return xp.concatenate([(a & 15) | ((c & 3) << 4), (bb & 15) | (((c >> 2) & 3) << 4),
                           (a >> 4) | (((c >> 4) & 3) << 4), (bb >> 4) | (((c >> 6) & 3) << 4)],
                          axis=-1)


def _two_bits(xp, qs):
    """(n, 64) bytes of Q2_K / Q3_K → (n, 16, 16) uint8 runs of 16: element 128h + 32j +
    l takes bits 2j, 2j+1 of byte 32h + l."""
    shifts = xp.arange(0, 8, 2, dtype=xp.uint8)[:, None]                       # (4, 1)
    return ((qs.reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 16, 16)


def _q3_k_codes(xp, b):
    """Q3_K blocks → (n, 16, 16) uint8 values 0..7 (the -4 not taken off): the two bits
    with bit 4h + j of hmask[l] as the 4."""
    hbit = (b[:, None, None, 0:32] >> xp.arange(8, dtype=xp.uint8).reshape(2, 4, 1)) & 1
    return _two_bits(xp, b[:, 32:96]) | (hbit.reshape(-1, 16, 16) << 2)


def _q3_k(xp, b):
    # block_q3_K (110 B): uint8 hmask[32] | uint8 qs[64] | uint8 scales[12] | f16 d
    # Two halves of 128; in half h, run j (0..3) of 32: element 128h + 32j + l takes
    # bits 2j, 2j+1 of qs[32h + l] and bit 4h + j of hmask[l] (its 4s: clear means -4).
    # Each run of 16 has a 6-bit scale sc.     y = d * (sc - 32) * (q - 4), q in 0..7
    n = b.shape[0]
    d = _f16(xp, b, 108)
    scale = _q3_k_scales(xp, b[:, 96:108]).astype(xp.float32) - 32.0
    q = _q3_k_codes(xp, b).astype(xp.float32) - 4.0
    return ((d * scale)[:, :, None] * q).reshape(n, 256)


def _q2_k(xp, b):
    # block_q2_K (84 B): uint8 scales[16] | uint8 qs[64] | f16 d | f16 dmin
    # Element 128h + 32j + l takes bits 2j, 2j+1 of qs[32h + l]; each run of 16 has a
    # byte: scale in its low nibble, min in its high one.  y = d * sc * q - dmin * m
    n = b.shape[0]
    d, dmin = _f16(xp, b, 80), _f16(xp, b, 82)
    sc = b[:, 0:16]
    q = _two_bits(xp, b[:, 16:80])
    dl = (d * (sc & 15).astype(xp.float32))[:, :, None]
    ml = (dmin * (sc >> 4).astype(xp.float32))[:, :, None]
    return (dl * q.astype(xp.float32) - ml).reshape(n, 256)



# ----------------------------------------------------------------------------
# Non-linear 4-bit codes (IQ4_NL, IQ4_XS): a nibble picks one of 16 int8 levels
# ----------------------------------------------------------------------------

# the 16 levels of a nibble (ggml's kvalues_iq4nl): denser near zero, where weights are
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def iq4_levels(xp, nibbles):
    """uint8 codes 0..15 → their int8 levels (same shape)."""
    return xp.asarray(IQ4_LEVELS, dtype=xp.int8)[nibbles]


def _iq4_nl(xp, b):
    # block_iq4_nl (18 B): f16 d | uint8 qs[16]   (nibbles as Q4_0)
    # y = d * levels[q]
    d = _f16(xp, b, 0)
    return d * iq4_levels(xp, _nibbles(xp, b[:, 2:18])).astype(xp.float32)


def iq4_xs_scales(xp, b):
    """IQ4_XS blocks → their 8 signed 6-bit sub-scales (n, 8) int16 (the -32 taken off):
    sub-block j's low 4 bits are nibble j % 2 of scales_l[j / 2] (byte 4 + j / 2), its
    high 2 bits are bits 2j, 2j + 1 of scales_h (bytes 2-3, a little-endian uint16)."""
    low = _nibbles(xp, b[:, 4:8])                                    # j = 0,2,4,6 then 1,3,5,7
    low = xp.stack([low[:, :4], low[:, 4:]], axis=-1).reshape(-1, 8)
    h = (b[:, 2].astype(xp.uint16) | (b[:, 3].astype(xp.uint16) << 8))[:, None]
    high = (h >> xp.arange(0, 16, 2, dtype=xp.uint16)) & 3
    return (low.astype(xp.int16) | (high.astype(xp.int16) << 4)) - 32


def _iq4_xs(xp, b):
    # block_iq4_xs (136 B): f16 d | uint16 scales_h | uint8 scales_l[4] | uint8 qs[128]
    # 8 sub-blocks of 32; sub-block j's 16 bytes qs[16j..] hold element l low, l + 16
    # high (as Q4_0); its scale is iq4_xs_scales.       y = (d * sc[j]) * levels[q]
    n = b.shape[0]
    d = _f16(xp, b, 0)
    dl = (d * iq4_xs_scales(xp, b).astype(xp.float32))[:, :, None]
    q = iq4_levels(xp, _nibbles(xp, b[:, 8:136].reshape(n, 8, 16)))
    return (dl * q.astype(xp.float32)).reshape(n, 256)


DECODERS = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
    "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs,
}
