"""One owner of a worker's cores: every `pantheon` command runs BLAS on one thread per
caller (the kernels' pool splits the tile products itself), unless the user says else."""
import glob
import os
import subprocess
import sys

import numpy as np
import pytest

LIBS = glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs",
                              "libscipy_openblas*"))
ASK = ("import ctypes, sys; import pantheon.cli, numpy; "
       f"lib = ctypes.CDLL({LIBS[0]!r} if {bool(LIBS)} else ''); "
       "print(lib.scipy_openblas_get_num_threads64_())")


def blas_threads(env: dict) -> int:
    done = subprocess.run([sys.executable, "-c", ASK], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


@pytest.mark.skipif(not LIBS or os.cpu_count() < 2, reason="not NumPy's OpenBLAS wheel")
def test_pantheon_runs_blas_single_threaded_unless_told():
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS",
                                                            "OMP_NUM_THREADS")}
    assert blas_threads(env) == 1
    assert blas_threads({**env, "OPENBLAS_NUM_THREADS": "2"}) == 2
