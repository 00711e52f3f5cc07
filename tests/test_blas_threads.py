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


ALLOC = ("import ctypes, sys\n"
         "if sys.argv[1] == 'pantheon': import pantheon.cli\n"
         "libc = ctypes.CDLL('libc.so.6')\n"
         "class Info(ctypes.Structure):\n"
         "    _fields_ = [(n, ctypes.c_size_t) for n in ('arena', 'ordblks', 'smblks', "
         "'hblks', 'hblkhd', 'usmblks', 'fsmblks', 'uordblks', 'fordblks', 'keepcost')]\n"
         "libc.mallinfo2.restype = Info\n"
         "libc.malloc.restype = ctypes.c_void_p\n"
         "libc.free.argtypes = [ctypes.c_void_p]\n"
         "blocks = [libc.malloc(100_000) for _ in range(400)]\n"   # 40 MB on the heap
         "for b in reversed(blocks): libc.free(b)\n"
         "print(libc.mallinfo2().keepcost)\n")


def heap_top_after_a_burst(*args, env=None) -> int:
    done = subprocess.run([sys.executable, "-c", ALLOC, *args], capture_output=True,
                          text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_pantheon_keeps_a_burst_of_temporaries_on_the_heap():
    """A prefill chunk's temporaries, freed, stay at the top of the heap for the next
    chunk (64 MiB of top pad) instead of going back to the kernel and being faulted in,
    zeroed, again; plain Python trims them at once; the operator's MALLOC_TOP_PAD_ wins."""
    import ctypes
    if not hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2"):
        pytest.skip("not glibc 2.33+")
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_TOP_PAD_"}
    assert heap_top_after_a_burst("pantheon", env=env) >= 40_000_000
    assert heap_top_after_a_burst("plain", env=env) < 8_000_000
    assert heap_top_after_a_burst("pantheon", env={**env, "MALLOC_TOP_PAD_": "0"}) < 8_000_000
