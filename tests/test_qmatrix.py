"""The in-memory weight format: GGUF tensors repacked exactly, floats quantized well."""
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from pantheon.worker import matrices as qm
from pantheon.worker.quants import dequantize

# byte offsets of each type's fp16 scale fields (set to sane values in random blocks)
SCALE_FIELDS = {QT.Q8_0: [0], QT.Q4_0: [0], QT.Q4_1: [0, 2], QT.Q5_0: [0], QT.Q5_1: [0, 2],
                QT.Q4_K: [0, 2], QT.Q5_K: [0, 2], QT.Q6_K: [208], QT.Q3_K: [108], QT.Q2_K: [80, 82],
                QT.IQ4_NL: [0], QT.IQ4_XS: [0]}
KIND = {QT.Q8_0: ("q8", 32), QT.Q4_0: ("q4", 32), QT.Q4_1: ("q4", 32), QT.Q5_0: ("q8", 32),
        QT.Q5_1: ("q8", 32), QT.Q4_K: ("q4", 32), QT.Q5_K: ("q8", 32), QT.Q6_K: ("q8", 16),
        QT.Q3_K: ("q8", 16), QT.Q2_K: ("q8", 16), QT.IQ4_NL: ("q8", 32),
        QT.IQ4_XS: ("q8", 32)}
K_QUANTS = [QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K]


def random_tensor(qtype, rows, blocks_per_row, seed=0):
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    n = rows * blocks_per_row
    b = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for off in SCALE_FIELDS[qtype]:
        b[:, off:off + 2] = rng.uniform(1e-3, 0.1, n).astype(np.float16).view(
            np.uint8).reshape(n, 2)
    return b.reshape(-1), (rows, blocks_per_row * block)


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_k_quants_stay_as_the_file_stores_them_and_move_to_a_gpu_repacked(qtype):
    raw, shape = random_tensor(qtype, 6, 3)
    m = qm.from_gguf(raw, qtype, shape)
    assert (m.kind, m.bs, m.scale, m.minv) == (qtype.name.lower().replace("_", ""), 256, None, None)
    assert m.nbytes() == raw.size and m.qs.tobytes() == raw.tobytes()
    np.testing.assert_array_equal(qm.dequantize(m), dequantize(raw, qtype, shape))
    moved = qm.to_die(m, np)                   # what a GPU gets: the repacked kind, same values
    assert (moved.kind, moved.bs) == KIND[qtype]
    np.testing.assert_allclose(qm.dequantize(moved), qm.dequantize(m), rtol=0,
                               atol=np.abs(qm.dequantize(m)).max() * 2.0 ** -11)
    order = np.array([3, 1, 0, 2, 5, 4])
    np.testing.assert_array_equal(qm.dequantize(qm.stack([m, m.take_rows(order)])),
                                  np.concatenate([qm.dequantize(m), qm.dequantize(m)[order]]))
    with pytest.raises(qm.FormatError, match="do not hold"):
        qm.from_gguf(raw[:-10], qtype, shape)


@pytest.mark.parametrize("qtype", list(SCALE_FIELDS), ids=lambda t: t.name)
def test_repacked_tensors_decode_as_the_file(qtype):
    raw, shape = random_tensor(qtype, 6, 3)
    m = qm.from_gguf(raw, qtype, shape, gpu=True)
    assert (m.kind, m.bs) == KIND[qtype] and m.shape == shape
    ref, got = dequantize(raw, qtype, shape), qm.dequantize(m)
    if qtype in K_QUANTS + [QT.IQ4_XS]:
        # one rounding: the sub-block scale d * sc held as one fp16
        step = np.abs(ref).max()
        assert np.abs(got - ref).max() <= step * 2.0 ** -11
        assert np.abs(got - ref).max() > 0          # (the rounding is real, and bounded)
    else:
        np.testing.assert_array_equal(got, ref)
    assert m.nbytes() == sum(a.nbytes for a in (m.qs, m.scale, m.minv) if a is not None)


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
def test_the_c_repack_gives_numpy_s_bits(qtype):
    raw, shape = random_tensor(qtype, 12, 3, seed=5)
    fast = qm.from_gguf(raw, qtype, shape, gpu=True)
    slow = qm.from_gguf(raw, qtype, shape, fast=False, gpu=True)
    for name in ("qs", "scale", "minv"):
        a, b = getattr(fast, name), getattr(slow, name)
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_array_equal(a, b)


def test_row_slices_and_reordering_follow_every_array():
    raw, shape = random_tensor(QT.Q4_1, 8, 2)
    m = qm.from_gguf(raw, QT.Q4_1, shape)
    full = qm.dequantize(m)
    np.testing.assert_array_equal(qm.dequantize(m, slice(2, 5)), full[2:5])
    order = np.array([3, 1, 0, 2, 7, 6, 5, 4])
    np.testing.assert_array_equal(qm.dequantize(m.take_rows(order)), full[order])
    both = qm.stack([m, m.take_rows(order)])
    assert qm.stackable([m, m]) and both.rows == 16
    np.testing.assert_array_equal(qm.dequantize(both), np.concatenate([full, full[order]]))


def test_float_tensors_stay_16_bit():
    w = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    m = qm.from_gguf(w.astype(np.float16).view(np.uint8), QT.F16, w.shape)
    assert m.kind == "f16" and m.nbytes() == w.size * 2
    np.testing.assert_array_equal(qm.dequantize(m), w.astype(np.float16).astype(np.float32))
    bf = (w.view(np.uint32) >> 16).astype(np.uint16)
    m = qm.from_gguf(bf.view(np.uint8), QT.BF16, w.shape)
    assert m.kind == "bf16"
    np.testing.assert_array_equal(qm.dequantize(m), (bf.astype(np.uint32) << 16).view(np.float32))


@pytest.mark.parametrize("mode, kind, bound", [("q8_0", "q8", 1 / 254), ("q4", "q4", 1 / 30)])
def test_quantize_at_load_rounds_to_the_nearest_step(mode, kind, bound):
    w = np.random.default_rng(2).standard_normal((64, 96)).astype(np.float32)
    w[3] = 0.0                                                 # an all-zero block is fine
    m = qm.quantize(w, mode)
    assert m.kind == kind and m.nbytes() < w.nbytes / 3
    err = np.abs(qm.dequantize(m) - w).reshape(64, 3, 32)
    span = np.ptp(w.reshape(64, 3, 32), axis=-1, keepdims=True) if kind == "q4" else \
        np.abs(w.reshape(64, 3, 32)).max(axis=-1, keepdims=True) * 2
    assert (err <= span * bound * 1.01 + 1e-6).all()          # half a step, fp16 aside
    assert not qm.dequantize(m)[3].any()


def test_unsupported_types_and_shapes_are_clear_errors():
    with pytest.raises(qm.FormatError, match="blk.0.attn_q.weight: type IQ2_XXS"):
        qm.from_gguf(np.zeros(66, np.uint8), QT.IQ2_XXS, (1, 256), "blk.0.attn_q.weight")
    with pytest.raises(qm.FormatError, match="not a whole number"):
        qm.from_gguf(np.zeros(34, np.uint8), QT.Q8_0, (2, 16), "w")
    with pytest.raises(qm.FormatError, match="blocks of 32"):
        qm.quantize(np.zeros((2, 40), np.float32), "q4")
