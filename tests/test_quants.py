"""worker/quants.py against the gguf package's numpy reference dequantizer."""


import gguf
import gguf.quants
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from pantheon.common.default_model import cached_path
from pantheon.worker import quants
from pantheon.worker.quants import SUPPORTED, dequantize

MODEL = cached_path()                      # the settings' cache folder (PANTHEON_CACHE_DIR)

# Byte offsets of the f16 scale fields inside each block, per type.  They are
# overwritten with small finite halves so random block bytes decode to finite
# numbers; every other byte (quants, packed scales, high bits) stays random.
F16_FIELDS = {
    T.Q8_0: (0,), T.Q4_0: (0,), T.Q5_0: (0,),
    T.Q4_1: (0, 2), T.Q5_1: (0, 2), T.Q4_K: (0, 2), T.Q5_K: (0, 2),
    T.Q6_K: (208,), T.Q3_K: (108,), T.Q2_K: (80, 82), T.IQ4_NL: (0,), T.IQ4_XS: (0,),
}
QUANTIZED = sorted(F16_FIELDS, key=lambda t: t.value)
FLOATS = [T.F32, T.F16, T.BF16]


def random_raw(qtype, shape, rng):
    """Bytes of a random tensor of `shape` stored as `qtype`."""
    n = int(np.prod(shape))
    if qtype == T.F32:
        return rng.standard_normal(n).astype(np.float32).view(np.uint8)
    if qtype == T.F16:
        return rng.standard_normal(n).astype(np.float16).view(np.uint8)
    if qtype == T.BF16:
        f32 = rng.standard_normal(n).astype(np.float32)
        return (f32.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    block, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n // block, type_size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scale = rng.uniform(-2.0, 2.0, size=(blocks.shape[0], 1)).astype(np.float16)
        blocks[:, off:off + 2] = scale.view(np.uint8)
    return blocks.reshape(-1)


def reference(raw, qtype, shape):
    """gguf's dequantizer; it wants the bytes shaped (rows, bytes_per_row)."""
    rows = raw.reshape(int(np.prod(shape[:-1])), -1)
    return np.asarray(gguf.quants.dequantize(rows, qtype), np.float32).reshape(shape)


def test_supported_set():
    assert SUPPORTED == frozenset(FLOATS + QUANTIZED)


@pytest.mark.parametrize("qtype", FLOATS + QUANTIZED, ids=lambda t: t.name)
def test_matches_gguf_reference(qtype):
    rng = np.random.default_rng(qtype.value)
    block = GGML_QUANT_SIZES[qtype][0]
    # several rows, several blocks per row (64 columns for the float types)
    shape = (5, 3 * block) if block > 1 else (5, 64)
    raw = random_raw(qtype, shape, rng)
    ours = dequantize(raw, qtype, shape)
    assert ours.shape == shape and ours.dtype == np.float32
    assert np.isfinite(ours).all()
    np.testing.assert_array_equal(ours, reference(raw, qtype, shape))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.BF16],
                         ids=lambda t: t.name)
def test_roundtrip_through_gguf_quantize(qtype):
    """Data quantized by gguf itself (not just random bytes) decodes the same."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    raw = np.asarray(gguf.quants.quantize(x, qtype)).reshape(-1).view(np.uint8)
    ours = dequantize(raw, qtype, x.shape)
    np.testing.assert_array_equal(ours, reference(raw, qtype, x.shape))
    np.testing.assert_allclose(ours, x, atol=0.35)  # and it is close to x


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_many_chunks_and_3d_shape(qtype, monkeypatch):
    """Chunk boundaries (including a ragged last chunk) are invisible."""
    monkeypatch.setattr(quants, "_CHUNK_ELEMS_CPU", 3 * 256)
    rng = np.random.default_rng(1)
    shape = (3, 7, 2 * 256)
    raw = random_raw(qtype, shape, rng)
    np.testing.assert_array_equal(dequantize(raw, qtype, shape), reference(raw, qtype, shape))


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.Q8_0, T.Q4_K], ids=lambda t: t.name)
def test_float16_output(qtype):
    rng = np.random.default_rng(2)
    shape = (4, 512)
    raw = random_raw(qtype, shape, rng)
    ours = dequantize(raw, qtype, shape, out_dtype=np.float16)
    assert ours.dtype == np.float16 and ours.shape == shape
    np.testing.assert_array_equal(ours, reference(raw, qtype, shape).astype(np.float16))


def test_one_dim_and_non_uint8_input():
    rng = np.random.default_rng(3)
    x = rng.standard_normal(576).astype(np.float32)
    y = dequantize(x, T.F32, (576,))  # a float32 array is taken as its bytes
    np.testing.assert_array_equal(y, x)
    y[0] = 123.0                      # and the result is a copy, not a view
    assert x[0] != 123.0


def test_int_qtype_accepted():
    raw = random_raw(T.Q8_0, (2, 64), np.random.default_rng(4))
    np.testing.assert_array_equal(dequantize(raw, int(T.Q8_0), (2, 64)),
                                  dequantize(raw, T.Q8_0, (2, 64)))


def test_wrong_byte_count_raises():
    raw = random_raw(T.Q4_1, (4, 64), np.random.default_rng(5))
    with pytest.raises(ValueError, match="Q4_1.*needs 160 bytes.*got 140"):
        dequantize(raw[:-20], T.Q4_1, (4, 64))
    with pytest.raises(ValueError, match="needs"):
        dequantize(raw, T.Q4_1, (5, 64))
    with pytest.raises(ValueError, match="needs"):
        dequantize(np.zeros(10, np.uint8), T.F32, (3,))


def test_row_not_whole_blocks_raises():
    raw = np.zeros(2 * 18 * 3, np.uint8)  # 6 Q4_0 blocks, but rows of 48
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        dequantize(raw, T.Q4_0, (4, 48))


def test_unsupported_type_raises():
    with pytest.raises(ValueError) as e:
        dequantize(np.zeros(66, np.uint8), T.IQ2_XXS, (1, 256))
    msg = str(e.value)
    assert "IQ2_XXS" in msg and "Q4_K" in msg and "F32" in msg


@pytest.mark.skipif(not MODEL.exists(), reason=f"{MODEL} not downloaded")
def test_real_model_tensors():
    reader = gguf.GGUFReader(MODEL)  # ~3 s: it parses the whole vocabulary
    tensors = {t.name: t for t in reader.tensors}
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight",
                 "token_embd.weight", "blk.0.attn_norm.weight"):
        t = tensors[name]
        shape = tuple(int(n) for n in reversed(t.shape))
        raw = np.asarray(t.data).reshape(-1).view(np.uint8)
        ours = dequantize(raw, t.tensor_type, shape)
        assert ours.shape == shape and ours.dtype == np.float32
        # the reference is slow on the 49152-row embedding: check a row sample
        data = np.asarray(t.data).reshape(shape[0], -1) if len(shape) > 1 else t.data
        rows = np.r_[0:300, shape[0] - 300:shape[0]] if shape[0] > 2048 else slice(None)
        ref = np.asarray(gguf.quants.dequantize(data[rows], t.tensor_type))
        np.testing.assert_array_equal(ours[rows], ref.reshape(ours[rows].shape), err_msg=name)
    assert tensors["blk.0.attn_q.weight"].tensor_type == T.Q4_1
    assert tensors["token_embd.weight"].tensor_type == T.Q8_0
