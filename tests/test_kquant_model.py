"""K-quant files (Q2_K .. Q6_K) as a CPU holds them (the file's super-blocks, integer kernels) against
the fp32 forward of the same file's dequantized weights: the engine issue's bounds.

The tiny models are widened to 256 (a K-quant super-block) and written the way a
Q4_K_M file mixes its types: Q6_K for ffn_down and attn_v, Q4_K elsewhere (Q5_K_M: Q5_K
and Q6_K; Q3_K_M: Q3_K and Q4_K; Q2_K: Q2_K and Q3_K).
"""
from __future__ import annotations

import contextlib

import gguf
import numpy as np
import pytest

import tiny_models as tm
from kquants import QT, QUANTIZERS, rewrite_as_k_quants
from pantheon.common.weight_format import weight_bytes
from pantheon.worker.engine import load_engine
from pantheon.worker.qmatrix import QMatrix
from test_quantized_model import compare

_rng = np.random.default_rng(11)            # prompts of 24 (one prefill chunk), replies of 20
SEQS = [(list(_rng.integers(3, 320, 24)), list(_rng.integers(3, 320, 20))) for _ in range(3)]


@contextlib.contextmanager
def widened(arch: str):
    """tiny_models' `arch` at width 256 (heads of 64), registered for the block only."""
    name = f"{arch}-wide"
    tm.CONFIGS[name] = {**tm.CONFIGS[arch], "hidden_size": 256, "intermediate_size": 512,
                        **({"head_dim": 64} if "head_dim" in tm.CONFIGS[arch] else {})}
    tm._SEEDS[name], tm.GGUF_ARCH[name] = tm._SEEDS[arch] + 100, tm.GGUF_ARCH[arch]
    try:
        yield name
    finally:
        for table in (tm.CONFIGS, tm._SEEDS, tm.GGUF_ARCH):
            table.pop(name, None)


def kinds(engine) -> set[str]:
    """The kinds of every projection (a fused q|k|v of mixed types is a list of parts)."""
    out = set()
    for m in engine.model.w.matrices():
        for part in (m if isinstance(m, list) else [m]):
            out.add(f"{part.kind}/{part.bs}" if isinstance(part, QMatrix) else "dense")
    return out


def q4_k_m(name: str, shape) -> QT:
    return QT.Q6_K if ".ffn_down." in name or ".attn_v." in name else QT.Q4_K


def q5_k_m(name: str, shape) -> QT:
    return QT.Q6_K if ".ffn_down." in name or ".attn_v." in name else QT.Q5_K


def q3_k_m(name: str, shape) -> QT:
    return QT.Q4_K if ".ffn_down." in name or ".attn_v." in name else QT.Q3_K


def q2_k(name: str, shape) -> QT:
    return QT.Q3_K if ".ffn_down." in name or ".attn_v." in name else QT.Q2_K


def iq4_nl(name: str, shape) -> QT:
    return QT.IQ4_NL


def iq4_xs(name: str, shape) -> QT:
    return QT.IQ4_XS


@pytest.mark.parametrize("qtype", list(QUANTIZERS), ids=lambda t: t.name)
def test_the_test_quantizers_write_blocks_gguf_decodes_close_to_the_floats(qtype):
    w = np.random.default_rng(3).standard_normal((8, 512)).astype(np.float32)
    w[2] = 0.0                                               # an all-zero row is fine
    w[3, :256] = np.abs(w[3, :256])                          # and a block with no negatives
    raw = QUANTIZERS[qtype](w)
    back = gguf.quants.dequantize(raw, qtype).reshape(w.shape)
    step = {QT.Q2_K: 1 / 3, QT.Q3_K: 1 / 7, QT.Q4_K: 1 / 15, QT.Q5_K: 1 / 31,
            QT.Q6_K: 1 / 31, QT.IQ4_NL: 1 / 10, QT.IQ4_XS: 1 / 10}[qtype]   # of a sub-block's range
    assert np.abs(back - w).max() <= 2 * step * np.abs(w).max()
    assert np.abs(back - w).mean() < 0.3 * step * np.abs(w).max()
    assert not back[2].any()


@pytest.mark.parametrize("mix, held", [(q4_k_m, {"q4k/256", "q6k/256"}),
                                       (q5_k_m, {"q5k/256", "q6k/256"}),
                                       (q3_k_m, {"q3k/256", "q4k/256"}),
                                       (q2_k, {"q2k/256", "q3k/256"})],
                         ids=["Q4_K_M", "Q5_K_M", "Q3_K_M", "Q2_K"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_k_quant_files_held_as_stored_match_their_fp32_forward(tmp_path, arch, mix, held):
    check_file_held_as_stored(tmp_path, arch, mix, held)


@pytest.mark.parametrize("mix, held, arch", [(iq4_nl, {"iq4nl/32"}, "llama"),
                                             (iq4_xs, {"iq4xs/256"}, "qwen2")],
                         ids=["IQ4_NL", "IQ4_XS"])
def test_iq4_files_run_at_their_size_and_match_their_fp32_forward(tmp_path, arch, mix, held):
    """IQ4_NL (a CPU holds its nibbles and scales: 4.5 bits) and IQ4_XS (its super-blocks as
    stored: 4.25 bits), every matrix of the file in that type, as llama-quantize writes
    them with --pure."""
    check_file_held_as_stored(tmp_path, arch, mix, held)


def check_file_held_as_stored(tmp_path, arch, mix, held):
    with widened(arch) as name:
        f32 = tm.write_gguf(name, tmp_path / f"{name}.gguf")
    path = rewrite_as_k_quants(f32, tmp_path / f"{name}-{mix.__name__}.gguf", mix)
    quantized = load_engine(path, n_slots=1, ctx=64)
    reference = load_engine(path, n_slots=1, ctx=64, quantize="none")
    assert kinds(quantized) == held and kinds(reference) == {"dense"}
    # the file's bytes, not a repacked copy: 2-D tensors held at the file's 2.6-6.6 bits
    reader = gguf.GGUFReader(path)
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors if len(t.shape) == 2)
    held = quantized.model.w.nbytes() - sum(int(t.n_bytes) for t in reader.tensors
                                            if len(t.shape) == 1)
    assert held <= file_bytes * 1.01, (held, file_bytes)
    # what admission counts before a load (from the tensor list) is what the load holds
    assert weight_bytes(path) == quantized.model.w.nbytes()
    agree, kl, n = compare(reference, quantized, SEQS)
    assert n > 50 and agree >= 0.99 and kl <= 0.01, (agree, kl)
