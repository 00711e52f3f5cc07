"""Gated DeltaNet's C prefill (worker/kernels/deltanet.c) against the NumPy reference
(worker/layers/gated_deltanet.py: deltanet_core, then the gated norm).

Random inputs of several shapes: both head layouts (value heads tiled over the key heads,
as a GGUF; grouped, as a Hugging Face checkpoint), d_v a multiple of the C tile's width
(16 columns with AVX-512, 8 with AVX2, 4 without) or not, a conv kernel shorter than the chunk or not; chunks of several sizes,
ragged, with the conv tail and the state carried from one call to the next."""
import numpy as np
import pytest

from pantheon.common.arch.stack import GatedDeltaNet
from pantheon.worker import kernels_cpu
from pantheon.worker.layers import gated_deltanet as gdn
from pantheon.worker.layers.ops import gated_rms_norm

F32 = np.float32
EPS = 1e-6

try:
    kernels_cpu.library()
except kernels_cpu.KernelBuildError:
    pytest.skip("no C compiler: the NumPy path is the only one", allow_module_level=True)


def weights(spec: GatedDeltaNet, rng) -> gdn.DeltaNetWeights:
    return gdn.DeltaNetWeights(
        w_in=None, w_ba=None, w_out=None, dt=None, a=None,
        conv=(rng.standard_normal((spec.conv_dim, spec.conv_kernel)) * 0.5).astype(F32),
        norm=rng.uniform(0.5, 1.5, spec.d_v).astype(F32))


def inputs(spec: GatedDeltaNet, n: int, rng):
    """The in-product's rows [n, conv_dim + nv dv] (mixed | z) and beta, g [n, nv]."""
    proj = rng.standard_normal((n, spec.conv_dim + spec.value_dim)).astype(F32)
    beta = rng.uniform(0.0, 1.0, (n, spec.n_v_heads)).astype(F32)
    g = -rng.uniform(0.0, 2.0, (n, spec.n_v_heads)).astype(F32)
    return proj, beta, g


def reference(spec, w, proj, beta, g, tail, state):
    c, nv, dv = spec.conv_dim, spec.n_v_heads, spec.d_v
    o, tail, state = gdn.deltanet_core(proj[:, :c], beta, g, w.conv, spec, tail, state)
    z = proj[:, c:].reshape(-1, nv, dv)
    return gated_rms_norm(o, z, w.norm, EPS).reshape(len(proj), -1), tail, state


def c_prefill(spec, w, proj, beta, g, tail, state):
    """The C call on copies of tail and state (advanced in place) → (out, tail, state)."""
    tail, state = tail.copy(), state.copy()
    c = spec.conv_dim
    out = np.full((len(proj), spec.value_dim), np.nan, F32)
    assert gdn.deltanet_chunk_c(proj[:, :c], proj[:, c:], beta, g, w, spec, tail, state,
                                EPS, out)
    return out, tail, state


def close(got, want, tol=2e-5):
    scale = max(1.0, float(np.abs(want).max()))
    return float(np.abs(got - want).max()) <= tol * scale


SPECS = {
    "qwen35-0.8b heads (16 tiles of 128)": GatedDeltaNet(4, 4, 128, 128, 4),
    "tiled, r = 3, d_v = 16": GatedDeltaNet(2, 6, 16, 16, 4),
    "grouped (hf), r = 2, d_v = 18 (a partial tile)": GatedDeltaNet(2, 4, 24, 18, 4, hf_layout=True),
    "d_v = 6, d_k = 5 (no full tile), kernel 2": GatedDeltaNet(1, 3, 5, 6, 2),
}


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("sizes", [(1,), (3, 1), (64, 37), (5, 130)])
def test_c_prefill_equals_the_numpy_reference_across_calls(name, sizes):
    spec = SPECS[name]
    rng = np.random.default_rng(sum(sizes) * 31 + len(name))
    w = weights(spec, rng)
    ref_tail = rng.standard_normal((spec.conv_kernel - 1, spec.conv_dim)).astype(F32)
    ref_state = rng.standard_normal((spec.n_v_heads, spec.d_k, spec.d_v)).astype(F32)
    c_tail, c_state = ref_tail.copy(), ref_state.copy()
    for n in sizes:                     # the state carried from one call into the next
        proj, beta, g = inputs(spec, n, rng)
        want, ref_tail, ref_state = reference(spec, w, proj, beta, g, ref_tail, ref_state)
        got, c_tail, c_state = c_prefill(spec, w, proj, beta, g, c_tail, c_state)
        assert close(got, want), f"out of a {n}-token call: {np.abs(got - want).max():.2e}"
        assert np.array_equal(c_tail, ref_tail), "the conv tail"
        assert close(c_state, ref_state), f"state: {np.abs(c_state - ref_state).max():.2e}"


def test_the_call_reads_rows_of_a_wider_matrix_and_writes_rows_of_one():
    """The layer passes views: mixed and z are column ranges of the in-product's rows,
    out rows of a step's scratch; the columns beside them stay untouched."""
    spec = SPECS["tiled, r = 3, d_v = 16"]
    rng = np.random.default_rng(2)
    w = weights(spec, rng)
    proj, beta, g = inputs(spec, 20, rng)
    tail = np.zeros((spec.conv_kernel - 1, spec.conv_dim), F32)
    state = np.zeros((spec.n_v_heads, spec.d_k, spec.d_v), F32)
    want, _, _ = reference(spec, w, proj, beta, g, tail, state)
    wide = np.full((20, spec.value_dim + 7), 5.0, F32)
    c = spec.conv_dim
    assert gdn.deltanet_chunk_c(proj[:, :c], proj[:, c:], beta, g, w, spec, tail, state, EPS,
                                wide[:, 3:3 + spec.value_dim])
    assert close(wide[:, 3:3 + spec.value_dim], want)
    assert (wide[:, :3] == 5.0).all() and (wide[:, 3 + spec.value_dim:] == 5.0).all()


def test_the_switch_and_other_arrays_take_the_numpy_path():
    spec = SPECS["tiled, r = 3, d_v = 16"]
    rng = np.random.default_rng(4)
    w = weights(spec, rng)
    proj, beta, g = inputs(spec, 4, rng)
    tail = np.zeros((spec.conv_kernel - 1, spec.conv_dim), F32)
    state = np.zeros((spec.n_v_heads, spec.d_k, spec.d_v), F32)
    out = np.zeros((4, spec.value_dim), F32)
    c = spec.conv_dim
    args = (proj[:, :c], proj[:, c:], beta, g, w, spec, tail, state, EPS, out)
    gdn.C_PREFILL[0] = False
    try:
        assert not gdn.deltanet_chunk_c(*args)
    finally:
        gdn.C_PREFILL[0] = True
    # a float64 state (not what a layer holds) is left to NumPy, untouched
    state64 = state.astype(np.float64)
    assert not gdn.deltanet_chunk_c(*args[:7], state64, EPS, out)
    assert not out.any() and not state64.any()


def test_the_engine_gives_the_numpy_paths_logits_and_states(tmp_path):
    """The tiny qwen35 model (both head layouts) with the C prefill and without: a prompt
    in two chunks, then one step that decodes it beside another slot's prefill chunk."""
    import tiny_models as tm
    from pantheon.worker.engine import load_engine
    from pantheon.worker.model import Span

    tokens = tm.golden_tokens("qwen35")[2]
    paths = [tm.write_gguf("qwen35", tmp_path / "q.gguf"),
             tm.write_safetensors_dir("qwen35", tmp_path / "hf")]
    for path in paths:
        got = {}
        for on in (False, True):
            gdn.C_PREFILL[0] = on
            try:
                e = load_engine(path, n_slots=2, ctx=200)
                rows = [e.forward(np.array(tokens[:50]), [Span(0, 0, 50)])[0],
                        e.forward(np.array(tokens[50:70]), [Span(0, 50, 20)])[0]]
                rows += list(e.forward(np.array(tokens[70:71] + tokens[:33]),
                                       [Span(0, 70, 1), Span(1, 0, 33)]))
            finally:
                gdn.C_PREFILL[0] = True
            states = [np.array(b.mixer.ssm_state) for b in e.model.blocks
                      if isinstance(b.mixer, gdn.GatedDeltaNetLayer)]
            got[on] = np.stack(rows), states
        (ref_rows, ref_states), (c_rows, c_states) = got[False], got[True]
        assert close(c_rows, ref_rows, 1e-4) and len(c_states) == 3
        assert all(close(c, r, 1e-4) for c, r in zip(c_states, ref_states))
