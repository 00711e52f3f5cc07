"""The fused C decode layer built from each block's spec (worker/layers/decode_cpu.py)
against the Python layers, for the families whose blocks are not llama-shaped: Gemma 3
(post-norms, (1 + w) norms, GeGLU, q/k norms, sliding windows) and Qwen3.5 (gated
attention with partial rotary, Gated DeltaNet's conv step and gated delta rule). tanh,
exp and the delta rule's sums round differently from NumPy's, so these compare to a
tight tolerance (tests/test_decode_cpu.py holds the llama-shaped layer to the bit)."""
from __future__ import annotations

import logging

import numpy as np
import pytest

import tiny_models as tm
from pantheon.worker import kernels_cpu as kc
from pantheon.worker.engine import load_engine
from pantheon.worker.layers import decode_cpu
from pantheon.worker.layers.decode_cpu import DecodeLayers
from pantheon.worker.model import Span
from test_decode_cpu import counted  # noqa: F401  (a fixture)

DECODES = 8


def steps(engine, fused: bool, n_slots: int):
    """Prompts into scattered slots, DECODES decode steps of all of them, then (with two
    slots or more) a step mixing a prefill chunk with a decode: every step's logits."""
    decode_cpu.ENABLED[0] = fused
    try:
        model, rng = engine.model, np.random.default_rng(5)
        slots = list(range(n_slots))[::-1]
        lengths = {s: 5 + 3 * i for i, s in enumerate(slots)}
        for s in slots:
            model.forward(rng.integers(3, 300, lengths[s]), [Span(s, 0, lengths[s])])
        out = []
        for _ in range(DECODES):
            out.append(model.forward(rng.integers(3, 300, n_slots),
                                     [Span(s, lengths[s], 1) for s in slots]))
            for s in slots:
                lengths[s] += 1
        if n_slots > 1:
            s0, s1 = slots[0], slots[1]
            out.append(model.forward(rng.integers(3, 300, 5),
                                     [Span(s0, lengths[s0], 4), Span(s1, lengths[s1], 1)]))
        return out
    finally:
        decode_cpu.ENABLED[0] = True

FAMILIES = ["llama", "qwen2", "qwen3", "gemma3", "qwen35"]


def states(engine):
    """Every layer's sequence state: KV caches (as float32) and recurrent arrays."""
    out = []
    for block in engine.model.blocks:
        st = block.mixer.state
        if hasattr(st, "k"):
            out += [st.k.astype(np.float32), st.v.astype(np.float32)]
        else:
            out += [a.copy() for a in st.arrays.values()]
    return out


def both_ways(path, n_slots: int, **kw):
    runs = []
    for fused in (False, True):
        engine = load_engine(path, n_slots=n_slots, ctx=64, **kw)
        assert not engine.model.decode_c.reasons, engine.model.decode_c.describe()
        logits = steps(engine, fused, n_slots)
        runs.append((logits, states(engine)))
    (py, py_state), (c, c_state) = runs
    # an activation quantized to int16 steps, or a cache rounded to fp16, turns a
    # rounding difference into a step of its grid now and then: the whole arrays agree
    # to 1e-3 of their norm (measured: 6e-5 to 2.5e-4; a wrong head or a missed decay
    # is off by 1e-2 and more), each element to 5e-3 (values of order 5)
    for a, b in [*zip(py, c), *zip(py_state, c_state)]:
        np.testing.assert_allclose(b, a, rtol=1e-3, atol=5e-3)
        assert np.linalg.norm(b - a) <= 1e-3 * np.linalg.norm(a)
    return engine


@pytest.mark.parametrize("n_slots", [1, 3])
@pytest.mark.parametrize("arch,kv_cache", [("gemma3", "f32"), ("gemma3", "f16"),
                                           ("qwen35", "f32"), ("qwen35", "f16")])
def test_fused_layers_equal_the_python_layers(tmp_path, arch, kv_cache, n_slots, counted,
                                              monkeypatch):
    """Batch 1 and batches of 3 and 2; Gemma 3's window of 4 is passed (the sequences
    reach 21 positions), Qwen3.5 ropes 8 of 32 dims. Every block runs fused at every
    decode step."""
    monkeypatch.setenv("PANTHEON_KV_CACHE", kv_cache)
    path = tm.write_gguf(arch, tmp_path / f"{arch}.gguf", tensor_type="Q8_0")
    engine = both_ways(path, n_slots)
    assert counted[0] == DECODES * len(engine.model.blocks)


def test_fused_deltanet_in_grouped_head_order(tmp_path, counted):
    """A Hugging Face checkpoint's value heads grouped by key head (h reads h // r),
    quantized at load."""
    folder = tm.write_safetensors_dir("qwen35", tmp_path / "hf")
    engine = both_ways(folder, 3, quantize="q8_0")
    assert any(getattr(b.mixer.spec, "hf_layout", False) for b in engine.model.blocks)
    assert counted[0] == DECODES * len(engine.model.blocks)


def test_fused_deltanet_with_float_gate_rows(tmp_path, counted):
    """ssm_beta | ssm_alpha kept in floats (as a file may store such small matrices): the
    dense [in, out] rows, multiplied in C."""
    from pantheon.worker.linear import matmul
    path = tm.write_gguf("qwen35", tmp_path / "q.gguf", tensor_type="Q8_0")
    runs = []
    for fused in (False, True):
        engine = load_engine(path, n_slots=2, ctx=64)
        for block in engine.model.blocks:
            w = block.mixer.w
            if hasattr(w, "w_ba"):
                w.w_ba = matmul(np.eye(engine.cfg.d_model, dtype=np.float32), w.w_ba)
        engine.model.decode_c = DecodeLayers(engine.model.blocks, engine.cfg.d_model)
        assert not engine.model.decode_c.reasons
        runs.append(steps(engine, fused, 2))
    for a, b in zip(*runs):
        np.testing.assert_allclose(b, a, rtol=1e-3, atol=5e-3)
        assert np.linalg.norm(b - a) <= 1e-3 * np.linalg.norm(a)
    assert counted[0] == DECODES * len(engine.model.blocks)


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_family_runs_fused_and_the_load_log_says_so(tmp_path, arch, caplog):
    """A family whose layers fell back to Python would fail here: every block is fused,
    and the load log names what each run of layers does."""
    kc.library()
    if not kc.HAS_INT_PATH[0]:
        pytest.skip("a build without the integer kernels (no AVX2) has no C layers")
    path = tm.write_gguf(arch, tmp_path / f"{arch}.gguf", tensor_type="Q8_0")
    with caplog.at_level(logging.INFO, logger="pantheon.worker.engine"):
        engine = load_engine(path, n_slots=2, ctx=64)
    decode = engine.model.decode_c
    assert len(decode.layers) == len(engine.model.blocks) and not decode.reasons
    said = [r.getMessage() for r in caplog.records if "decode layers" in r.getMessage()]
    assert said and all(": fused (" in line for line in said)
    covered = sum(int(part.split("-")[-1]) - int(part.split("-")[0]) + 1 for part in
                  (line.split(": ")[1].split()[-1] for line in said))
    assert covered == len(engine.model.blocks)


def test_a_block_the_c_layer_lacks_says_why(tmp_path, caplog):
    """A mixer kind the C layer does not know runs the Python layers, and says so."""
    kc.library()
    if not kc.HAS_INT_PATH[0]:
        pytest.skip("a build without the integer kernels (no AVX2) has no C layers")
    path = tm.write_gguf("llama", tmp_path / "l.gguf", tensor_type="Q8_0")
    engine = load_engine(path, n_slots=2, ctx=64)
    blocks = engine.model.blocks

    class NewMixer(type(blocks[1].mixer)):
        pass
    blocks[1].mixer.__class__ = NewMixer
    decode = DecodeLayers(blocks, engine.cfg.d_model)
    assert list(decode.layers) == [0] and "NewMixer" in decode.reasons[1]
    assert decode.describe() == ["layer 0: fused (attention, silu)",
                                 "layer 1: Python layers: a mixer the C layer lacks (NewMixer)"]


def test_gelu_mul_in_c_equals_the_numpy_expression():
    from pantheon.worker.layers.ops import gelu_tanh
    rng = np.random.default_rng(4)
    g = (6 * rng.standard_normal((3, 2 * 40))).astype(np.float32)
    g[0, :4] = [0.0, -100.0, 100.0, -0.0]
    out = np.empty((3, 40), np.float32)
    kc.library().pn_gelu_mul(kc._ptr(g), 3, 40, kc._ptr(out))
    np.testing.assert_allclose(out, gelu_tanh(g[:, :40]) * g[:, 40:], rtol=1e-6, atol=1e-5)


