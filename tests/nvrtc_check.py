"""NVRTC through ctypes: compile CUDA source for an architecture without a GPU.

The library comes from the `nvidia-cuda-nvrtc-cu11` wheel (test extras); 11.8 is the
last NVRTC that still targets Kepler (compute_37) and already knows Hopper (compute_90).
"""
from __future__ import annotations

import ctypes
import importlib.util
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pantheon.worker.kernels_cuda import keep_thread_locale


@dataclass(frozen=True)
class Compiled:
    ok: bool
    log: str
    code: bytes          # PTX for compute_XX, CUBIN for sm_XX (empty when not ok)


@lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """libnvrtc from the installed wheel, or None when it is not installed."""
    spec = importlib.util.find_spec("nvidia.cuda_nvrtc")
    if spec is None or not spec.submodule_search_locations:
        return None
    libs = sorted(Path(next(iter(spec.submodule_search_locations)), "lib").glob("libnvrtc.so*"))
    return ctypes.CDLL(str(libs[0])) if libs else None


def version() -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _ok(library().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def compile_source(source: str, arch: str, options: tuple[str, ...] = ()) -> Compiled:
    """Compile `source` for `arch` ("compute_37" → PTX, "sm_37" → CUBIN)."""
    lib = library()
    prog = ctypes.c_void_p()
    _ok(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernels.cu", 0, None,
                               None), "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in options)]
        with keep_thread_locale():
            status = lib.nvrtcCompileProgram(prog, len(opts),
                                             (ctypes.c_char_p * len(opts))(*opts))
        log = _read(lib.nvrtcGetProgramLogSize, lib.nvrtcGetProgramLog, prog).decode(
            errors="replace").rstrip("\x00")
        if status != 0:
            return Compiled(False, log, b"")
        cubin = arch.startswith("sm_")
        code = _read(lib.nvrtcGetCUBINSize if cubin else lib.nvrtcGetPTXSize,
                     lib.nvrtcGetCUBIN if cubin else lib.nvrtcGetPTX, prog)
        return Compiled(True, log, code)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _read(size_fn, get_fn, prog) -> bytes:
    n = ctypes.c_size_t()
    _ok(size_fn(prog, ctypes.byref(n)), size_fn.__name__)
    buf = ctypes.create_string_buffer(n.value)
    _ok(get_fn(prog, buf), get_fn.__name__)
    return buf.raw


def _ok(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with NVRTC status {status}")
