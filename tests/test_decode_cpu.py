"""A decode step's layers in one C call each (worker/layers/decode_cpu.py) against the
Python layers they replace: the same logits and the same caches, bit for bit, for every
architecture and weight format that takes the C way; the others keep the Python way."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import tiny_models as tm
from kquants import rewrite_as_k_quants
from pantheon.common.kv_cache import KVCacheTypes
from pantheon.worker import kernels_cpu as kc
from pantheon.worker.kv_quant import dequantize
from pantheon.worker.engine import load_engine
from pantheon.worker.layers import decode_cpu
from pantheon.worker.layers.decode_cpu import DecodeLayers, Step
from pantheon.worker.model import Span
from test_kquant_model import q2_k, q3_k_m, q4_k_m, q5_k_m, widened


@pytest.fixture
def counted(monkeypatch):
    """How many layers ran through pn_decode_layer."""
    kc.library()
    if not kc.HAS_INT_PATH[0]:
        pytest.skip("a build without the integer kernels (no AVX2) has no C layers")
    calls = [0]
    run = Step.run

    def counting(self, i, x):
        done = run(self, i, x)
        calls[0] += done
        return done
    monkeypatch.setattr(Step, "run", counting)
    return calls


def steps(engine, c_layers: bool, n_slots: int = 3):
    """Prompts into scattered slots, then decode steps (all slots, then two of them), then
    a step mixing a prefill chunk with a decode: every step's logits, and the caches."""
    decode_cpu.ENABLED[0] = c_layers
    try:
        model, rng = engine.model, np.random.default_rng(5)
        slots = list(range(n_slots))[::-1]
        lengths = {s: 5 + 3 * i for i, s in enumerate(slots)}
        for s in slots:
            model.forward(rng.integers(3, 300, lengths[s]), [Span(s, 0, lengths[s])])
        out = []
        for step in range(6):
            live = slots if step < 4 else slots[:2]
            spans = [Span(s, lengths[s], 1) for s in live]
            out.append(model.forward(rng.integers(3, 300, len(live)), spans))
            for s in live:
                lengths[s] += 1
        s0, s1 = slots[0], slots[1]
        out.append(model.forward(rng.integers(3, 300, 5),
                                 [Span(s0, lengths[s0], 4), Span(s1, lengths[s1], 1)]))
        caches = [(b.mixer.state.k.copy(), b.mixer.state.v.copy()) for b in model.blocks
                  if hasattr(b.mixer.state, "k")]
        return out, caches
    finally:
        decode_cpu.ENABLED[0] = True


def assert_same(a, b):
    for x, y in zip(a[0], b[0]):
        np.testing.assert_array_equal(x, y)
    for (k1, v1), (k2, v2) in zip(a[1], b[1]):
        np.testing.assert_array_equal(k1, k2)
        np.testing.assert_array_equal(v1, v2)


@pytest.mark.parametrize("kv_cache", ["f32", "f16", "q8_0", "q4_0", "q8_0/f16"])
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1", "Q4_0"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_c_layers_give_the_python_layers_bits(tmp_path, arch, fmt, kv_cache, counted):
    """qwen2: qkv biases; qwen3: q / k norms; every block goes the C way at decode, with
    every KV cache type (`--kv-cache`, and keys and values apart)."""
    kv = KVCacheTypes.of(*kv_cache.split("/")) if "/" not in kv_cache else \
        KVCacheTypes.of(None, *kv_cache.split("/"))
    if kv_cache.startswith("q"):
        arch = tm.head32(arch)              # blocks of 32 along the head
    path = tm.write_gguf(arch, tmp_path / f"{arch}-{fmt}.gguf", tensor_type=fmt)
    engine = load_engine(path, n_slots=3, ctx=64, kv_cache=kv)
    assert engine.model.blocks[0].mixer.state.kinds == (kv.k, kv.v)
    n_layers = len(engine.model.blocks)
    assert len(engine.model.decode_c.layers) == n_layers
    python = steps(engine, False)
    assert counted[0] == 0
    engine = load_engine(path, n_slots=3, ctx=64, kv_cache=kv)
    assert_same(python, steps(engine, True))
    assert counted[0] == 6 * n_layers            # the decode steps, not the mixed one


@pytest.mark.parametrize("mix", [q4_k_m, q5_k_m, q3_k_m, q2_k], ids=["Q4_K_M", "Q5_K_M", "Q3_K_M", "Q2_K"])
def test_c_layers_of_mixed_k_quant_projections(tmp_path, counted, mix):
    """A Q4_K_M file: q|k in Q4_K and v in Q6_K make a fused qkv of parts (Q5_K_M, Q3_K_M,
    Q2_K: their own two types)."""
    with widened("qwen2") as name:
        f32 = tm.write_gguf(name, tmp_path / f"{name}.gguf")
    path = rewrite_as_k_quants(f32, tmp_path / f"{name}-{mix.__name__}.gguf", mix)
    engine = load_engine(path, n_slots=3, ctx=64)
    assert isinstance(engine.model.blocks[0].mixer.w.wqkv, list)
    python = steps(engine, False)
    engine = load_engine(path, n_slots=3, ctx=64)
    assert_same(python, steps(engine, True))
    assert counted[0] == 6 * len(engine.model.blocks)


def test_c_layers_with_a_sliding_window(tmp_path, counted):
    """Layers of two windows (and one without) in one step: each reads its own keys."""
    path = tm.write_gguf("llama", tmp_path / "l.gguf", tensor_type="Q8_0")

    def windowed():
        engine = load_engine(path, n_slots=3, ctx=64)
        for block, window in zip(engine.model.blocks, (3, None)):
            block.mixer.spec = dataclasses.replace(block.mixer.spec, window=window)
        engine.model.decode_c = DecodeLayers(engine.model.blocks, engine.cfg.d_model)
        return engine
    python = steps(windowed(), False)
    plain = steps(load_engine(path, n_slots=3, ctx=64), False)
    assert not np.array_equal(python[0][3], plain[0][3])     # the window cut something
    assert_same(python, steps(windowed(), True))
    assert counted[0] == 12


@pytest.fixture
def no_lanes():
    """q4 / q8 products of more than 16 rows without the token lanes or the groups of W's
    rows (the row kernels' limit shows)."""
    with kc.options(ktile=0, bgroups=0):
        yield


def test_batches_the_kernels_do_not_take_stay_in_python(tmp_path, counted, no_amx, no_lanes):
    """q4 products take at most 16 rows a call (without AMX tiles or token lanes): a step
    of 17 decodes runs the Python layers (and the same numbers come out)."""
    path = tm.write_gguf("llama", tmp_path / "l.gguf", tensor_type="Q4_1")
    engine = load_engine(path, n_slots=17, ctx=64)
    layer = next(iter(engine.model.decode_c.layers.values()))
    assert layer.takes(16) and not layer.takes(17)
    python = steps(engine, False, n_slots=17)
    engine = load_engine(path, n_slots=17, ctx=64)
    assert_same(python, steps(engine, True, n_slots=17))
    assert counted[0] == 2 * 2                   # only the two steps of two slots


@pytest.mark.parametrize("way", ["lanes", "amx"])
def test_a_step_of_17_decodes_runs_the_c_layers_where_a_kernel_takes_it(tmp_path, counted, way,
                                                                        request):
    """The token lanes (AVX-512 VNNI, AMX off) or the AMX tiles take q4 products of 17
    rows: the C layers run that step, with the Python layers' bits."""
    if way == "amx" and not kc.HAS_AMX[0]:
        pytest.skip("no AMX tiles here")
    if way == "lanes":
        if not kc.library().pn_has_lanes():
            pytest.skip("a build without the token lanes (AVX-512 VNNI)")
        request.getfixturevalue("no_amx")
    path = tm.write_gguf("llama", tmp_path / "l.gguf", tensor_type="Q4_1")
    engine = load_engine(path, n_slots=17, ctx=64)
    layer = next(iter(engine.model.decode_c.layers.values()))
    assert layer.takes(17)
    python = steps(engine, False, n_slots=17)
    engine = load_engine(path, n_slots=17, ctx=64)
    assert_same(python, steps(engine, True, n_slots=17))
    assert counted[0] > 2 * 2


def test_fp32_models_keep_the_python_layers(tmp_path):
    path = tm.write_gguf("llama", tmp_path / "l.gguf", tensor_type="Q8_0")
    assert load_engine(path, n_slots=2, ctx=64, quantize="none").model.decode_c is None


def test_silu_mul_and_head_norms_in_c_equal_the_numpy_expressions():
    rng = np.random.default_rng(2)
    g = (8 * rng.standard_normal((3, 2 * 40))).astype(np.float32)
    g[0, :4] = [0.0, -100.0, 100.0, -0.0]               # saturated and signed zeros
    gate, up = g[:, :40].astype(np.float64), g[:, 40:].astype(np.float64)
    want = gate / (1 + np.exp(-gate)) * up
    np.testing.assert_allclose(kc.silu_mul(g, 40), want, rtol=1e-6, atol=1e-30)
    assert kc.silu_mul(g[:, :79], 40) is None            # not gate | up
    wide = (5 * rng.standard_normal((4, 3 * 32 + 8))).astype(np.float32)
    heads = wide[:, :96].reshape(4, 3, 32)               # rows of a wider matrix
    w = rng.standard_normal(32).astype(np.float32)
    x = heads.astype(np.float64)
    want = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + 1e-6) * w
    got = kc.rms_norm(heads, w, 1e-6)
    assert got.shape == (4, 3, 32) and got.flags.c_contiguous
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kv_cache", ["f32", "f16", "q8_0", "q4_0"])
def test_prefill_chunks_attend_in_c_as_the_numpy_expression_does(tmp_path, kv_cache,
                                                                   no_amx):
    """A chunk's queries run through the decode kernel (each writes its key and value,
    then attends causally, within its window): the NumPy expression's logits, the same
    cache bits. F16 weights: products with float activations (an int16-quantized one
    turns a 1e-6 difference into a step of its grid)."""
    from pantheon.worker.layers import attention
    path = tm.write_gguf(tm.head32("qwen2"), tmp_path / "q.gguf", tensor_type="F16")
    ids = np.random.default_rng(3).integers(3, 300, 40)
    runs = []
    for c_attention in (False, True):
        engine = load_engine(path, n_slots=2, ctx=64, kv_cache=KVCacheTypes.of(kv_cache))
        block = engine.model.blocks[0]
        block.mixer.spec = dataclasses.replace(block.mixer.spec, window=7)
        attention.C_ATTENTION[0] = c_attention
        try:
            out = [engine.model.forward(ids[:25], [Span(1, 0, 25)]),
                   engine.model.forward(ids[25:], [Span(1, 25, 15)])]
        finally:
            attention.C_ATTENTION[0] = True
        runs.append((out, [(b.mixer.state.k.copy(), b.mixer.state.v.copy())
                           for b in engine.model.blocks]))
    for a, b in zip(runs[0][0], runs[1][0]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)     # logits of order 1
    (k1, v1), (k2, v2) = runs[0][1][0], runs[1][1][0]
    np.testing.assert_array_equal(k1, k2)       # layer 0's keys and values: the same bits
    np.testing.assert_array_equal(v1, v2)       # (the later layers' inputs differ by ~1e-6)
    hd = engine.model.blocks[0].mixer.spec.head_dim
    for (k1, v1), (k2, v2) in zip(runs[0][1], runs[1][1]):
        for a, b in ((k1, k2), (v1, v2)):           # blocks: within one step of their grid
            a, b = dequantize(a, kv_cache, hd), dequantize(b, kv_cache, hd)
            step = 1e-5 if kv_cache in ("f32", "f16") else np.abs(a).max() / 4
            np.testing.assert_allclose(a, b, rtol=1e-3, atol=step)
