"""worker/kernels_cuda.py: the source compiles for Kepler and Hopper (NVRTC, no GPU
needed), and on a CUDA die the kernels agree with NumPy (gpu-marked)."""
import re

import numpy as np
import pytest

import kernel_cases
import nvrtc_check
from pantheon.worker import kernels_cuda as kc
from pantheon.worker import matrices as qm

OPTIONS = ("--std=c++17",)
ARCHS = ("37", "90")


@pytest.fixture(scope="module")
def nvrtc():
    assert nvrtc_check.library() is not None, \
        "libnvrtc not found: the test extras install nvidia-cuda-nvrtc-cu11"
    assert nvrtc_check.version() >= (11, 8)


def entries(ptx: str) -> dict[str, str]:
    parts = re.split(r"\.(?:visible|weak) \.entry ", ptx)[1:]
    return {p.split("(")[0]: p for p in parts}


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_compiles_to_ptx_with_registers_only(nvrtc, arch):
    out = nvrtc_check.compile_source(kc.SOURCE, f"compute_{arch}", OPTIONS)
    assert out.ok, out.log
    funcs = entries(out.code.decode())
    assert set(funcs) == set(kc.KERNELS)
    # a local array (dynamic indexing of the accumulators) would cost a memory
    # round trip per sum: every per-lane array must have become registers
    assert [n for n, body in funcs.items() if "__local_depot" in body] == []


@pytest.mark.parametrize("arch", ARCHS)
def test_machine_code_has_no_spills(nvrtc, arch):
    out = nvrtc_check.compile_source(kc.SOURCE, f"sm_{arch}",
                                     OPTIONS + ("--ptxas-options=-v",))
    assert out.ok, out.log
    assert len(out.code) > 0
    names = re.findall(r"Compiling entry function '(\w+)'", out.log)
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores", out.log)
    assert sorted(names) == sorted(kc.KERNELS) and len(frames) == len(names)
    assert [(n, f) for n, f in zip(names, frames) if f != ("0", "0")] == []


def test_a_broken_kernel_fails_with_its_error(nvrtc):
    broken = kc.SOURCE.replace("const float sx =", "const float sx = undeclared_thing +")
    out = nvrtc_check.compile_source(broken, "compute_37", OPTIONS)
    assert not out.ok and out.code == b""
    assert "undeclared_thing" in out.log and "error" in out.log


def test_compiling_leaves_the_text_encoding_alone(nvrtc):
    import locale
    before = locale.getpreferredencoding(False)
    assert nvrtc_check.compile_source('extern "C" __global__ void k() {}', "compute_37").ok
    assert locale.getpreferredencoding(False) == before


def test_fp16_arithmetic_is_refused_on_kepler(nvrtc):
    """Machine code for sm_37 sees what the K80 lacks (PTX for compute_37 alone would
    not: ptxas is where an fp16 add, sm_53 and up, is refused)."""
    src = ('extern "C" __global__ void k(unsigned short* a) '
           '{ asm("add.f16 %0, %0, %0;" : "+h"(a[0])); }')
    assert nvrtc_check.compile_source(src, "sm_90", OPTIONS).ok
    out = nvrtc_check.compile_source(src, "sm_37", OPTIONS)
    assert not out.ok and "requires .target sm_53" in out.log


# -- on a CUDA die ------------------------------------------------------------------

CASES = kernel_cases.cases(rows=300, cols=1024, k_cols=1024)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("path", ["gemv", "tile", "auto"])
def test_matmul_matches_numpy(name, path):
    import cupy as cp
    m = CASES[name]
    dm = qm.to_die(m, cp)
    rng = np.random.default_rng(11)
    for b in (1, 3, 8, 32, 33, 100):
        x = rng.standard_normal((b, m.cols)).astype(np.float32)
        want, bound = kernel_cases.reference(x, m)
        y = cp.asnumpy(kc.matmul(cp.asarray(x), dm, path=path))
        assert y.shape == (b, m.rows) and y.dtype == np.float32
        assert (np.abs(y - want) <= bound).all(), (name, path, b, np.abs(y - want).max())


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_dequantize_and_gather_rows_match_numpy(name):
    import cupy as cp
    m = CASES[name]
    dm = qm.to_die(m, cp)
    full = qm.dequantize(m)
    # the device multiplies then adds exactly like NumPy (no fused multiply-add)
    np.testing.assert_array_equal(cp.asnumpy(kc.dequantize_rows(dm, 7, 200)), full[7:200])
    ids = np.array([5, 0, 299, 5, 300, -3], dtype=np.int64)
    got = cp.asnumpy(kc.gather_rows(dm, ids))
    np.testing.assert_array_equal(got[:4], full[ids[:4]])
    assert np.isnan(got[4:]).all()


@pytest.mark.gpu
def test_tile_path_splits_tall_matrices(monkeypatch):
    import cupy as cp
    m = CASES["Q4_K"]
    monkeypatch.setattr(kc, "TILE_ELEMS", 64 * m.cols + 5)     # tiles of 64 rows
    x = np.random.default_rng(2).standard_normal((40, m.cols)).astype(np.float32)
    want, bound = kernel_cases.reference(x, m)
    y = cp.asnumpy(kc.matmul(cp.asarray(x), qm.to_die(m, cp), path="tile"))
    assert (np.abs(y - want) <= bound).all()
