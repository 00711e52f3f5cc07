"""CPU kernels for QMatrix weights: y[B, N] = x[B, K] @ W.T, straight from the blocks.

Paths behind one interface (`matmul`):
- decode (B <= GEMV_MAX_ROWS): the C kernels (worker/kernels/) dequantize each block of 32
  weights into registers and multiplies it into every row of x; rows of W are
  split over the kernels' own thread pool (threads claim chunks of rows, so a
  thread preempted on a shared host never holds the others up). One read of the quantized weights serves the
  whole batch, which is what a memory-bound decode step needs.
- prefill (larger B): W's rows are split over the kernels' threads; each dequantizes a
  cache-sized fp32 tile of its rows (in C) and multiplies it with a one-thread BLAS, tile
  by tile (`pantheon` runs BLAS single-threaded: OpenBLAS's own threads beside the
  kernels' pool made a 64-token prefill 3.3 s instead of 0.27 on a busy 2-core host). The K-quant kinds
  (q2k .. q6k) skip this: their integer products serve any number of rows (the kernels
  keep sub-pieces of W in cache while every group of x's rows passes; from 13 rows
  with AVX-512, 16 tokens across a vector's lanes, as q4 / q8 from 11). On a Qwen2.5-1.5B prefill the row
  kernels ran 1.5-1.8x the tiles' speed and the token lanes 1.5x the row kernels'.
- AMX tiles (Xeons that have them; amx.c asks the kernel for the tile state and
  probes it in a forked child): from 8 rows of x, every kind runs on bf16 tile products
  instead (x split into exact hi and rounded lo bf16 halves); PANTHEON_AMX=off keeps
  them out.

Why C and not numba: measured here (Zen 4, one thread, a [17920, 1536] q4
matrix, B = 1), numba's best formulation of the block loop ran 8-13 ms because
LLVM would not vectorize 16- and 32-element inner loops over numba arrays
(it cannot prove they do not alias); the same loop in C at -O3 -march=native
is vectorized. The library (one translation unit: worker/kernels/pantheon.c includes
the other files of the folder) is compiled once per source and CPU with the host's C
compiler (`cc`, or $CC) into the cache dir and loaded with ctypes, which releases the
GIL during a call. Its ctypes declarations are read from worker/kernels/pantheon.h
(kernels_header); its options (PnOptions) are set once at load (`options` changes them
for a test or a benchmark).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import weakref
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ..common import settings
from ..common.formats import NATIVE_KINDS
from . import kernels_header
from .qmatrix import QMatrix

log = logging.getLogger(__name__)

F32 = np.float32
GEMV_MAX_ROWS = 16          # above this many rows of x, tile + BLAS wins (measured)
MAX_RUNS = 4096             # scale entries per row the integer path holds (int16.c)
# fp32 tile of W per BLAS call (SmolLM2 prefill, alternated runs: 8 MiB 336 tok/s median,
# 2 MiB 303)
TILE_BYTES = 1 << 23
# each tile is dequantized by the thread that multiplies it (SmolLM2, 2 cores: prefill 389
# tok/s with one dequantizing thread beside a 2-thread BLAS, 184 with two, whose OpenMP
# workers and OpenBLAS's spin against each other at every tile)
TILE_THREADS = 1
# idle pool threads spin this long for the next projection before they sleep (a layer's
# projections follow each other within tens of microseconds)
POOL_SPIN_US = 200
# the C kernels' code of each kind (worker/kernels/codes.c; q8 with a min: code 2); the
# file-layout kinds are super-blocks of 256 read straight from the file's bytes (K_BYTES)
CODES = {"q4": 0, "q8": 1, "f16": 3, "bf16": 4, "q4k": 5, "q6k": 6, "q5k": 7, "q3k": 8, "q2k": 9,
         "iq4xs": 10, "iq4nl": 11}
K_BYTES = {kind: f.block_bytes for kind, f in NATIVE_KINDS.items()}
assert set(K_BYTES) <= set(CODES), "a file-layout kind without a kernel code"
KERNELS = Path(__file__).with_name("kernels")      # the C sources, one translation unit
SOURCE = KERNELS / "pantheon.c"                     # what the compiler is given
HEADER = KERNELS / "pantheon.h"                     # what ctypes is told (kernels_header)
DECLS = kernels_header.read(HEADER.read_text())

_lib = None
HAS_INT_PATH = [False]      # the build has the AVX2 integer decode path (set at load)
HAS_AMX = [False]           # the build has the AMX tile products and the kernel grants them
HAS_X8 = [False]            # the build has int8-activation products (AVX2 builds)
_NO_SCALE = np.zeros((1, 1), dtype=np.uint16)


class KernelBuildError(RuntimeError):
    """The C kernels could not be compiled (no C compiler on this host?)."""


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            flags = next((line for line in fh if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return flags


# what each PANTHEON_ISA compiles for (settings.isa): avx2 is llama.cpp's AVX2 build's set
# (AVX2, FMA, F16C, BMI2), tuned for this CPU; generic leaves every vector extension out
ISA_FLAGS = {"native": ["-march=native"],
             "avx2": ["-march=haswell", "-mtune=native"],
             "generic": ["-march=x86-64", "-mtune=native"]}


def isa_flags() -> list[str]:
    """The compiler's target flags for PANTHEON_ISA; an error where this CPU cannot run
    what they build (avx2 on a CPU without AVX2)."""
    isa = settings.isa()
    if isa == "avx2" and " avx2" not in _cpu_key():
        raise KernelBuildError("PANTHEON_ISA=avx2: this CPU has no AVX2")
    return ISA_FLAGS[isa]


def sources() -> bytes:
    """Every file of worker/kernels/ (name and bytes, in name order): what a build's cache
    key covers, since any part changes the translation unit."""
    parts = sorted(p for p in KERNELS.iterdir() if p.suffix in (".c", ".h"))
    return b"".join(p.name.encode() + b"\0" + p.read_bytes() + b"\0" for p in parts)


def build(force: bool = False) -> Path:
    """Compile the kernels for this CPU (once; cached by every source file, CPU flags,
    compiler and target)."""
    source = sources()
    cc = settings.c_compiler()
    flags = isa_flags()
    key = hashlib.sha256(source + _cpu_key().encode() + cc.encode()
                         + " ".join(flags).encode()).hexdigest()[:16]
    out = settings.cache_dir() / "kernels" / f"pantheon-kernels-{key}.so"
    if out.exists() and not force:
        return out
    if shutil.which(cc) is None:
        raise KernelBuildError(f"no C compiler {cc!r} on PATH (set CC): the CPU kernels "
                               "are compiled on first use")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so")
    os.close(fd)
    cmd = [cc, "-O3", *flags, "-pthread", "-shared", "-fPIC", "-std=c11",
           "-o", tmp, str(SOURCE), "-lm"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        os.unlink(tmp)
        raise KernelBuildError(f"compiling {SOURCE} failed:\n{done.stderr[-2000:]}")
    os.replace(tmp, out)            # atomic: a concurrent builder sees all or nothing
    log.info("compiled the CPU kernels (%s): %s", settings.isa(), out)
    return out


def threads() -> int:
    """Threads of the kernels' pool (every parallel loop of the C kernels runs on it): the
    cores this process may run on (a worker pins itself to --cores first)."""
    return len(os.sched_getaffinity(0))


def library():
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(str(build()))
        kernels_header.declare(lib, DECLS)
        assert lib.pn_max_rows() == GEMV_MAX_ROWS
        HAS_INT_PATH[0] = bool(lib.pn_has_i8())
        HAS_X8[0] = bool(lib.pn_has_x8())
        _init(lib, default_options())
        _lib = lib
    return _lib


# PnOptions' fields (worker/kernels/pantheon.h); a negative value takes the C default
OPTION_FIELDS = tuple(name for name, _ in DECLS.structs["PnOptions"]._fields_)
# one keyword for a pair of fields that tests and benchmarks move together
OPTION_PAIRS = {"amx": ("amx_rows", "amx_rows_k"), "ktile": ("ktile_k", "ktile_b")}
_options: dict = {}                 # the options the library runs with now
POOL_THREADS = [0]                  # the pool's threads, the caller included (pn_init's answer)


def default_options() -> dict:
    """The options a worker runs with: the pool on the cores this process may use,
    PANTHEON_AMX (`off`: no product takes the AMX tiles), the C defaults for the rest."""
    opts = dict.fromkeys(OPTION_FIELDS, -1)
    opts.update(threads=threads(), spin_us=POOL_SPIN_US)
    if settings.amx() == "off":
        opts.update(amx_rows=0, amx_rows_k=0)
    return opts


def _init(lib, opts: dict) -> None:
    """pn_init with `opts` (every field of PnOptions; the pool starts at the first call)."""
    unknown = set(opts) - set(OPTION_FIELDS)
    assert not unknown, f"not options of the kernels: {sorted(unknown)}"
    POOL_THREADS[0] = lib.pn_init(ctypes.byref(DECLS.structs["PnOptions"](**opts)))
    HAS_AMX[0] = bool(lib.pn_has_amx()) and (opts["amx_rows"] != 0 or opts["amx_rows_k"] != 0)
    _options.clear()
    _options.update(opts)


@contextmanager
def options(**changes):
    """Run the kernels with some options changed, then restore them (tests, benchmarks):
    a field of PnOptions, or `amx` / `ktile` for both fields of the pair (OPTION_PAIRS);
    an int (0: the path off, n: from n rows of x; negative: the C default) or None (the
    worker's default). E.g. `with kernels_cpu.options(ktile=0, bgroups=0): ...`."""
    lib = library()
    before = dict(_options)
    want, defaults = dict(before), default_options()
    for key, value in changes.items():
        for name in OPTION_PAIRS.get(key, (key,)):
            if name not in OPTION_FIELDS:
                raise TypeError(f"{key!r} is not an option of the kernels: {OPTION_FIELDS}")
            want[name] = defaults[name] if value is None else int(value)
    _init(lib, want)
    try:
        yield
    finally:
        _init(lib, before)


def _ptr(a: np.ndarray) -> int:
    """a's data address: through the buffer protocol (0.35 us, where a.ctypes.data takes
    1.0: a decode step asks for a few hundred), else NumPy's way (read-only or empty)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError, BufferError):
        return a.ctypes.data


_CMat = DECLS.structs["PnMat"]            # pantheon.h's PnMat, PnScratch
_CScratch = DECLS.structs["PnScratch"]


def _cmat(m: QMatrix) -> int:
    """The address of m's PnMat (built once per matrix, after the checks of _weights)."""
    cached = m.__dict__.get("_c_mat")
    if cached is not None and cached[0] is m.qs:
        return cached[2]
    code, qs, sc, mn, bs = _weights(m)
    st = _CMat(code, int(m.__dict__.get("_act8", False)), qs, sc, mn, m.rows, m.cols, bs, None)
    m.__dict__["_c_mat"] = (m.qs, st, ctypes.addressof(st))
    return m.__dict__["_c_mat"][2]


X8_KINDS = ("q4k", "q5k", "q6k", "iq4xs")    # the kinds the C kernels multiply by int8 activations
# the C kernels' plans (plan.c's pn_plan), by number
PLANS = ("none", "amx", "digits", "x8", "k_lanes", "k_rows", "b_lanes", "b_rows", "b_groups",
         "x8_rows")


def plan(m: QMatrix, rows: int) -> str:
    """The product the C kernels run for m at `rows` rows of x (its pn_plan): one of PLANS;
    "none" where no integer product applies (matmul then takes fp32 gemv or dequantized
    tiles and BLAS)."""
    if not (isinstance(m, QMatrix) and isinstance(m.qs, np.ndarray) and m.kind in CODES):
        return "none"
    lib = library()
    if not HAS_INT_PATH[0]:
        return "none"
    return PLANS[lib.pn_plan(_cmat(m), rows)]


def takes_int8(m) -> bool:
    """Whether this build multiplies m by int8 activations when asked (set_int8)."""
    return (isinstance(m, QMatrix) and isinstance(m.qs, np.ndarray) and m.kind in X8_KINDS
            and (library() and HAS_X8[0]))


def set_int8(m: QMatrix, on: bool) -> None:
    """m's products at batch 1 take int8 activations (127 steps per 256) instead of
    int16 (16000): half the multiplies, coarser (worker/activations.py decides per
    model). A no-op where takes_int8(m) is false."""
    if not takes_int8(m):
        return
    m.__dict__["_act8"] = bool(on)
    cached = m.__dict__.get("_c_mat")
    if cached is not None:
        cached[1].act8 = int(bool(on))


def chain(items) -> None:
    """Tell each matrix of `items` (a model's projections in forward order; lists are
    fused parts) which one the forward multiplies by next: while the caller works between
    two products, an idle kernel thread fetches the next matrix's first rows from memory
    (the last one's next is the first: the following step)."""
    flat = [m for it in items for m in (it if isinstance(it, list) else [it])
            if isinstance(m, QMatrix) and isinstance(m.qs, np.ndarray) and m.kind in CODES]
    mats = []
    for m in flat:
        _cmat(m)
        mats.append(m.__dict__["_c_mat"])
    for cur, nxt in zip(mats, mats[1:] + mats[:1]):
        cur[1].next = nxt[2]
        # keep the next struct alive as long as the one pointing at it
        cur[1].__dict__["_next_ref"] = nxt[1]


def aligned_zeros(shape: tuple, dtype) -> np.ndarray:
    """np.zeros on a 64-byte boundary, for the scratch the kernels read x from: a 512-bit
    load that straddles two cache lines costs two, and malloc aligns to 16 bytes only
    (one core, a q4k [512, 1536] product of 8 rows of x in cache: 4.2 ns per super-block
    and row aligned, 5.8 with x 16 bytes off)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    raw = np.zeros(n + 64, dtype=np.uint8)
    skip = -raw.ctypes.data % 64
    return raw[skip:skip + n].view(dtype).reshape(shape)


def _cscratch(batch: int, cols: int) -> int:
    """This thread's PnScratch for x [batch, cols] (int16 values, a scale and a sum per
    32 or per 256), as an address."""
    key = (batch, cols)
    bufs = getattr(_local, "cbufs", None)
    if bufs is None:
        bufs = _local.cbufs = {}
    hit = bufs.get(key)
    if hit is None:
        if len(bufs) > 64:
            bufs.clear()
        arrays = (aligned_zeros((batch, cols), np.int16),
                  aligned_zeros((batch, cols // 32), F32),
                  aligned_zeros((batch, cols // 32), F32))
        st = _CScratch(*(_ptr(a) for a in arrays))
        hit = bufs[key] = (arrays, st, ctypes.addressof(st))
    return hit[2]


def _weights(m: QMatrix) -> tuple:
    """(code, qs, scale, min pointers, bs), checked once per matrix and kept on it."""
    cached = m.__dict__.get("_c_args")
    if cached is not None and cached[0] is m.qs:
        return cached[1]
    args = _check_weights(m)
    m.__dict__["_c_args"] = (m.qs, args)
    return args


_local = threading.local()


def _scratch(batch: int, cols: int, scale_block: int) -> tuple:
    """Pointers to this thread's buffers for x quantized to int16: values, a scale per
    `scale_block` (32 for the blocked kinds, 256 for the K-quants), sums per 32."""
    key = (batch, cols, scale_block)
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    if key not in bufs:
        if len(bufs) > 64:
            bufs.clear()
        arrays = (aligned_zeros((batch, cols), np.int16),
                  aligned_zeros((batch, cols // scale_block), F32),
                  aligned_zeros((batch, cols // 32), F32))
        bufs[key] = arrays + tuple(_ptr(a) for a in arrays)
    return bufs[key][3:]


def _check_weights(m: QMatrix) -> tuple:
    """(code, qs, scale, min pointers, bs) after checking what C will read."""
    if m.kind not in CODES:
        raise TypeError(f"no CPU kernel for kind {m.kind!r}")
    if m.kind in K_BYTES:
        assert isinstance(m.qs, np.ndarray) and m.qs.flags.c_contiguous, \
            "QMatrix arrays must be C-contiguous NumPy arrays"
        assert m.cols % 256 == 0 and m.qs.dtype == np.uint8 and \
            m.qs.shape == (m.rows, m.cols // 256 * K_BYTES[m.kind]), \
            f"{m.kind} qs must be uint8 [{m.rows}, {m.cols // 256 * K_BYTES[m.kind]}], " \
            f"got {m.qs.dtype} {m.qs.shape}"
        return CODES[m.kind], _ptr(m.qs), 0, 0, 256
    code = CODES[m.kind] + (1 if m.kind == "q8" and m.minv is not None else 0)
    scale = _NO_SCALE if m.scale is None else m.scale
    minv = scale if m.minv is None else m.minv
    for a in (m.qs, scale, minv):
        assert isinstance(a, np.ndarray) and a.flags.c_contiguous, \
            "QMatrix arrays must be C-contiguous NumPy arrays"
    assert scale.dtype == np.uint16 and minv.dtype == np.uint16, "scales are fp16 bits"
    assert m.cols % 32 == 0, "rows must be whole blocks of 32"
    want = {"q4": (np.uint8, m.cols // 2), "iq4nl": (np.uint8, m.cols // 2), "q8": (np.int8, m.cols),
            "f16": (np.uint16, m.cols), "bf16": (np.uint16, m.cols)}[m.kind]
    assert m.qs.dtype == want[0] and m.qs.shape == (m.rows, want[1]), \
        f"{m.kind} qs must be {want[0].__name__} [{m.rows}, {want[1]}], got {m.qs.dtype} {m.qs.shape}"
    return code, _ptr(m.qs), _ptr(scale), _ptr(minv), m.bs


def _check_x(x, m: QMatrix) -> None:
    assert isinstance(x, np.ndarray) and x.dtype == F32 and x.ndim == 2 \
        and x.flags.c_contiguous, f"x must be C-contiguous float32 [B, K], got {x.dtype} {x.shape}"
    assert x.shape[1] == m.cols, f"x has {x.shape[1]} columns, W has {m.cols}"


def matmul(x: np.ndarray, m: QMatrix, path: str = "auto") -> np.ndarray:
    """x [B, K] float32 @ W.T → [B, N] float32. `path`: auto, gemv, tile."""
    _check_x(x, m)
    lib = _lib or library()
    batch = x.shape[0]
    out = np.empty((batch, m.rows), dtype=F32)
    if path == "auto" and HAS_INT_PATH[0] and \
            lib.pn_matmul_int(_cmat(m), _ptr(x), batch, _cscratch(batch, m.cols), _ptr(out)):
        return out
    code, qs, sc, mn, bs = _weights(m)
    if m.kind in K_BYTES and path != "tile" and HAS_INT_PATH[0]:     # any batch: see above
        xq, xd, xs = _scratch(batch, m.cols, 256)
        lib.pn_quantize_xk(_ptr(x), batch, m.cols, xq, xd, xs)
        lib.pn_gemv_k(code, qs, m.rows, m.cols, xq, xd, xs, batch, _ptr(out))
        return out
    if path in ("auto", "i8") and batch <= GEMV_MAX_ROWS and m.kind in ("q4", "q8", "iq4nl") \
            and HAS_INT_PATH[0] and m.cols // m.bs <= MAX_RUNS:
        xq, xd, xs = _scratch(batch, m.cols, 32)
        lib.pn_quantize_x(_ptr(x), batch, m.cols, xq, xd, xs, lib.pn_pairs_x(code, bs, batch))
        lib.pn_gemv_i8(code, qs, sc, mn, m.rows, m.cols, bs, xq, xd, xs, batch, _ptr(out))
        return out
    if m.kind not in K_BYTES and (path == "gemv" or (path == "auto" and batch <= GEMV_MAX_ROWS)):
        for b0 in range(0, batch, GEMV_MAX_ROWS):   # row slices of x and out are contiguous
            rows = x[b0:b0 + GEMV_MAX_ROWS]
            lib.pn_gemv(code, qs, sc, mn, m.rows, m.cols, bs, _ptr(rows), rows.shape[0],
                        _ptr(out[b0:b0 + GEMV_MAX_ROWS]))
        return out
    _tiles(lib, x, m, out)
    return out


_pool: list = [None, 0]     # the tile threads' executor, its size
# a forked child has none of its parent's threads: it starts its own executor
os.register_at_fork(after_in_child=lambda: _pool.__setitem__(slice(None), [None, 0]))
SPLIT_TILES = [True]        # False: one thread multiplies every tile (benchmarks, tests)
# smaller products stay on the caller: the hand-off costs more than it saves (2 cores, 40
# rows of x: [1536, 576] 1.51 -> 0.91 ms split, [200, 256] 0.09 -> 0.25 ms)
SPLIT_MIN_MACS = 1 << 23


def _tile_pool(n: int):
    """The threads that multiply tiles beside the caller (grown to n, never shrunk)."""
    from concurrent.futures import ThreadPoolExecutor
    if _pool[1] < n:
        _pool[:] = ThreadPoolExecutor(n, thread_name_prefix="tiles"), n
    return _pool[0]


def _tiles(lib, x: np.ndarray, m: QMatrix, out: np.ndarray) -> None:
    """out = x @ W.T through fp32 tiles of W and BLAS, W's rows split over the kernels'
    threads: each dequantizes its tiles and multiplies them with a one-thread BLAS (the
    worker runs BLAS single-threaded: its own threads fought the kernels' pool for the
    cores; pantheon/cli.py sets OPENBLAS_NUM_THREADS)."""
    big = x.shape[0] * m.rows * m.cols >= SPLIT_MIN_MACS
    n = min(threads(), -(-m.rows // 16)) if SPLIT_TILES[0] and big else 1
    share = (-(-m.rows // n) + 15) // 16 * 16                        # rows per thread
    parts = [(r0, min(m.rows, r0 + share)) for r0 in range(0, m.rows, share)]
    if len(parts) == 1:
        _tile_rows(lib, x, m, out, 0, m.rows)
        return
    pool = _tile_pool(len(parts) - 1)
    done = [pool.submit(_tile_rows, lib, x, m, out, *part) for part in parts[1:]]
    _tile_rows(lib, x, m, out, *parts[0])
    for f in done:
        f.result()


def _tile_rows(lib, x: np.ndarray, m: QMatrix, out: np.ndarray, first: int, end: int) -> None:
    code, qs, sc, mn, bs = _weights(m)
    step = max(16, TILE_BYTES // (4 * m.cols))
    tile = np.empty((min(step, end - first), m.cols), dtype=F32)
    for r0 in range(first, end, step):
        r1 = min(end, r0 + step)
        t = tile[:r1 - r0]
        lib.pn_dequant_rows(code, qs, sc, mn, m.cols, bs, r0, r1, _ptr(t), TILE_THREADS)
        if r1 - r0 == m.rows:       # one tile: BLAS writes out itself (no copy of [B, N])
            np.matmul(x, t.T, out=out)
        else:
            out[:, r0:r1] = x @ t.T




def _rows(x: np.ndarray):
    """(row stride in floats, pointer) of x [T, ..., d] whose rows are each contiguous,
    or None (another layout: the caller takes NumPy's way)."""
    if x.dtype != F32 or x.ndim < 2 or x.shape[0] == 0:
        return None
    inner = x[0]
    if not inner.flags.c_contiguous or x.strides[0] % 4 or x.strides[0] < inner.nbytes:
        return None
    return x.strides[0] // 4, _ptr(x) if x.flags.c_contiguous else x.ctypes.data


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float):
    """x [T, d] or [T, H, d] (each row of T contiguous: the heads of a fused qkv product)
    / rms * w [d] → a new contiguous array, or None where x's layout is not one the
    kernel reads."""
    rows = _rows(x) if x.ndim in (2, 3) else None
    d = x.shape[-1]
    if rows is None or w.dtype != F32 or w.shape != (d,) or not w.flags.c_contiguous:
        return None
    out = np.empty(x.shape, dtype=F32)
    if x.ndim == 2:
        (_lib or library()).pn_rms_norm(rows[1], x.shape[0], d, rows[0], _cache_ptr(w), eps,
                                        _ptr(out))
    else:
        (_lib or library()).pn_rms_norm_heads(rows[1], x.shape[0], x.shape[1], d, rows[0],
                                              _cache_ptr(w), eps, _ptr(out))
    return out


def _built():
    """The library, or None where it cannot be built (no C compiler: a GPU host may have
    none); the load's copies then go NumPy's way."""
    try:
        return _lib or library()
    except (KernelBuildError, OSError):
        return None


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src for arrays of one dtype and size, the bytes moved by the kernels'
    threads in 2 MiB pieces (either may be a view; a non-contiguous one goes NumPy's way)."""
    assert dst.dtype == src.dtype and dst.size == src.size
    lib = _built()
    if lib is None or not (dst.flags.c_contiguous and src.flags.c_contiguous):
        dst[...] = src.reshape(dst.shape)
    elif src.nbytes:
        lib.pn_copy(_ptr(dst), _ptr(src), src.nbytes)


def zero(a: np.ndarray) -> None:
    """a[...] = 0, written by the kernels' threads where a is C-contiguous: the first touch
    of a load's KV caches, bound by page faults like copy_into."""
    lib = _built()
    if lib is None or not a.flags.c_contiguous:
        a.fill(0)
    elif a.nbytes:
        lib.pn_copy(_ptr(a), None, a.nbytes)


def silu_mul(g: np.ndarray, d_ff: int):
    """silu(g[:, :d_ff]) * g[:, d_ff:] for g [T, 2 d_ff] (a fused gate | up product) → a
    new [T, d_ff], or None where g's layout is not one the kernel reads."""
    if g.dtype != F32 or g.ndim != 2 or g.shape[1] != 2 * d_ff or not g.flags.c_contiguous:
        return None
    out = np.empty((g.shape[0], d_ff), dtype=F32)
    (_lib or library()).pn_silu_mul(_ptr(g), g.shape[0], d_ff, _ptr(out))
    return out


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, scale: float = 1.0):
    """Rotate-half rotary embedding of x [T, H, hd] (each row of H * hd contiguous) with
    cos, sin [T, 1, half], times scale → a new [T, H, hd], or None (another layout)."""
    rows = _rows(x) if x.ndim == 3 else None
    half = cos.shape[-1]
    if rows is None or cos.dtype != F32 or sin.dtype != F32 or 2 * half > x.shape[2] \
            or cos.shape != (x.shape[0], 1, half) or sin.shape != cos.shape \
            or not (cos.flags.c_contiguous and sin.flags.c_contiguous):
        return None
    out = np.empty(x.shape, dtype=F32)
    (_lib or library()).pn_rope(rows[1], x.shape[0], x.shape[1], x.shape[2], rows[0],
                                _ptr(cos), _ptr(sin), half, scale, _ptr(out))
    return out


class DecodeBounds:
    """Which cache rows one step's single-token queries read: query b sees slot slots[b],
    positions first[b] .. last[b] (int64 arrays), checked once against the cache shape
    [slots, Hkv, ctx, hd] and reused by every layer of the step."""

    def __init__(self, slots, first, last, cache_shape: tuple):
        self.arrays = tuple(np.ascontiguousarray(a, dtype=np.int64) for a in (slots, first, last))
        slots, first, last = self.arrays
        n_slots, _, ctx, _ = cache_shape
        assert slots.shape == first.shape == last.shape and slots.ndim == 1
        assert (0 <= first).all() and (first <= last).all() and (last < ctx).all() \
            and (0 <= slots).all() and (slots < n_slots).all(), "positions outside the cache"
        self.n, self.cache_shape = slots.shape[0], tuple(cache_shape)
        self.ptrs = tuple(_ptr(a) for a in self.arrays)


# id -> (weak reference, address) of the arrays that live as long as their model (norm
# weights, KV caches): weak, so that an unloaded model's caches are freed with it
_cache_ptrs: dict = {}


def _cache_ptr(a: np.ndarray) -> int:
    key = id(a)
    hit = _cache_ptrs.get(key)
    if hit is None or hit[0]() is not a:
        hit = _cache_ptrs[key] = (weakref.ref(a, lambda _, k=key: _cache_ptrs.pop(k, None)),
                                  _ptr(a))
    return hit[1]


F16 = np.dtype(np.float16)
U8 = np.dtype(np.uint8)
KV_DTYPES = (np.dtype(F32), F16, U8)     # what the C attention reads and writes (uint8: blocks)
_KV_CODES = {"f32": 0, "f16": 1, "q8_0": 2, "q4_0": 3}


def kv_kind(a: np.ndarray, head_dim: int) -> str | None:
    """The KV type a cache array [slots, Hkv, ctx, row] holds (common/kv_cache.py): fp32,
    fp16, or uint8 rows of q8_0 (34 bytes per 32) or q4_0 (18 per 32) blocks."""
    if a.dtype == F16:
        return "f16"
    if a.dtype == F32:
        return "f32"
    if a.dtype == U8 and head_dim % 32 == 0:
        return {head_dim // 32 * 34: "q8_0", head_dim // 32 * 18: "q4_0"}.get(a.shape[-1])
    return None


def kv_code(k: np.ndarray, v: np.ndarray, head_dim: int) -> int | None:
    """The C attention's `kv` argument for caches k, v (k type | v type << 2), or None
    where it cannot read them."""
    kk, vk = kv_kind(k, head_dim), kv_kind(v, head_dim)
    if kk is None or vk is None or not (k.flags.c_contiguous and v.flags.c_contiguous) \
            or k.shape[:3] != v.shape[:3]:
        return None
    return _KV_CODES[kk] | _KV_CODES[vk] << 2


def attend_decodes(q: np.ndarray, k_new: np.ndarray, v_new: np.ndarray, k: np.ndarray,
                   v: np.ndarray, bounds: DecodeBounds, out: np.ndarray) -> None:
    """Store the step's keys and values k_new, v_new [B, Hkv, hd] at each query's last
    position of the caches k, v [slots, Hkv, ctx, row] (float32; float16: rounded to
    nearest as NumPy's astype; q8_0 / q4_0 blocks, kv_kind: quantized as llama.cpp's
    reference quantizers), then write into out [B,
    Hq * hd] the attention of q [B, Hq, hd] (scaled) over them as `bounds` says. q,
    k_new, v_new and out may be rows of wider matrices (each row contiguous)."""
    n, n_heads, hd = q.shape
    qr, kr, vr, orow = _rows(q), _rows(k_new), _rows(v_new), _rows(out)
    assert None not in (qr, kr, vr, orow) and n == bounds.n and out.shape == (n, n_heads * hd)
    assert k_new.shape == v_new.shape == (n, k.shape[1], hd)
    code = kv_code(k, v, hd)
    assert code is not None and k.shape[:3] == bounds.cache_shape[:3] \
        and n_heads % k.shape[1] == 0
    slots, first, last = bounds.ptrs
    (_lib or library()).pn_attend_decodes(
        qr[1], qr[0], n, n_heads, k.shape[1], hd, _cache_ptr(k), _cache_ptr(v), k.shape[2],
        slots, first, last, kr[1], kr[0], vr[1], vr[0], orow[1], orow[0], code)


def dequantize_rows(m: QMatrix, r0: int, r1: int) -> np.ndarray:
    code, qs, sc, mn, bs = _weights(m)
    out = np.empty((r1 - r0, m.cols), dtype=F32)
    library().pn_dequant_rows(code, qs, sc, mn, m.cols, bs, r0, r1, _ptr(out), 0)
    return out


def gather_rows(m: QMatrix, ids) -> np.ndarray:
    """Rows `ids` of W as float32 [T, K] (the embedding lookup)."""
    code, qs, sc, mn, bs = _weights(m)
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= m.rows):
        raise IndexError(f"row ids must be in [0, {m.rows})")
    out = np.empty((ids.shape[0], m.cols), dtype=F32)
    library().pn_gather(code, qs, sc, mn, m.cols, bs, _ptr(ids), ids.shape[0], _ptr(out))
    return out


def repack_k(qtype_name: str, blocks: np.ndarray, qs: np.ndarray, scale: np.ndarray,
             minv: np.ndarray | None) -> bool:
    """Q4_K / Q6_K super-blocks repacked in C (one pass, threaded) into QMatrix arrays;
    False where this build cannot (no F16C), so the caller repacks in NumPy."""
    try:
        lib = library()
    except KernelBuildError:
        return False
    if not lib.pn_has_repack():
        return False
    blocks = np.ascontiguousarray(blocks)
    for a in (qs, scale) + (() if minv is None else (minv,)):
        assert a.flags.c_contiguous
    if qtype_name == "Q4_K":
        lib.pn_repack_q4_k(_ptr(blocks), blocks.shape[0], _ptr(qs), _ptr(scale), _ptr(minv))
    else:
        lib.pn_repack_q6_k(_ptr(blocks), blocks.shape[0], _ptr(qs), _ptr(scale))
    return True
