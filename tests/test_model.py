"""Our forward against Hugging Face transformers' logits (golden files), per arch.

Tiny random models of each architecture are written by the test itself (GGUF
and safetensors); tests/golden holds the logits transformers computed for them.
"""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

import tiny_models as tm
from pantheon.common.model_file import ModelFileError, read_config
from pantheon.worker.engine import load_engine
from pantheon.worker.model import Span

ARCHS = ["llama", "llama3", "qwen2", "qwen3", "gemma3", "qwen35"]
TOL = 2e-4   # float32 forward vs float32 reference, different summation order


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


def engine_for(model_dir, name, fmt="F32", n_slots=4, ctx=64):
    if fmt == "hf":
        path = tm.write_safetensors_dir(name, model_dir / f"{name}-hf")
    else:
        path = tm.write_gguf(name, model_dir / f"{name}-{fmt}.gguf", tensor_type=fmt)
    return load_engine(path, n_slots=n_slots, ctx=ctx)


def decode_one_by_one(engine, tokens, slot=0):
    rows = [engine.forward(np.array([t]), [Span(slot, i, 1)])[0] for i, t in enumerate(tokens)]
    return np.stack(rows)


@pytest.mark.parametrize("fmt", ["F32", "hf"])
@pytest.mark.parametrize("name", ARCHS)
def test_decode_matches_reference(model_dir, name, fmt):
    engine = engine_for(model_dir, name, fmt)
    for tokens, want in zip(tm.GOLDEN_TOKENS, tm.load_golden(name)):
        got = decode_one_by_one(engine, tokens)
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ARCHS)
def test_prefill_chunks_match_reference(model_dir, name):
    engine = engine_for(model_dir, name)
    tokens, want = tm.GOLDEN_TOKENS[0], tm.load_golden(name)[0]
    for split in range(1, len(tokens)):
        first = engine.forward(np.array(tokens[:split]), [Span(0, 0, split)])
        rest = engine.forward(np.array(tokens[split:]), [Span(0, split, len(tokens) - split)])
        np.testing.assert_allclose(first[0], want[split - 1], atol=TOL, rtol=0)
        np.testing.assert_allclose(rest[0], want[-1], atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ARCHS)
def test_mixed_batch_equals_each_sequence_alone(model_dir, name):
    engine = engine_for(model_dir, name)
    (a, b), (want_a, want_b) = tm.GOLDEN_TOKENS, tm.load_golden(name)[:2]
    # a: prefill 5 alone; b: prefill 3 alone. Then one mixed step: a's chunk of 4
    # beside b's single decode token, then both decode one token together.
    engine.forward(np.array(a[:5]), [Span(0, 0, 5)])
    engine.forward(np.array(b[:3]), [Span(1, 0, 3)])
    mixed = engine.forward(np.array(a[5:9] + b[3:4]), [Span(0, 5, 4), Span(1, 3, 1)])
    both = engine.forward(np.array([a[9], b[4]]), [Span(0, 9, 1), Span(1, 4, 1)])
    np.testing.assert_allclose(mixed, np.stack([want_a[8], want_b[3]]), atol=TOL, rtol=0)
    np.testing.assert_allclose(both, np.stack([want_a[9], want_b[4]]), atol=TOL, rtol=0)
    # the batched rows equal the same positions computed alone, in a fresh slot
    alone = engine.forward(np.array(b[:5]), [Span(2, 0, 5)])
    np.testing.assert_allclose(both[1], alone[0], atol=1e-5, rtol=0)


def test_spans_without_logits_are_skipped(model_dir):
    engine = engine_for(model_dir, "llama")
    a, b = tm.GOLDEN_TOKENS
    out = engine.forward(np.array(a[:4] + b[:2]), [Span(0, 0, 4, logits=False), Span(1, 0, 2)])
    assert out.shape == (1, tm.CONFIGS["llama"]["vocab_size"])
    np.testing.assert_allclose(out[0], tm.load_golden("llama")[1][1], atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3"])
def test_f16_weights_stay_close(model_dir, name):
    engine = engine_for(model_dir, name, "F16")
    got = decode_one_by_one(engine, tm.GOLDEN_TOKENS[1])
    np.testing.assert_allclose(got, tm.load_golden(name)[1], atol=5e-2, rtol=0)


def test_copy_prefix_continues_like_the_source(model_dir):
    engine = engine_for(model_dir, "qwen2")
    tokens, want = tm.GOLDEN_TOKENS[0], tm.load_golden("qwen2")[0]
    engine.forward(np.array(tokens[:6]), [Span(0, 0, 6)])
    engine.model.state.copy_prefix(0, 3, 6)
    got = engine.forward(np.array(tokens[6:]), [Span(3, 6, len(tokens) - 6)])
    np.testing.assert_allclose(got[0], want[-1], atol=TOL, rtol=0)


def test_activations_and_logits_stay_float32(model_dir):
    """NumPy 2 promotes float32 to float64 when it meets a float64 scalar."""
    engine = engine_for(model_dir, "llama3")
    w = engine.model.w
    assert w.embed is not None  # llama3 is untied
    assert all(a.dtype == np.float32 for a in (w.embed, w.head, w.out_norm))
    assert engine.model.ropes[0].cos.dtype == np.float32
    assert all(s.k.dtype == np.float32 for s in engine.model.state.layers)
    out = engine.forward(np.array(tm.GOLDEN_TOKENS[0]), [Span(0, 0, 11)])
    assert out.dtype == np.float32


def test_span_beyond_context_is_refused(model_dir):
    engine = engine_for(model_dir, "llama", ctx=8)
    with pytest.raises(ValueError, match="context"):
        engine.forward(np.arange(9), [Span(0, 0, 9)])


def test_unsupported_architecture_is_named(model_dir):
    folder = tm.write_safetensors_dir("llama", model_dir / "gpt2-ish")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFileError, match="'gpt2'.*supported: llama"):
        read_config(folder)
    path = model_dir / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFileError, match="'phi3'.*supported: llama, qwen2, qwen3, gemma3"):
        read_config(path)


def test_missing_and_garbage_files(tmp_path):
    with pytest.raises(ModelFileError, match="not found"):
        read_config(tmp_path / "nope.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelFileError, match="not a readable GGUF"):
        read_config(junk)


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "qwen35"])
def test_decodes_in_scattered_slots_batch_together(model_dir, name):
    """Single-token spans in non-adjacent, unordered slots (others hold stale state)."""
    engine = engine_for(model_dir, name, n_slots=5)
    (a, b), (want_a, want_b) = tm.GOLDEN_TOKENS, tm.load_golden(name)[:2]
    engine.forward(np.array(a[:9]), [Span(2, 0, 9)])      # stale junk in slot 2
    engine.forward(np.array(a[:6]), [Span(4, 0, 6)])
    engine.forward(np.array(b[:2]), [Span(1, 0, 2)])
    out = engine.forward(np.array([a[6], b[2]]), [Span(4, 6, 1), Span(1, 2, 1)])
    np.testing.assert_allclose(out, np.stack([want_a[6], want_b[2]]), atol=TOL, rtol=0)
