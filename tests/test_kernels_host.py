"""worker/kernels_cuda.py's kernels run on the host (worker/simt_host.py), against
qmatrix.dequantize: the logic of every kernel, with the launch plans CuPy uses."""
import shutil

import numpy as np
import pytest

import kernel_cases
from pantheon.worker import kernels_cuda as kc
from pantheon.worker import matrices as qm
from pantheon.worker.simt_host import HostKernels

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
CASES = kernel_cases.cases()


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    return HostKernels(kc.SOURCE, tmp_path_factory.mktemp("simt"))


def gemv(host, x, m, ksplit=None):
    kc.check(m, x)
    y = np.full((x.shape[0], m.rows), np.nan, dtype=np.float32)
    for launch in kc.gemv_launches(x, m, y, ksplit):
        host.run(launch)
    return y


@pytest.mark.parametrize("name", list(CASES))
def test_dequantize_rows_gives_numpys_bits(host, name):
    m = CASES[name]
    for r0, r1 in ((0, m.rows), (5, 6), (3, 30)):
        out = np.full((r1 - r0, m.cols), np.nan, dtype=np.float32)
        host.run(kc.rows_launch(m, r0, r1, out))
        np.testing.assert_array_equal(out.view(np.uint32),
                                      qm.dequantize(m, slice(r0, r1)).view(np.uint32))




def test_every_fp16_bit_pattern_converts_as_numpy(host):
    """Subnormals, infinities, NaN payloads: all 65536 values as f16 weights (the
    scales of q4 and q8 go through the same conversion)."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    m = qm.QMatrix("f16", 256, 256, bits)
    out = np.empty((m.rows, m.cols), dtype=np.float32)
    host.run(kc.rows_launch(m, 0, m.rows, out))
    np.testing.assert_array_equal(out.view(np.uint32), qm.dequantize(m).view(np.uint32))


@pytest.mark.parametrize("name", list(CASES))
def test_gather_rows_and_bad_ids(host, name):
    m = CASES[name]
    ids = np.array([3, 0, 36, 3, -1, 37, 12], dtype=np.int32)
    out = np.empty((len(ids), m.cols), dtype=np.float32)
    host.run(kc.gather_launch(m, ids, out))
    full = qm.dequantize(m)
    good = (ids >= 0) & (ids < m.rows)
    np.testing.assert_array_equal(out[good], full[ids[good]])
    assert np.isnan(out[~good]).all()


@pytest.mark.parametrize("name", list(CASES))
def test_gemv_matches_numpy_for_every_batch_width(host, name):
    m = CASES[name]
    rng = np.random.default_rng(7)
    for b in (1, 2, 3, 8, 13, 32, 33):      # every NB, a padded width, two launches
        x = rng.standard_normal((b, m.cols)).astype(np.float32)
        want, bound = kernel_cases.reference(x, m)
        y = gemv(host, x, m)
        assert (np.abs(y - want) <= bound).all(), (name, b, np.abs(y - want).max())


@pytest.mark.parametrize("ksplit", [2, 8])
@pytest.mark.parametrize("name", ["Q4_1", "Q6_K", "bf16"])
def test_gemv_split_rows_add_up(host, name, ksplit):
    """Warps sharing rows (some with no stretch of K at all at ksplit 8)."""
    m = CASES[name]
    x = np.random.default_rng(3).standard_normal((5, m.cols)).astype(np.float32)
    want, bound = kernel_cases.reference(x, m)
    assert (np.abs(gemv(host, x, m, ksplit) - want) <= bound).all()


def test_geometry_splits_few_long_rows_only():
    assert kc.gemv_geometry(49152, 576, 1) == (1536, 1)      # many rows: one warp per 4
    grid, split = kc.gemv_geometry(576, 8192, 1)
    assert split == 8 and grid == 144                        # few long rows: split K
    assert kc.gemv_geometry(37, 544, 32) == (5, 1)           # 3 stretches: nothing to split


def test_checks_refuse_what_the_kernels_cannot_read():
    m = CASES["Q8_0"]
    x = np.zeros((2, m.cols), dtype=np.float64)
    with pytest.raises(AssertionError, match="dtype"):
        kc.check(m, x)
    with pytest.raises(AssertionError, match="contiguous"):
        kc.check(m, np.zeros((m.cols, 2), dtype=np.float32).T)
    bad = qm.QMatrix("q8", m.rows, m.cols, m.qs, m.scale, None, bs=64)
    with pytest.raises(ValueError, match="block size"):
        kc.check(bad)
    with pytest.raises(ValueError, match="K % 8"):
        kc.check(qm.QMatrix("f16", 2, 12, np.zeros((2, 12), np.uint16)))


@pytest.fixture
def numpy_device(host, monkeypatch):
    """The CuPy entry points with NumPy standing in for CuPy and the host for the GPU."""
    monkeypatch.setattr(kc, "_cupy", lambda a: np)
    monkeypatch.setattr(kc, "run", lambda launch, cp: host.run(launch))


@pytest.mark.parametrize("name", ["Q4_K", "q8_0", "f16"])
def test_entry_points_choose_paths_and_tiles(numpy_device, monkeypatch, name):
    m = CASES[name]
    rng = np.random.default_rng(5)
    for b, path in ((1, "auto"), (4, "tile"), (40, "gemv"), (40, "auto"), (0, "auto")):
        x = rng.standard_normal((b, m.cols)).astype(np.float32)
        want, bound = kernel_cases.reference(x, m)
        y = kc.matmul(x, m, path=path)
        assert y.shape == (b, m.rows) and (np.abs(y - want) <= bound).all(), (b, path)
    monkeypatch.setattr(kc, "TILE_ELEMS", 10 * m.cols)           # tiles of 10 rows
    x = rng.standard_normal((40, m.cols)).astype(np.float32)
    want, bound = kernel_cases.reference(x, m)
    assert (np.abs(kc.matmul(x, m) - want) <= bound).all()
    np.testing.assert_array_equal(kc.dequantize_rows(m, 4, 9), qm.dequantize(m, slice(4, 9)))
    ids = np.array([[2, 9], [0, 2]], dtype=np.int64)              # any shape, any int type
    np.testing.assert_array_equal(kc.gather_rows(m, ids), qm.dequantize(m)[ids.reshape(-1)])
    with pytest.raises(IndexError):
        kc.dequantize_rows(m, 5, m.rows + 1)
    with pytest.raises(ValueError, match="path"):
        kc.matmul(x, m, path="fast")
