"""Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS writers for tests (gguf-py decodes these types but cannot encode them).

Plain round-to-nearest quantizers in ggml's block layouts (not llama.cpp's
error-minimizing search): what matters here is that the bytes are valid blocks,
which tests check against gguf-py's own decoder, and that the values are close to
the floats they came from. `rewrite_as_k_quants` turns a tiny model's F32 GGUF into
a K-quant one (every field kept), the way a Q4_K_M or Q5_K_M file mixes them.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

QT = gguf.GGMLQuantizationType


def _f16(v) -> np.ndarray:
    return np.asarray(v, dtype=np.float32).astype(np.float16)


def quantize_q4_k(w: np.ndarray, top: int = 15) -> np.ndarray:
    """float32 [rows, cols] (cols % 256 == 0) → Q4_K blocks as uint8 [rows, cols/256*144].
    Per 32: w ~ d*sc*q - dmin*m with q in 0..15, sc and m 6-bit, d and dmin fp16.
    (top = 31: the same fields with 5-bit q, which quantize_q5_k lays out.)"""
    rows, cols = w.shape
    sb = w.reshape(-1, 8, 32).astype(np.float32)                       # super-blocks
    lo = np.minimum(sb.min(-1), 0.0)                                   # [n, 8] (<= 0)
    step = (sb.max(-1) - lo) / float(top)                              # [n, 8]
    d = _f16(step.max(-1) / 63.0).astype(np.float32)                   # [n]
    dmin = _f16((-lo).max(-1) / 63.0).astype(np.float32)
    safe = lambda a: np.where(a > 0, a, 1.0)                          # noqa: E731
    sc = np.clip(np.rint(step / safe(d)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(-lo / safe(dmin)[:, None]), 0, 63).astype(np.uint8)
    scale = (d[:, None] * sc)[..., None]
    q = np.clip(np.rint((sb + (dmin[:, None] * m)[..., None]) / safe(scale)), 0, top)
    q = np.where(scale > 0, q, 0).astype(np.uint8)                    # [n, 8, 32]
    n = sb.shape[0]
    out = np.zeros((n, 144), dtype=np.uint8)
    if top == 31:                         # bit 4 of sub-block j's values: bit j of qh[i]
        high = (q >> 4).reshape(n, 8, 32)
        q = q & 15
        out = np.zeros((n, 176), dtype=np.uint8)
        out[:, 16:48] = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8)
    body = out[:, 32:] if top == 31 else out
    out[:, 0:2] = _f16(d).view(np.uint8).reshape(n, 2)
    out[:, 2:4] = _f16(dmin).view(np.uint8).reshape(n, 2)
    s = out[:, 4:16]                      # sc, m of j < 4 in bytes j, j + 4 (low 6 bits);
    s[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)     # j >= 4: low nibbles in byte j + 4,
    s[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)       # top 2 bits over bytes j - 4, j
    s[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    pairs = q.reshape(n, 4, 2, 32)        # group g: sub-blocks 2g (low nibble), 2g + 1 (high)
    body[:, 16:144] = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, 128)
    return out.reshape(rows, -1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] → Q5_K blocks uint8 [rows, cols/256*176]: Q4_K's fields with
    q in 0..31, its bit 4 in 32 bytes qh (sub-block j's values: bit j of qh[i]) before
    the nibbles."""
    return quantize_q4_k(w, top=31)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] → Q6_K blocks uint8 [rows, cols/256*210]: w ~ d*sc*(q - 32)
    per 16, q in 0..63, sc int8, d fp16."""
    rows, cols = w.shape
    sb = w.reshape(-1, 16, 16).astype(np.float32)
    n = sb.shape[0]
    step = np.abs(sb).max(-1) / 31.0                                   # [n, 16]
    d = _f16(step.max(-1) / 127.0).astype(np.float32)
    safe = lambda a: np.where(a > 0, a, 1.0)                          # noqa: E731
    sc = np.clip(np.rint(step / safe(d)[:, None]), -128, 127).astype(np.int8)
    scale = (d[:, None] * sc)[..., None]
    q = np.clip(np.rint(sb / safe(scale)) + 32, 0, 63)
    q = np.where(scale != 0, q, 32).astype(np.uint8).reshape(n, 2, 4, 32)   # halves of 128
    out = np.zeros((n, 210), dtype=np.uint8)
    ql = out[:, 0:128].reshape(n, 2, 64)
    ql[:, :, :32] = (q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4)
    ql[:, :, 32:] = (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)
    out[:, 128:192] = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
                       | ((q[:, :, 3] >> 4) << 6)).reshape(n, 64)
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = _f16(d).view(np.uint8).reshape(n, 2)
    return out.reshape(rows, -1)


def _two_bit_runs(u: np.ndarray, out: np.ndarray) -> None:
    """u [n, 256] (0..3) into 64 bytes a super-block: element 128h + 32j + l in bits 2j,
    2j+1 of byte 32h + l (Q2_K's and Q3_K's order)."""
    u = u.reshape(-1, 2, 4, 32).astype(np.uint8)
    out[:] = (u << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(2, dtype=np.uint8).reshape(-1, 64)


def quantize_q3_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] → Q3_K blocks uint8 [rows, cols/256*110]: w ~ d*(sc-32)*(u-4)
    per 16, u in 0..7 (2 bits in qs, the 4 in hmask), sc 6-bit, d fp16."""
    rows, cols = w.shape
    sb = w.reshape(-1, 16, 16).astype(np.float32)
    n = sb.shape[0]
    step = np.abs(sb).max(-1) / 4.0                                    # [n, 16]
    d = _f16(step.max(-1) / 31.0).astype(np.float32)
    safe = lambda a: np.where(a > 0, a, 1.0)                          # noqa: E731
    sc = np.clip(np.rint(step / safe(d)[:, None]), 0, 31).astype(np.uint8) + 32
    scale = (d[:, None] * (sc.astype(np.float32) - 32))[..., None]
    u = (np.clip(np.rint(sb / safe(scale)), -4, 3) + 4).astype(np.uint8).reshape(n, 256)
    out = np.zeros((n, 110), dtype=np.uint8)
    hi = (u >> 2).reshape(n, 2, 4, 32)            # element 128h + 32j + l: bit 4h + j of hmask[l]
    out[:, 0:32] = (hi << np.arange(8, dtype=np.uint8).reshape(2, 4, 1)).sum((1, 2), dtype=np.uint8)
    _two_bit_runs(u & 3, out[:, 32:96])
    a, b, c, e = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12], sc[:, 12:16]
    out[:, 96:100] = (a & 15) | ((c & 15) << 4)
    out[:, 100:104] = (b & 15) | ((e & 15) << 4)
    out[:, 104:108] = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6)
    out[:, 108:110] = _f16(d).view(np.uint8).reshape(n, 2)
    return out.reshape(rows, -1)


def quantize_q2_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] → Q2_K blocks uint8 [rows, cols/256*84]: w ~ d*sc*q - dmin*m
    per 16, q in 0..3, sc and m 4-bit (one byte), d and dmin fp16."""
    rows, cols = w.shape
    sb = w.reshape(-1, 16, 16).astype(np.float32)
    n = sb.shape[0]
    lo = np.minimum(sb.min(-1), 0.0)
    step = (sb.max(-1) - lo) / 3.0
    d = _f16(step.max(-1) / 15.0).astype(np.float32)
    dmin = _f16((-lo).max(-1) / 15.0).astype(np.float32)
    safe = lambda a: np.where(a > 0, a, 1.0)                          # noqa: E731
    sc = np.clip(np.rint(step / safe(d)[:, None]), 0, 15).astype(np.uint8)
    m = np.clip(np.rint(-lo / safe(dmin)[:, None]), 0, 15).astype(np.uint8)
    scale = (d[:, None] * sc)[..., None]
    q = np.clip(np.rint((sb + (dmin[:, None] * m)[..., None]) / safe(scale)), 0, 3)
    q = np.where(scale > 0, q, 0).astype(np.uint8).reshape(n, 256)
    out = np.zeros((n, 84), dtype=np.uint8)
    out[:, 0:16] = sc | (m << 4)
    _two_bit_runs(q, out[:, 16:80])
    out[:, 80:82] = _f16(d).view(np.uint8).reshape(n, 2)
    out[:, 82:84] = _f16(dmin).view(np.uint8).reshape(n, 2)
    return out.reshape(rows, -1)


IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                      dtype=np.float32)


def _iq4_codes(w: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Each value of w [..., 32] as the nearest level times its run's step [..., 1]."""
    inv = np.divide(1.0, step, out=np.zeros_like(step), where=step != 0)
    return np.abs((w * inv)[..., None] - IQ4_LEVELS).argmin(-1).astype(np.uint8)


def _iq4_pack(q: np.ndarray) -> np.ndarray:
    """[..., 32] codes → [..., 16] bytes: element i low, i + 16 high (Q4_0's order)."""
    return q[..., :16] | (q[..., 16:] << 4)


def quantize_iq4_nl(w: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols % 32 == 0) → IQ4_NL blocks uint8 [rows, cols/32*18]: per
    32, d (fp16) puts the largest |w| on the level -127; each value the nearest level."""
    rows, cols = w.shape
    blk = w.reshape(rows, cols // 32, 32).astype(np.float32)
    big = np.take_along_axis(blk, np.abs(blk).argmax(-1)[..., None], -1)        # signed
    d = _f16(big / -127.0).astype(np.float32)
    out = np.zeros((rows, cols // 32, 18), dtype=np.uint8)
    out[..., 0:2] = _f16(d).view(np.uint8).reshape(rows, cols // 32, 2)
    out[..., 2:] = _iq4_pack(_iq4_codes(blk, d))
    return out.reshape(rows, -1)


def quantize_iq4_xs(w: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols % 256 == 0) → IQ4_XS super-blocks uint8 [rows,
    cols/256*136]: each run of 32 wants the step that puts its largest |w| on -127; d
    (fp16) makes the largest of those 31 steps, every run's a 6-bit signed multiple."""
    rows, cols = w.shape
    n = rows * cols // 256
    sub = w.reshape(n, 8, 32).astype(np.float32)
    big = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0] / -127.0
    d = _f16(np.abs(big).max(-1) / 31.0).astype(np.float32)                      # (n,)
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    ls = (np.clip(np.rint(big * inv[:, None]), -32, 31) + 32).astype(np.uint8)   # (n, 8)
    q = _iq4_codes(sub, (d[:, None] * (ls.astype(np.float32) - 32))[..., None])
    out = np.zeros((n, 136), dtype=np.uint8)
    out[:, 0:2] = _f16(d).view(np.uint8).reshape(n, 2)
    high = ((ls >> 4).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16))).sum(-1)
    out[:, 2:4] = high.astype(np.uint16).view(np.uint8).reshape(n, 2)
    out[:, 4:8] = (ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)
    out[:, 8:] = _iq4_pack(q).reshape(n, 128)
    return out.reshape(rows, -1)


QUANTIZERS = {QT.Q2_K: quantize_q2_k, QT.Q3_K: quantize_q3_k, QT.Q4_K: quantize_q4_k,
              QT.Q5_K: quantize_q5_k, QT.Q6_K: quantize_q6_k, QT.IQ4_NL: quantize_iq4_nl,
              QT.IQ4_XS: quantize_iq4_xs}


def rewrite_as_k_quants(src: Path, dst: Path, pick) -> Path:
    """A copy of the F32 GGUF at `src` (every metadata field kept) whose 2-D tensors are
    re-encoded as pick(name, shape) returns: a K-quant type, or None (left F32)."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    wr = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            wr.add_key_value(key, field.contents(), vtype, sub_type=field.types[-1])
        else:
            wr.add_key_value(key, field.contents(), vtype)
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        data = np.asarray(t.data, dtype=np.float32).reshape(shape)
        qtype = pick(t.name, shape) if data.ndim == 2 else None
        if qtype is None:
            wr.add_tensor(t.name, np.ascontiguousarray(data))
        else:
            raw = QUANTIZERS[qtype](data)
            wr.add_tensor(t.name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    wr.write_header_to_file(), wr.write_kv_data_to_file(), wr.write_tensors_to_file()
    wr.close()
    return dst
