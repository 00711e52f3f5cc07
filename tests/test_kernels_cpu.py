"""The CPU kernels against NumPy on every in-memory kind, batch size and path."""
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from pantheon.worker import kernels_cpu as kc
from pantheon.worker import matrices as qm
from test_qmatrix import K_QUANTS, random_tensor


def matrices():
    rng = np.random.default_rng(3)
    out = {}
    for qtype, blocks in ((QT.Q4_1, 6), (QT.Q4_K, 1), (QT.Q8_0, 6), (QT.Q5_1, 6),
                          (QT.Q5_K, 2), (QT.Q6_K, 1), (QT.Q3_K, 2), (QT.Q2_K, 3),
                          (QT.IQ4_NL, 6), (QT.IQ4_XS, 1)):
        raw, shape = random_tensor(qtype, 40, blocks)
        out[qtype.name] = qm.from_gguf(raw, qtype, shape)
    w = rng.standard_normal((40, 192)).astype(np.float32)
    out["F16"] = qm.from_gguf(w.astype(np.float16).view(np.uint8), QT.F16, w.shape)
    out["BF16"] = qm.from_gguf((w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8),
                               QT.BF16, w.shape)
    return out


MATS = matrices()


@pytest.mark.parametrize("name", list(MATS))
@pytest.mark.parametrize("batch", [1, 3, 8, 16, 17, 40])
@pytest.mark.parametrize("path", ["auto", "gemv", "tile"])
def test_matmul_equals_numpy(name, batch, path):
    m = MATS[name]
    x = np.random.default_rng(batch).standard_normal((batch, m.cols)).astype(np.float32)
    ref = x @ qm.dequantize(m).T
    got = kc.matmul(x, m, path)
    assert got.shape == (batch, m.rows) and got.dtype == np.float32
    if m.kind in kc.K_BYTES and path != "tile":
        # x as int16 per super-block of 256 (a step of 1/16000 of its largest |x|): that
        # rounding is what is left, measured here below 1e-4 of max |y|
        np.testing.assert_allclose(got, ref, rtol=0, atol=3e-4 * np.abs(ref).max())
        return
    # the decode path quantizes x to int16 per block of 32 (q4 and q8 kinds)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("qtype", K_QUANTS + [QT.IQ4_XS], ids=lambda t: t.name)
def test_k_quant_products_of_many_rows_cross_every_split(qtype, no_amx):
    """More rows of W than a sub-piece (64) and of the pool's pieces, and rows of x in
    groups of 8 with a remainder: every output element is the same row-by-row product
    (the integer path's sums do not depend on the batch; the AMX tiles' do, below)."""
    raw, shape = random_tensor(qtype, 200, 2)
    m = qm.from_gguf(raw, qtype, shape)
    x = np.random.default_rng(7).standard_normal((131, m.cols)).astype(np.float32)
    ref = x @ qm.dequantize(m).T
    got = kc.matmul(x, m)
    np.testing.assert_allclose(got, ref, rtol=0, atol=3e-4 * np.abs(ref).max())
    for b in (0, 7, 8, 130):        # a row of x alone takes the batch-1 loop: same values
        np.testing.assert_allclose(kc.matmul(x[b:b + 1], m)[0], got[b], rtol=1e-6,
                                   atol=1e-6 * np.abs(got[b]).max())


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q8_0, QT.Q5_1, QT.IQ4_NL])
@pytest.mark.parametrize("blocks", [1, 37])
def test_blocked_products_with_an_odd_block_and_more_than_a_scale_load(qtype, blocks):
    """Blocks are met in pairs, 16 scales at a time: an odd last block and a row of 37
    blocks (18 pairs: two loads of scales, the second partial) give the same products."""
    raw, shape = random_tensor(qtype, 70, blocks)
    m = qm.from_gguf(raw, qtype, shape)
    for batch in (1, 3, 7, 8, 11, 16):
        x = np.random.default_rng(batch).standard_normal((batch, m.cols)).astype(np.float32)
        ref = x @ qm.dequantize(m).T
        np.testing.assert_allclose(kc.matmul(x, m), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q4_0, QT.Q8_0, QT.Q5_1, QT.IQ4_NL],
                         ids=lambda t: t.name)
def test_blocked_products_of_many_rows_with_weight_rows_across_the_lanes(qtype, no_amx):
    """256-bit builds: from 17 rows of x a blocks-of-32 product widens groups of 8 rows of
    W into one vector per pair of K positions (worker/kernels/b_groups.c): 70 rows of W (a
    last group of 6), rows of x not a multiple of 6, every kind (mins or none, nibbles,
    bytes, the IQ4_NL levels), within the int16 activations' rounding of the float64
    product; and 16 rows forced onto the groups (the row kernels' rows otherwise) too."""
    raw, shape = random_tensor(qtype, 70, 9)
    m = qm.from_gguf(raw, qtype, shape)
    if kc.plan(m, 17) != "b_groups":
        pytest.skip("this build multiplies many rows another way (AVX-512 lanes, or no integer path)")
    ref_w = qm.dequantize(m).astype(np.float64)
    for batch in (17, 33, 131):
        x = np.random.default_rng(batch).standard_normal((batch, m.cols)).astype(np.float32)
        ref = x.astype(np.float64) @ ref_w.T
        np.testing.assert_allclose(kc.matmul(x, m), ref, rtol=0, atol=1e-4 * np.abs(ref).max())
    x = np.random.default_rng(16).standard_normal((16, m.cols)).astype(np.float32)
    ref = x.astype(np.float64) @ ref_w.T
    with kc.options(bgroups=16):
        assert kc.plan(m, 16) == "b_groups"
        groups = kc.matmul(x, m)
    assert kc.plan(m, 16) == "b_rows"
    np.testing.assert_allclose(groups, ref, rtol=0, atol=1e-4 * np.abs(ref).max())


AMX = pytest.mark.skipif(not (kc.library() and kc.HAS_AMX[0]),
                         reason="this host (or its kernel) has no AMX tiles")


def _amx_matrices():
    out = dict(MATS)
    for qtype, rows, blocks in ((QT.Q4_K, 200, 2), (QT.Q5_K, 70, 2), (QT.Q6_K, 145, 3),
                                (QT.Q3_K, 70, 2), (QT.Q4_1, 300, 37), (QT.IQ4_XS, 70, 2),
                                (QT.IQ4_NL, 70, 9)):
        raw, shape = random_tensor(qtype, rows, blocks)
        out[f"{qtype.name}x{rows}"] = qm.from_gguf(raw, qtype, shape)
    return out


AMX_MATS = _amx_matrices()


@AMX
@pytest.mark.parametrize("name", list(AMX_MATS))
@pytest.mark.parametrize("batch", [1, 8, 16, 17, 32, 33, 131])
def test_amx_tiles_equal_the_float64_product(name, batch):
    """x on the AMX tiles: within 3e-5 of max |y| of the exact product, every kind. Up to
    16 rows of x (a decode step) the weights' codes meet x's bf16 halves, run by run
    (runs in pairs: 37 blocks leave an odd one; W in pieces of 128 rows: 200, 300); more
    rows meet weights decoded into bf16 halves (three products), in pairs of x's tiles;
    rows of x and of W that do not fill a tile (40 rows of W, 33 and 131 of x)."""
    m = AMX_MATS[name]
    x = np.random.default_rng(batch).standard_normal((batch, m.cols)).astype(np.float32)
    ref = x.astype(np.float64) @ qm.dequantize(m).T.astype(np.float64)
    with kc.options(amx=1):
        got = kc.matmul(x, m)
    with kc.options(amx=0):
        other = kc.matmul(x, m)
    np.testing.assert_allclose(got, ref, rtol=0, atol=3e-5 * np.abs(ref).max())
    assert not np.array_equal(got, other)       # the tiles did run


def test_pantheon_amx_off_keeps_the_tiles_out_and_a_bad_value_is_refused(monkeypatch):
    m = MATS["Q4_1"]
    x = np.random.default_rng(9).standard_normal((33, m.cols)).astype(np.float32)
    with kc.options(amx=0):
        plain = kc.matmul(x, m)
    monkeypatch.setenv("PANTHEON_AMX", "off")
    off = kc.default_options()
    assert off["amx_rows"] == off["amx_rows_k"] == 0
    with kc.options(**off):
        assert not kc.HAS_AMX[0]
        np.testing.assert_array_equal(kc.matmul(x, m), plain)
    monkeypatch.setenv("PANTHEON_AMX", "sometimes")
    with pytest.raises(ValueError, match="PANTHEON_AMX must be one of auto, off, not 'sometimes'"):
        kc.default_options()


@pytest.mark.parametrize("name", list(MATS))
def test_gather_and_dequantize_rows(name):
    m = MATS[name]
    full = qm.dequantize(m)
    ids = [5, 0, 39, 5]
    np.testing.assert_allclose(kc.gather_rows(m, ids), full[ids], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(kc.dequantize_rows(m, 3, 11), full[3:11], rtol=1e-6, atol=1e-7)


def test_bad_inputs_are_refused_before_the_c_code_sees_them():
    m = MATS["Q4_1"]
    with pytest.raises(AssertionError, match="float32"):
        kc.matmul(np.ones((1, m.cols), np.float64), m)
    with pytest.raises(AssertionError, match="columns"):
        kc.matmul(np.ones((1, m.cols + 32), np.float32), m)
    with pytest.raises(AssertionError, match="C-contiguous"):
        kc.matmul(np.ones((m.cols, 2), np.float32).T, m)
    with pytest.raises(IndexError):
        kc.gather_rows(m, [40])
    broken = qm.QMatrix("q4", m.rows, m.cols, m.qs[:, :-1].copy(), m.scale, m.minv)
    with pytest.raises(AssertionError, match="qs must be"):
        kc.matmul(np.ones((1, m.cols), np.float32), broken)


def test_a_missing_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "no-such-cc")
    monkeypatch.setenv("PANTHEON_CACHE_DIR", str(tmp_path))
    with pytest.raises(kc.KernelBuildError, match="no C compiler 'no-such-cc'"):
        kc.build()


def _close(got, ref) -> bool:       # as above: x is quantized to int16 per block
    return np.allclose(got, ref, rtol=1e-4, atol=3e-4 * np.abs(ref).max())


def _q4_case(seed=3, rows=200, cols=256):
    rng = np.random.default_rng(seed)
    m = qm.quantize(rng.standard_normal((rows, cols)).astype(np.float32), "q4")
    return m, qm.dequantize(m)


def test_the_pool_serves_concurrent_callers_with_right_answers():
    """Callers from several threads at once: one uses the pool, the others run their
    chunks themselves; every product is right and none waits for another's job."""
    import threading
    kc.library()
    m, w = _q4_case()
    rng = np.random.default_rng(4)
    # (12 and 33 rows take the AMX tiles where the host has them: per-thread buffers)
    xs = [rng.standard_normal((b, 256)).astype(np.float32) for b in (1, 2, 5, 8, 12, 33) * 3]
    alone = [kc.matmul(x, m) for x in xs]
    assert all(_close(a, x @ w.T) for a, x in zip(alone, xs))
    errors = []

    def run(x, want):
        for _ in range(30):
            got = kc.matmul(x, m)
            if not np.array_equal(got, want):       # the same arithmetic, whoever runs it
                errors.append(np.abs(got - want).max())

    threads = [threading.Thread(target=run, args=(x, a)) for x, a in zip(xs, alone)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and kc.POOL_THREADS[0] == kc.threads()


def test_a_forked_child_without_the_pool_threads_still_computes():
    import os
    kc.library()
    m, w = _q4_case()
    x = np.random.default_rng(5).standard_normal((3, 256)).astype(np.float32)
    x33 = np.random.default_rng(6).standard_normal((33, 256)).astype(np.float32)
    pid = os.fork()
    if pid == 0:    # the child has the pool's state but none of its threads
        ok = _close(kc.matmul(x, m), x @ w.T) and _close(kc.matmul(x33, m), x33 @ w.T)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0


@pytest.mark.parametrize("n_heads,n_kv,hd", [(4, 4, 8), (9, 3, 64), (12, 2, 24), (12, 2, 128),
                                             (10, 1, 256), (5, 5, 64)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("generic", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_decode_attention_in_c_equals_the_numpy_expression(n_heads, n_kv, hd, window, generic,
                                                           dtype):
    """Queries of scattered slots and positions (one at position 0, one far along), every
    group shape and a head size that is not a multiple of 16: the C kernel's softmax
    and products against attention.attend_decodes over the same masked cache; head sizes
    of 64, 128 and 256 through their 16-positions-at-a-time loops and through the
    portable ones (`generic`); caches of float32 and of float16 (new rows rounded to
    nearest as NumPy's astype, widened as they are read)."""
    from pantheon.worker.layers import attention as at
    with kc.options(attn_generic=int(generic)):
        _check_decode_attention(at, n_heads, n_kv, hd, window, dtype)


def _check_decode_attention(at, n_heads, n_kv, hd, window, dtype):
    rng = np.random.default_rng(n_heads * hd)
    slots_n, ctx = 6, 40
    k = rng.standard_normal((slots_n, n_kv, ctx, hd)).astype(dtype)
    v = rng.standard_normal((slots_n, n_kv, ctx, hd)).astype(dtype)
    slots = np.array([4, 0, 2, 5], dtype=np.int64)
    pos = np.array([0, 17, 39, 8], dtype=np.int64)
    q = (3 * rng.standard_normal((4, n_heads, hd))).astype(np.float32)
    first = np.zeros(4, np.int64) if window is None else np.maximum(pos - window + 1, 0)
    k_new = rng.standard_normal((4, n_kv, hd)).astype(np.float32)
    v_wide = rng.standard_normal((4, n_kv * hd + 3)).astype(np.float32)   # rows of a wider matrix
    v_new = v_wide[:, :n_kv * hd].reshape(4, n_kv, hd)
    before = k.copy(), v.copy()
    got = np.zeros((4, n_heads * hd), np.float32)
    kc.attend_decodes(q, k_new, v_new, k, v, kc.DecodeBounds(slots, first, pos, k.shape), got)
    for b in range(4):          # the new rows went in at each query's position, nothing else
        np.testing.assert_array_equal(k[slots[b], :, pos[b]], k_new[b].astype(dtype))
        np.testing.assert_array_equal(v[slots[b], :, pos[b]], v_new[b].astype(dtype))
        before[0][slots[b], :, pos[b]] = k_new[b]
        before[1][slots[b], :, pos[b]] = v_new[b]
    np.testing.assert_array_equal(k, before[0])
    np.testing.assert_array_equal(v, before[1])
    for b in range(4):
        keys = np.arange(ctx)
        bias = np.where((keys >= first[b]) & (keys <= pos[b]), 0.0, -np.inf).astype(np.float32)
        want = at.attend_decodes(q[b:b + 1], k[slots[b]:slots[b] + 1].astype(np.float32),
                                 v[slots[b]:slots[b] + 1].astype(np.float32),
                                 bias[None, None, None, :], np.zeros(1, dtype=np.int64))
        exact = _attention_f64(q[b], k[slots[b], :, first[b]:pos[b] + 1],
                               v[slots[b], :, first[b]:pos[b] + 1])
        # scores reach ~250 here, so float32's rounding of them is ~1e-5 of |out| ~ 1:
        # both sides are held to the float64 computation, and to each other
        np.testing.assert_allclose(got[b], exact, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(want[0], exact, rtol=2e-5, atol=4e-5)
        np.testing.assert_allclose(got[b], want[0], rtol=2e-5, atol=5e-5)


def _attention_f64(q, k, v):
    """One query's attention [Hq * hd] in float64 over k, v [Hkv, L, hd] (q scaled)."""
    n_heads, hd = q.shape
    qg = q.astype(np.float64).reshape(k.shape[0], n_heads // k.shape[0], hd)
    s = qg @ k.astype(np.float64).transpose(0, 2, 1)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return ((p / p.sum(axis=-1, keepdims=True)) @ v.astype(np.float64)).reshape(-1)


def test_an_fp16_cache_stores_new_rows_as_numpy_rounds_them():
    """Past fp16's range (infinity, as astype), halfway cases, subnormals, signed zero."""
    special = np.array([70000.0, -65520.0, 65519.0, 1e-6, -3e-8, 2.0 ** -25, -0.0, 1 + 2.0 ** -11,
                        1 + 3 * 2.0 ** -11, 6.1e-5, np.inf, -np.inf] + [0.5] * 4, np.float32)
    k = np.zeros((1, 1, 4, 16), np.float16)
    v = np.zeros_like(k)
    row = special.reshape(1, 1, 16)
    bounds = kc.DecodeBounds(np.zeros(1, np.int64), np.full(1, 3), np.full(1, 3), k.shape)
    with np.errstate(over="ignore", invalid="ignore"):
        kc.attend_decodes(np.zeros((1, 1, 16), np.float32), row, -row, k, v, bounds,
                          np.zeros((1, 16), np.float32))
        np.testing.assert_array_equal(k[0, 0, 3].view(np.uint16), special.astype(np.float16).view(np.uint16))
        np.testing.assert_array_equal(v[0, 0, 3].view(np.uint16), (-special).astype(np.float16).view(np.uint16))
    assert not k[0, 0, :3].any()


def test_decode_attention_refuses_positions_outside_the_cache():
    shape = (2, 1, 8, 16)
    one = np.ones(1, np.int64)
    with pytest.raises(AssertionError, match="outside the cache"):
        kc.DecodeBounds(one, one * 0, one * 8, shape)       # position 8 of 8
    with pytest.raises(AssertionError, match="outside the cache"):
        kc.DecodeBounds(one * 2, one * 0, one, shape)       # slot 2 of 2
    bounds = kc.DecodeBounds(one, one * 0, one, shape)
    k = np.zeros((2, 1, 9, 16), np.float32)                 # not the shape it was made for
    new, out = np.zeros((1, 1, 16), np.float32), np.zeros((1, 16), np.float32)
    with pytest.raises(AssertionError):
        kc.attend_decodes(new, new, new, k, k, bounds, out)


def test_rms_norm_and_rope_in_c_equal_the_numpy_expressions():
    """The C element-wise layers against NumPy's: rows of a wider matrix (the fused qkv
    product's slices), partial rotary (the rest of a head passes through) and a scale."""
    from pantheon.worker.layers import ops
    rng = np.random.default_rng(11)
    wide = (10 * rng.standard_normal((5, 3 * 96 + 16))).astype(np.float32)
    x, w = wide[:, :96], rng.standard_normal(96).astype(np.float32)
    want = x * (1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + 1e-5)) * w
    got = kc.rms_norm(x, w, 1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    assert kc.rms_norm(x.T, w[:5], 1e-5) is None          # columns: NumPy's way
    for half in (8, 6):                                    # full and partial rotary of 16
        q = wide[:, 16:16 + 6 * 16].reshape(5, 6, 16)
        ang = rng.standard_normal((5, 1, half)).astype(np.float32)
        cos, sin = np.cos(ang), np.sin(ang)
        x1, x2, rest = q[..., :half], q[..., half:2 * half], q[..., 2 * half:]
        want = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1) * 0.125
        got = ops.rope(q, cos, sin, 0.125)
        assert got.flags.c_contiguous and got.shape == q.shape
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_chain_of_matrices_fetches_ahead_without_changing_a_product():
    """chain() points each matrix at the next (the last at the first); the products are
    bit-for-bit those of unchained matrices, in any order of calls."""
    rng = np.random.default_rng(12)
    mats = [qm.quantize(rng.standard_normal((r, 256)).astype(np.float32), "q4") for r in (64, 200)]
    raw, shape = random_tensor(QT.Q4_K, 96, 1)
    mats.append(qm.from_gguf(raw, QT.Q4_K, shape))
    x = rng.standard_normal((3, 256)).astype(np.float32)
    alone = [kc.matmul(x, m) for m in mats]
    kc.chain([mats[0], [mats[1], mats[2]]])       # a list is a fused projection's parts
    structs = [m.__dict__["_c_mat"] for m in mats]
    assert [s[1].next for s in structs] == [structs[1][2], structs[2][2], structs[0][2]]
    for m, want in list(zip(mats, alone))[::-1] * 2:
        np.testing.assert_array_equal(kc.matmul(x, m), want)


@pytest.mark.parametrize("isa", ["avx2", "generic"])
def test_the_kernels_built_without_avx512_pass_these_tests(isa, tmp_path):
    """Hosts without AVX-512 (the Xeons beside K80s) or without AVX run the 256-bit and the
    portable paths: this file's tests (and the C decode layers', the fused layers' and the
    int8 activations') pass against a build for those (PANTHEON_ISA), which leaves the
    wider paths out."""
    import os
    import subprocess
    import sys
    if isa == "avx2" and " avx2" not in kc._cpu_key():
        pytest.skip("this host has no AVX2")
    env = dict(os.environ, PANTHEON_ISA=isa, PANTHEON_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           __file__, str(Path(__file__).with_name("test_decode_cpu.py")),
                           str(Path(__file__).with_name("test_activations.py")),
                           str(Path(__file__).with_name("test_fused_layers.py")),
                           "-k", "not built_without_avx512"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout
    assert list((tmp_path / "cache" / "kernels").glob("*.so")), "the test build was not used"


def test_pantheon_isa_picks_the_target_and_a_bad_value_is_refused(monkeypatch):
    monkeypatch.setenv("PANTHEON_ISA", "avx2")
    assert kc.isa_flags()[0] == "-march=haswell"
    monkeypatch.setenv("PANTHEON_ISA", "sse9")
    with pytest.raises(ValueError, match="PANTHEON_ISA must be one of native, avx2, generic, not 'sse9'"):
        kc.isa_flags()


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_k_quants_at_batch_1_through_int8_digits_equal_the_int16_path(qtype):
    """Batch-1 K-quant products split each int16 activation into two int8 digits: the
    same integer sums as the int16 path (only the float additions' order differs; Q6_K's
    -32 and Q3_K's -4 offsets and Q2_K's mins come off through the activations' sums per
    16)."""
    raw, shape = random_tensor(qtype, 300, 6)
    m = qm.from_gguf(raw, qtype, shape)
    x = (50 * np.random.default_rng(13).standard_normal((1, m.cols))).astype(np.float32)
    with kc.options(digits=0):
        int16 = kc.matmul(x, m)
    digits = kc.matmul(x, m)
    np.testing.assert_allclose(digits, int16, rtol=0, atol=1e-6 * np.abs(int16).max())
    ref = x @ qm.dequantize(m).T
    np.testing.assert_allclose(digits, ref, rtol=0, atol=3e-4 * np.abs(ref).max())


@pytest.mark.parametrize("n", [0, 1, 2 << 20, (5 << 20) + 3])
def test_the_loads_copies_and_zeros_on_the_pool_move_every_byte(n):
    """Weights out of the file's pages and the KV caches' first touch: pieces of 2 MiB,
    the last one short; a strided view goes NumPy's way."""
    src = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    dst = np.full(n, 7, np.uint8)
    kc.copy_into(dst, src)
    np.testing.assert_array_equal(dst, src)
    kc.zero(dst)
    assert not dst.any()
    wide = np.arange(24, dtype=np.int16).reshape(4, 6)
    out = np.zeros((4, 3), np.int16)
    kc.copy_into(out, wide[:, ::2])
    np.testing.assert_array_equal(out, wide[:, ::2])


@pytest.mark.parametrize("shape,dtype", [((1, 1), np.int16), ((8, 1536), np.int16),
                                         ((3, 35), np.float32), ((16, 8960), np.int16)])
def test_the_scratch_x_is_read_from_is_zeroed_and_cache_line_aligned(shape, dtype):
    for _ in range(8):              # malloc's addresses vary: 16-byte steps
        a = kc.aligned_zeros(shape, dtype)
        assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous
        assert a.ctypes.data % 64 == 0 and not a.any()
        a[...] = 7                  # writable, and its own memory's end is not overrun
        assert (a == 7).all()
    kc._local.__dict__.pop("cbufs", None)
    kc._cscratch(shape[0], 256)
    arrays = kc._local.cbufs[(shape[0], 256)][0]
    assert all(x.ctypes.data % 64 == 0 for x in arrays)


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_k_quant_products_in_spans_of_the_row_equal_whole_rows(qtype):
    """A long row meets 8 rows of x in spans of super-blocks that keep x in L1, each
    span's sums added to the output: the same products as whole rows for every group size
    (1-8 rows of x, and a group of 8 plus a short one), and as the float64 product."""
    raw, shape = random_tensor(qtype, 70, 12)      # K = 3072: spans of 6, 3, ... blocks
    m = qm.from_gguf(raw, qtype, shape)
    ref_w = qm.dequantize(m).astype(np.float64)
    for batch in (2, 3, 5, 8, 11):
        x = np.random.default_rng(batch).standard_normal((batch, m.cols)).astype(np.float32)
        got = {}
        for span in (0, 512, 24 << 10):      # whole rows, one block, the default
            with kc.options(xspan=span):
                got[span] = kc.matmul(x, m)
        whole = got[0]
        for span in (512, 24 << 10):
            np.testing.assert_allclose(got[span], whole, rtol=0, atol=2e-6 * np.abs(whole).max())
        ref = x.astype(np.float64) @ ref_w.T
        np.testing.assert_allclose(got[24 << 10], ref, rtol=0, atol=3e-4 * np.abs(ref).max())


def without_lanes(x, m):
    """x @ W.T with the token lanes turned off (the row kernels, or the tiles beyond them)."""
    with kc.options(ktile=0):
        return kc.matmul(x, m)


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_k_quant_products_with_tokens_across_the_lanes_equal_the_row_kernels(qtype, no_amx):
    """From 13 rows of x the K-quant products put 16 tokens across a vector's lanes (the
    weights' pairs broadcast): rows of W not a multiple of 8, tokens not a multiple of 16
    (zeros fill the last group and are never stored), the same integer sums as the row
    kernels, and within 3e-4 of max |y| of the float64 product (Q2_K keeps the row
    kernels: the same numbers either way)."""
    raw, shape = random_tensor(qtype, 77, 6)
    m = qm.from_gguf(raw, qtype, shape)
    ref_w = qm.dequantize(m).astype(np.float64)
    for batch in (13, 16, 17, 31, 40, 131):
        x = np.random.default_rng(batch).standard_normal((batch, m.cols)).astype(np.float32)
        rows = without_lanes(x, m)
        lanes = kc.matmul(x, m)
        assert np.isfinite(lanes).all()
        np.testing.assert_allclose(lanes, rows, rtol=0, atol=2e-6 * np.abs(rows).max())
        ref = x.astype(np.float64) @ ref_w.T
        np.testing.assert_allclose(lanes, ref, rtol=0, atol=3e-4 * np.abs(ref).max())


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.Q5_0, QT.Q5_1], ids=lambda t: t.name)
def test_blocked_products_of_11_rows_and_more_take_tokens_across_the_lanes(qtype, no_amx):
    """q4 and q8 (blocks of 32) from 11 rows of x: tokens across the lanes with x in the
    full int16 range per block (the row kernels up to 16 rows and the dequantized tiles and
    BLAS beyond took these before, and still do with the toggle off): within 1e-4 of max
    |y| of the float64 product, for rows of W not a multiple of 8 and tokens not a
    multiple of 16."""
    raw, shape = random_tensor(qtype, 77, 18)
    m = qm.from_gguf(raw, qtype, shape)
    ref_w = qm.dequantize(m).astype(np.float64)
    lib = kc.library()
    for batch in (11, 16, 17, 31, 40, 131):
        x = np.random.default_rng(batch).standard_normal((batch, m.cols)).astype(np.float32)
        lanes = kc.matmul(x, m)
        tiles = without_lanes(x, m)
        ref = x.astype(np.float64) @ ref_w.T
        np.testing.assert_allclose(lanes, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
        # the lanes off: the row kernels at 16 rows (x in int16), the tiles beyond (256-bit
        # builds: the groups of W's rows, x in int16)
        off_tol = 1e-4 if batch <= 16 or kc.plan(m, batch) == "b_groups" else 1e-5
        np.testing.assert_allclose(tiles, ref, rtol=0, atol=off_tol * np.abs(ref).max())
        if lib.pn_has_lanes():                              # an AVX-512 (VNNI) build
            assert not np.array_equal(lanes, tiles)         # the lanes did run


@pytest.mark.parametrize("rows", [16, 200, 1000])
def test_tile_products_split_over_the_kernels_threads_equal_one_threads(rows, monkeypatch):
    """The many-row BLAS path splits W's rows over the kernels' threads (BLAS itself runs
    one thread per caller): each part lands in its own columns of out, whatever the split."""
    rng = np.random.default_rng(rows)
    m = qm.quantize(rng.standard_normal((rows, 256)).astype(np.float32), "q4")
    x = rng.standard_normal((40, 256)).astype(np.float32)
    monkeypatch.setattr(kc, "SPLIT_TILES", [False])
    alone = kc.matmul(x, m, path="tile")
    monkeypatch.setattr(kc, "SPLIT_TILES", [True])
    monkeypatch.setattr(kc, "SPLIT_MIN_MACS", 0)
    for n in (2, 3, 7):
        monkeypatch.setattr(kc, "threads", lambda: n)
        np.testing.assert_allclose(kc.matmul(x, m, path="tile"), alone, rtol=1e-5, atol=1e-5)
    ref = x @ qm.dequantize(m).T
    np.testing.assert_allclose(alone, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_the_kernels_address_cache_keeps_no_array_alive():
    """Norm weights and KV caches are looked up by address once; an unloaded model's
    arrays must still be freed with it (the cache held them: +470 MB per unload)."""
    import weakref
    w = np.ones(64, np.float32)
    out = kc.rms_norm(np.ones((2, 64), np.float32), w, 1e-6)
    np.testing.assert_allclose(out, 1.0, rtol=1e-5)
    gone = weakref.ref(w)
    del w
    assert gone() is None
    w = np.full(64, 2.0, np.float32)          # a new array, perhaps at the same id
    np.testing.assert_allclose(kc.rms_norm(np.ones((2, 64), np.float32), w, 1e-6), 2.0,
                               rtol=1e-5)


def quantize_x8_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x as int8 activations take it on many rows (x8_rows.c), returned dequantized, and
    which of its [rows, K / 256] blocks were held as two digits: per row and block of 256
    one step D = max |x| / 127 where every run of 32 but runs of zeros has its largest |x|
    at >= 1/16 of the block's, else (held) D = max |x| / 16000; q = x / D rounded half
    away from zero. (A row with a third or more of its blocks held takes the int16
    kernels instead.)"""
    f = np.float32
    v = x.astype(f).reshape(x.shape[0], -1, 8, 32)
    run = np.abs(v).max(axis=3)
    top = run.max(axis=2)
    least = np.where(run > 0, run, np.inf).min(axis=2)     # a run of zeros is exact
    held = np.isfinite(least) & (least * f(16) < top)
    lim = np.where(held, f(16000), f(127)).astype(f)
    d = (top / lim).astype(f)
    inv = np.where(d > 0, f(1) / np.where(d > 0, d, f(1)), f(0)).astype(f)
    r = (v * inv[..., None, None]).astype(f)
    q = np.trunc(r + np.copysign(f(0.5), r)).clip(-lim[..., None, None], lim[..., None, None])
    return (q * d[..., None, None]).reshape(x.shape), held


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_XS], ids=lambda t: t.name)
def test_int8_activations_are_the_rounding_of_x_that_quantize_x8_rows_says(qtype):
    """A matrix set to int8 activations (builds with those kernels: AVX2 ones) multiplies
    x as quantize_x8_rows rounds it, at batch 1 and on more rows — exactly, up to float
    additions; elsewhere set_int8 changes nothing. x has an outlier channel: its block is
    held as two digits (one step per 256 would lose the block's small values)."""
    raw, shape = random_tensor(qtype, 300, 6)
    m = qm.from_gguf(raw, qtype, shape)
    rng = np.random.default_rng(17)
    x = (50 * rng.standard_normal((3, m.cols))).astype(np.float32)
    x[:, 300] = 40 * 150                          # block 1's outlier
    x[:, :32] = 0                                 # a run of zeros: exact, not held
    w = qm.dequantize(m).astype(np.float64)
    int16, rows16 = kc.matmul(x[:1], m), kc.matmul(x, m)
    kc.set_int8(m, True)
    try:
        got, rows = kc.matmul(x[:1], m), kc.matmul(x, m)
    finally:
        kc.set_int8(m, False)
    if not kc.takes_int8(m):                 # AVX-512 and portable builds: int16 stays
        np.testing.assert_array_equal(got, int16)
        np.testing.assert_array_equal(rows, rows16)
        return
    xr, held = quantize_x8_rows(x)
    assert held[:, 1].all() and held.sum() == 3
    ref = xr.astype(np.float64) @ w.T
    tol = 2e-5 * np.abs(ref).max()
    np.testing.assert_allclose(got, ref[:1], rtol=0, atol=tol)
    np.testing.assert_allclose(rows, ref, rtol=0, atol=tol)
    assert np.abs(rows - rows16).max() > 1e-3 * np.abs(ref).max()  # it did take int8
    np.testing.assert_array_equal(kc.matmul(x[:1], m), int16)       # and off again
    np.testing.assert_array_equal(kc.matmul(x, m), rows16)


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_XS], ids=lambda t: t.name)
def test_int8_activations_on_many_rows_hold_each_row_s_outlier_blocks_as_two_digits(qtype):
    """x8_rows.c at every group size (8, 4, 2, 1 rows of x a pass and their mixes), rows
    whose blocks are held and rows beside them that are not (each row's own choice),
    rows of zeros, and rows long enough (40 blocks) to be taken in spans of super-blocks:
    each product equals quantize_x8_rows' x against the dequantized weights, and each
    row's product is what that row alone gets at batch 1 (nothing depends on the rows
    beside it)."""
    raw, shape = random_tensor(qtype, 70, 40)
    m = qm.from_gguf(raw, qtype, shape)
    if not kc.takes_int8(m):
        pytest.skip("a build without int8 activations (AVX-512 or portable)")
    w = qm.dequantize(m).astype(np.float64)
    rng = np.random.default_rng(5)
    for batch in (2, 3, 7, 8, 11, 19):
        x = rng.standard_normal((batch, m.cols)).astype(np.float32)
        for b in range(0, batch, 2):              # every other row: outliers in 3 blocks
            x[b, rng.choice(m.cols // 256, 3, replace=False) * 256 + 7] = 300
        x[batch - 1] = 0
        xr, held = quantize_x8_rows(x)
        assert held[0].sum() == 3 and not held[1].any()
        kc.set_int8(m, True)
        try:
            assert kc.plan(m, batch) == "x8_rows"
            got = kc.matmul(x, m)
            alone = np.concatenate([kc.matmul(x[b:b + 1], m) for b in range(batch)])
        finally:
            kc.set_int8(m, False)
        ref = xr.astype(np.float64) @ w.T
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5 * np.abs(ref).max())
        np.testing.assert_allclose(got, alone, rtol=0, atol=2e-5 * np.abs(ref).max())
        assert not got[batch - 1].any()


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.IQ4_XS], ids=lambda t: t.name)
def test_a_row_with_outliers_in_a_third_of_its_blocks_takes_the_int16_kernels(qtype):
    """Held blocks cost a second pass, so a row with a third or more of them held (a
    sequence's first positions can look so) is multiplied as int16 activations, at
    batch 1 and among int8 rows alike; every such row at once: the int16 product."""
    raw, shape = random_tensor(qtype, 70, 12)
    m = qm.from_gguf(raw, qtype, shape)
    if not kc.takes_int8(m):
        pytest.skip("a build without int8 activations (AVX-512 or portable)")
    rng = np.random.default_rng(9)
    x = rng.standard_normal((5, m.cols)).astype(np.float32)
    x[1, 7::256] = 300                        # every block of rows 1 and 3 held
    x[3, 7:4 * 256:256] = 300                 # 4 of 12: a third
    x[0, 7] = 300                             # row 0: 1 of 12, int8
    held = quantize_x8_rows(x)[1]
    assert held.sum(axis=1).tolist()[:4] == [1, 12, 0, 4]
    int16 = kc.matmul(x, m)
    int16_alone = np.concatenate([kc.matmul(x[b:b + 1], m) for b in range(5)])
    kc.set_int8(m, True)
    try:
        got = kc.matmul(x, m)
        dense = kc.matmul(x[[1, 3]], m)
        alone = np.concatenate([kc.matmul(x[b:b + 1], m) for b in range(5)])
    finally:
        kc.set_int8(m, False)
    tol = 1e-5 * np.abs(int16).max()
    for b in (1, 3):
        np.testing.assert_allclose(got[b], int16[b], rtol=0, atol=tol)
        np.testing.assert_allclose(alone[b], int16_alone[b], rtol=0, atol=tol)
    np.testing.assert_array_equal(dense, kc.matmul(x[[1, 3]], m))
    for b in (0, 2, 4):                       # the others: int8, as alone
        assert np.abs(got[b] - int16[b]).max() > 1e-4 * np.abs(int16).max()
        np.testing.assert_allclose(got[b], alone[b], rtol=0, atol=tol)


def test_one_plan_decides_each_product_and_says_which():
    """plan.c's pn_plan is the one place a product's kernel is chosen: what
    pn_matmul_int runs and what pn_int_ok (the C decode layer's question) answers."""
    if not kc.HAS_INT_PATH[0]:
        pytest.skip("a build without the integer products")
    lib = kc.library()
    k4, q4 = MATS["Q4_K"], MATS["Q4_1"]
    assert kc.plan(MATS["F16"], 1) == "none"
    assert kc.plan(k4, 1) == "digits"                # batch 1 (no AMX below 8 rows)
    assert kc.plan(k4, 3) == "k_rows" and kc.plan(q4, 3) == "b_rows"
    lanes = bool(lib.pn_has_lanes())
    assert kc.plan(q4, 17) in (("b_lanes", "amx") if lanes else ("b_groups", "amx"))
    if not lanes:                                    # 256-bit builds: the row kernels to 16
        assert kc.plan(q4, 16) in ("b_rows", "amx")
    with kc.options(digits=0):
        assert kc.plan(k4, 1) == "k_rows"
    kc.set_int8(k4, True)
    try:
        assert kc.plan(k4, 1) == ("x8" if kc.HAS_X8[0] else "digits")
        assert kc.plan(k4, 2) == ("x8_rows" if kc.HAS_X8[0] else "k_rows")
    finally:
        kc.set_int8(k4, False)
    for m in MATS.values():
        for rows in (1, 4, 16, 17):
            assert bool(lib.pn_int_ok(kc._cmat(m), rows)) == (kc.plan(m, rows) != "none")


def test_options_change_the_kernels_for_a_block_and_restore_them():
    """kernels_cpu.options re-inits the kernels (pn_init) with some fields changed and
    restores the previous options after the block, also when it raises; a name that is
    not a field of PnOptions is refused before anything changes."""
    if not kc.HAS_INT_PATH[0]:
        pytest.skip("a build without the integer products")
    k4 = MATS["Q4_K"]
    before = dict(kc._options)
    with kc.options(digits=0, ktile=5):
        assert kc._options["ktile_k"] == kc._options["ktile_b"] == 5
        assert kc.plan(k4, 1) == "k_rows"
        with kc.options(digits=None):                # None: the worker's default
            assert kc.plan(k4, 1) == "digits"
        assert kc.plan(k4, 1) == "k_rows"
    assert kc._options == before and kc.plan(k4, 1) == "digits"
    with pytest.raises(RuntimeError, match="inside"):
        with kc.options(digits=0):
            raise RuntimeError("inside")
    assert kc._options == before and kc.plan(k4, 1) == "digits"
    with pytest.raises(TypeError, match="'bogus' is not an option"):
        with kc.options(bogus=1):
            pass
    assert kc._options == before
