"""`--activations auto|int8|int16`: what a CPU die's K-quant products take at batch 1.

These run on every build; where the build has int8 products (AVX2 builds: also run by
test_kernels_cpu's PANTHEON_ISA=avx2 pass over this file) they check the int8 path and
the calibration's figures, elsewhere that every choice keeps int16 and says why."""
from __future__ import annotations

import json

import numpy as np
import pytest

import tiny_models as tm
from kquants import rewrite_as_k_quants
from pantheon.common.default_model import cached_path
from pantheon.worker import activations as act
from pantheon.worker import kernels_cpu as kc
from pantheon.worker.engine import load_engine
from pantheon.worker.model import Span
from test_kquant_model import q4_k_m, widened


@pytest.fixture(scope="module")
def kquant_file(tmp_path_factory):
    """A tiny Qwen2 at width 256 in Q4_K_M's mix (Q4_K, Q6_K down and v)."""
    folder = tmp_path_factory.mktemp("activations")
    with widened("qwen2") as name:
        f32 = tm.write_gguf(name, folder / f"{name}.gguf")
    return rewrite_as_k_quants(f32, folder / f"{name}-q4_k_m.gguf", q4_k_m)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PANTHEON_CACHE_DIR", str(tmp_path))
    return tmp_path / "activations.json"


def decode(engine, tokens) -> np.ndarray:
    return np.concatenate([engine.forward(np.array([t]), [Span(0, i, 1)])
                           for i, t in enumerate(tokens)])


def test_an_unknown_choice_is_refused_with_the_choices(kquant_file):
    with pytest.raises(ValueError, match="activations must be one of auto, int8, int16, "
                                         "not 'int4'"):
        load_engine(kquant_file, n_slots=1, ctx=64, activations="int4")


def test_int8_takes_every_k_quant_product_where_the_build_has_them(kquant_file, cache):
    int16 = load_engine(kquant_file, n_slots=1, ctx=64, activations="int16")
    int8 = load_engine(kquant_file, n_slots=1, ctx=64, activations="int8")
    tokens = [5, 17, 99, 3, 250, 41, 7, 8]
    a, b = decode(int16, tokens), decode(int8, tokens)
    mats = act._int8_matrices(int8.model.w)
    if not kc.HAS_X8[0]:
        assert int8.activations == "int16" and not mats
        np.testing.assert_array_equal(a, b)
        return
    assert int8.activations == "int8" and int16.activations == "int16"
    assert {m.kind for m in mats} == {"q4k", "q6k"}
    assert all(m.__dict__.get("_act8") for m in mats)
    # coarser, not wrong: the same logits to within int8's rounding
    assert 0 < np.abs(a - b).max() < 0.1 * np.abs(a).max()
    # a prefill (many rows) takes int8 too, holding each row as batch 1 does: the same
    # logits as the token-by-token decode, but for the order of float additions
    span = [Span(0, 0, len(tokens), verify=len(tokens))]
    p16 = int16.forward(np.array(tokens), span)
    p8 = int8.forward(np.array(tokens), span)
    assert np.abs(p8 - p16).max() > 100 * np.abs(p8 - b).max()
    np.testing.assert_allclose(p8, b, rtol=0, atol=2e-3 * np.abs(b).max())


def test_auto_measures_a_file_once_then_reads_the_verdict(kquant_file, cache, monkeypatch):
    first = load_engine(kquant_file, n_slots=1, ctx=256, activations="auto")
    if not kc.HAS_X8[0]:                       # nothing to decide: nothing measured
        assert first.activations == "int16" and not cache.exists()
        return
    (entry,) = json.loads(cache.read_text()).values()
    assert entry["tokens"] == act.CALIBRATION_TOKENS and entry["file"] == kquant_file.name
    # both int8 sides measured (the many-row kernels as a prefill, batch 1 token by
    # token); the verdict's figures are the worse side's
    sides = entry["prefill"], entry["decode"]
    assert entry["top1"] == min(s["top1"] for s in sides)
    assert entry["kl"] == max(s["kl"] for s in sides)
    passes = entry["top1"] >= act.TOP1_MIN and entry["kl"] <= act.KL_MAX
    assert first.activations == ("int8" if passes else "int16")
    assert 0.5 < entry["top1"] <= 1 and 0 <= entry["kl"] < 0.5

    def no_second_measurement(*args):
        raise AssertionError("measured again")
    monkeypatch.setattr(act, "calibrate", no_second_measurement)
    again = load_engine(kquant_file, n_slots=1, ctx=256, activations="auto")
    assert again.activations == first.activations
    # the verdict follows the thresholds: a file measured outside them keeps int16
    key = next(iter(json.loads(cache.read_text())))
    cache.write_text(json.dumps({key: {**entry, "top1": 0.9}}))
    assert load_engine(kquant_file, n_slots=1, ctx=256, activations="auto").activations \
        == "int16"


def test_the_file_key_follows_the_bytes(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"x" * 100)
    b.write_bytes(b"x" * 100)
    assert act.file_key(a) == act.file_key(b)
    b.write_bytes(b"x" * 99 + b"y")
    assert act.file_key(a) != act.file_key(b)


SMOL = cached_path()         # read before a test moves the cache folder


@pytest.mark.skipif(not SMOL.exists(), reason="default model not fetched")
def test_a_model_without_k_quants_keeps_int16_and_says_why(cache):
    """SmolLM2 (Q4_1) has no product int8 would change: auto decides at once."""
    engine = load_engine(SMOL, n_slots=1, ctx=64, activations="auto")
    assert engine.activations == "int16" and not cache.exists()
    verdict = act.apply(engine.model, SMOL, "int8")
    assert verdict.used == "int16" and verdict.matrices == 0
    assert "no Q4_K, Q5_K, Q6_K or IQ4_XS matrix" in verdict.why or "no int8 products" in verdict.why


def test_a_calibration_that_cannot_run_keeps_int16_says_why_and_caches_nothing(
        kquant_file, cache, monkeypatch):
    """The load goes on: a file whose calibration text cannot be tokenized (a synthetic
    vocabulary, say) keeps int16 with the reason in its log line, and is measured again
    at its next load rather than remembered."""
    def broken(*args):
        raise ValueError("Error while initializing BPE: Token `x` out of vocabulary")
    monkeypatch.setattr(act, "calibrate", broken)
    engine = load_engine(kquant_file, n_slots=1, ctx=64, activations="auto")
    assert engine.activations == "int16" and not cache.exists()
    verdict = act.apply(engine.model, kquant_file, "auto")
    if kc.HAS_X8[0]:
        assert "the calibration could not run (ValueError: Error while initializing BPE" \
            in verdict.why
        assert not any(m.__dict__.get("_act8") for m in act._int8_matrices(engine.model.w))
