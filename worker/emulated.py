"""An emulated CUDA die: a stand-in for the CuPy subset the worker uses, on NumPy.

`pantheon worker --die emu:0` runs the GPU worker with this module as its `xp`, so the
code only a GPU die runs (uploads, the die's memory, the forward with `xp` not NumPy,
the raw kernels, sampling on the die, the polled wait) runs in `make test` on any host.

What it keeps of CuPy, so that what would fail on a GPU fails here:
- Device arrays are their own type (`ndarray`, holding a NumPy array), never NumPy's:
  a host array where a device one is needed is refused as CuPy refuses it (operators,
  functions and kernels: TypeError; a host array assigned into a slice: ValueError),
  implicit conversion to NumPy is refused (`.get()` / `asnumpy` copy explicitly), and a
  reduction or an index gives a 0-d device array, not a NumPy scalar.
- Memory is counted per die against its size (`configure`): an allocation past it raises
  OutOfMemoryError (a MemoryError, named and worded as CuPy's); memGetInfo reports it.
  `empty` is filled with NaN (or 0xA5 bytes), as reused device memory holds old data.
- `view` to a dtype of another size needs a C-contiguous array; fp16 products accumulate
  in fp32 and round once (cuBLAS's way, not NumPy's fp16 loop).
- RawModule / RawKernel compile their source with the host shim (worker/simt_host.py) and
  run each launch there, refusing host arrays, dtype mismatches, non-contiguous arrays.
- Work is asynchronous in a deterministic model: each kernel launch queues ticks on the
  stream, an Event's `done` lets the die retire one tick per query, and anything that
  blocks (synchronize, a copy to the host) retires all of them.
"""
from __future__ import annotations

import math
import threading
import weakref
from functools import lru_cache

import numpy as np

MAX_DEVICES = 8                  # the reference host's eight K80 dies
DEFAULT_MEMORY = 12 << 30        # a K80 die's 12 GB
LAUNCH_TICKS = 3                 # polls of an event a kernel launch keeps busy
NAME = "Emulated CUDA die (NumPy)"


class OutOfMemoryError(MemoryError):
    """As cupy.cuda.memory.OutOfMemoryError: size wanted, total allocated, limit."""

    def __init__(self, size: int, total: int, limit: int = 0):
        self._size, self._total, self._limit = size, total, limit
        if limit == 0:
            msg = f"Out of memory allocating {size:,} bytes (allocated so far: {total:,} bytes)."
        else:
            msg = (f"Out of memory allocating {size:,} bytes (allocated so far: {total:,} "
                   f"bytes, limit set to: {limit:,} bytes).")
        super().__init__(msg)


class CUDARuntimeError(RuntimeError):
    """As cupy.cuda.runtime.CUDARuntimeError."""


# -- dies and their memory ---------------------------------------------------------------

class _Die:
    def __init__(self, index: int, memory: int):
        self.index, self.memory, self.used = index, memory, 0
        self.lock = threading.Lock()
        self.submitted = self.completed = 0          # launch ticks (see Event)


_dies: dict[int, _Die] = {}
_local = threading.local()
_tracked: dict[int, tuple[int, int]] = {}          # id(buffer) → (die, bytes)


def configure(index: int, memory: int = DEFAULT_MEMORY) -> None:
    """Give die `index` `memory` bytes (before its first use; again resizes it)."""
    if not 0 <= index < MAX_DEVICES:
        raise CUDARuntimeError(f"cudaErrorInvalidDevice: emulated device {index} "
                               f"(0..{MAX_DEVICES - 1} exist)")
    _die(index).memory = int(memory)


def _die(index: int | None = None) -> _Die:
    index = _current_index() if index is None else index
    if index not in _dies:
        _dies[index] = _Die(index, DEFAULT_MEMORY)
    return _dies[index]


def _current_index() -> int:
    return getattr(_local, "device", 0)


def _release(die: _Die, key: int, nbytes: int) -> None:
    with die.lock:
        die.used -= nbytes
        _tracked.pop(key, None)


def _charge(a: np.ndarray) -> None:
    """Count the buffer under `a` on the current die the first time it is seen."""
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    key = id(root)
    if key in _tracked:
        return
    die = _die()
    nbytes = root.nbytes
    with die.lock:
        if die.used + nbytes > die.memory:
            raise OutOfMemoryError(nbytes, die.used)
        die.used += nbytes
        _tracked[key] = (die.index, nbytes)
    weakref.finalize(root, _release, die, key, nbytes)


# -- arrays ------------------------------------------------------------------------------

def _refuse_host(v, where: str) -> None:
    raise TypeError(f"Unsupported type {type(v)} in {where}: a host array on a device "
                    "path (copy it with asarray first)")


def _unwrap(v, where: str):
    """Device arrays → their NumPy arrays, recursively through lists and tuples; a host
    array is refused."""
    if type(v) is ndarray:
        return v._a
    if isinstance(v, np.ndarray):
        _refuse_host(v, where)
    if isinstance(v, (list, tuple)):
        return type(v)(_unwrap(x, where) for x in v)
    return v


def _wrap(r):
    if isinstance(r, np.ndarray):
        _charge(r)
        return ndarray(r)
    if isinstance(r, np.generic):
        return ndarray(np.asarray(r))            # CuPy gives 0-d arrays, never scalars
    if isinstance(r, tuple):
        return tuple(_wrap(x) for x in r)
    if isinstance(r, list):
        return [_wrap(x) for x in r]
    return r


def _f16_matmul(a, b):
    """cuBLAS multiplies fp16 in fp32 and rounds once; NumPy's fp16 loop rounds each step."""
    if a.dtype == np.float16 and b.dtype == np.float16:
        return np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(np.float16)
    return np.matmul(a, b)


def _binary(name):
    op = getattr(np.ndarray, name)

    def method(self, other):
        if isinstance(other, (np.ndarray, list)):
            _refuse_host(other, f"ndarray.{name}")
        other = other._a if type(other) is ndarray else other
        if name in ("__matmul__", "__rmatmul__"):
            a, b = (self._a, other) if name == "__matmul__" else (other, self._a)
            return _wrap(_f16_matmul(a, b))
        out = op(self._a, other)
        if out is NotImplemented:
            return out
        if name.startswith("__i"):
            return self                              # in place: the same device array
        return _wrap(out)
    method.__name__ = name
    return method


def _unary(name):
    op = getattr(np.ndarray, name)

    def method(self):
        return _wrap(op(self._a))
    method.__name__ = name
    return method


class _Pointer:
    def __init__(self, ptr: int):
        self.ptr = ptr


class ndarray:
    """A device array of the emulated die (a NumPy array that NumPy code cannot take)."""

    __slots__ = ("_a", "__weakref__")
    __array_priority__ = 100

    def __init__(self, a: np.ndarray):
        self._a = a

    # what NumPy asks of foreign arrays
    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use "
                        "`.get()` to construct a NumPy array explicitly.")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        inputs = _unwrap(inputs, f"numpy.{ufunc.__name__}")
        if "out" in kwargs:
            kwargs["out"] = _unwrap(kwargs["out"], f"numpy.{ufunc.__name__}")
        return _wrap(getattr(ufunc, method)(*inputs, **kwargs))

    def __array_function__(self, func, types, args, kwargs):
        return _wrap(func(*_unwrap(args, func.__name__),
                          **{k: _unwrap(v, func.__name__) for k, v in kwargs.items()}))

    # attributes
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    data = property(lambda self: _Pointer(self._a.ctypes.data))
    T = property(lambda self: ndarray(self._a.T))
    device = property(lambda self: cuda.Device(_tracked.get(id(_root(self._a)), (0,))[0]))

    def __repr__(self) -> str:
        return f"emulated.ndarray({self._a!r})"

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self):
        return (_wrap(x) for x in self._a)

    def __bool__(self) -> bool:
        return bool(self._a)

    def __int__(self) -> int:
        return int(self._a)

    def __float__(self) -> float:
        return float(self._a)

    def __getitem__(self, key):
        return _wrap(self._a[_index(key)])

    def __setitem__(self, key, value):
        key = _index(key)
        if isinstance(value, (np.ndarray, list)) and np.ndim(value) > 0:
            if not _advanced(key):      # CuPy fills a basic slice: scalars only
                raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
            value = np.asarray(value)   # an advanced index converts it (CuPy: array())
        self._a[key] = value._a if type(value) is ndarray else value

    def argsort(self, axis=-1):
        return argsort(self, axis)

    def get(self, stream=None) -> np.ndarray:
        return asnumpy(self)

    def view(self, dtype=None):
        if dtype is None:
            return ndarray(self._a.view())
        if np.dtype(dtype).itemsize != self._a.itemsize and not self._a.flags.c_contiguous:
            raise ValueError("To change to a dtype of a different size, the array must be "
                             "C-contiguous")
        return ndarray(self._a.view(dtype))

    def __getattr__(self, name):
        """Every other method runs NumPy's on the held array (never a protocol: NumPy would
        read the held array through __array_interface__)."""
        if name.startswith("__"):
            raise AttributeError(name)
        attr = getattr(self._a, name)
        if not callable(attr):
            return _wrap(attr)

        def method(*args, **kwargs):
            return _wrap(attr(*_unwrap(args, f"ndarray.{name}"),
                              **{k: _unwrap(v, f"ndarray.{name}") for k, v in kwargs.items()}))
        return method

    def __getstate__(self):
        raise TypeError("a device array does not cross processes")


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and",
              "or", "xor", "lshift", "rshift"):
    for _form in (f"__{_name}__", f"__r{_name}__", f"__i{_name}__"):
        if hasattr(np.ndarray, _form):
            setattr(ndarray, _form, _binary(_form))
for _form in ("__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__"):
    setattr(ndarray, _form, _binary(_form))
for _form in ("__neg__", "__pos__", "__abs__", "__invert__"):
    setattr(ndarray, _form, _unary(_form))
ndarray.__hash__ = None


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _index(key):
    """An index with device arrays unwrapped; host index arrays are copied over (CuPy
    converts NumPy arrays and lists used as indices)."""
    if type(key) is ndarray:
        return key._a
    if isinstance(key, tuple):
        return tuple(k._a if type(k) is ndarray else k for k in key)
    return key


def _advanced(key) -> bool:
    parts = key if isinstance(key, tuple) else (key,)
    return any(isinstance(k, (np.ndarray, list)) for k in parts)


# -- creation and transfer ---------------------------------------------------------------

def _host_copy(a) -> np.ndarray:
    _synchronize()                       # a copy to the host waits for the die
    return np.array(a._a, copy=True)


def asnumpy(a, stream=None, out=None) -> np.ndarray:
    if type(a) is ndarray:
        host = _host_copy(a)
    else:
        host = np.asarray(a)
    if out is not None:
        out[...] = host
        return out
    return host


def array(obj, dtype=None, copy=True, order="K", ndmin=0):
    if type(obj) is ndarray:
        src = obj._a
        return _wrap(np.array(src, dtype=dtype, copy=copy, order=order, ndmin=ndmin))
    return _wrap(np.array(obj, dtype=dtype, copy=True, order=order, ndmin=ndmin))


def asarray(a, dtype=None, order=None):
    """A device array: a device array as it is (cast if asked), anything else copied."""
    if type(a) is ndarray:
        if dtype is None or np.dtype(dtype) == a.dtype:
            return a
        return _wrap(a._a.astype(dtype))
    return _wrap(np.array(a, dtype=dtype, order=order or "K", copy=True))


def ascontiguousarray(a, dtype=None):
    if type(a) is not ndarray:
        raise TypeError(f"Argument 'a' has incorrect type (expected cupy.ndarray, got "
                        f"{type(a).__name__})")
    if a._a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    return _wrap(np.ascontiguousarray(a._a, dtype=dtype))


def empty(shape, dtype=float, order="C"):
    """Fresh device memory is not zeroed: NaN in floats, 0xA5 bytes elsewhere."""
    out = np.empty(shape, dtype=dtype, order=order)
    _charge(out)
    if out.dtype.kind in "fc":
        out.fill(np.nan)
    else:
        out.view(np.uint8).fill(0xA5)
    return ndarray(out)


def empty_like(a, dtype=None):
    return empty(a.shape, dtype or a.dtype)


def get_array_module(*args):
    return _this if any(type(a) is ndarray for a in args) else np


def matmul(a, b, out=None):
    r = _f16_matmul(_unwrap(a, "matmul"), _unwrap(b, "matmul"))
    if out is not None:
        out._a[...] = r
        return out
    return _wrap(r)


def sort(a, axis=-1):
    """CuPy's sorts are stable (radix), so ties keep their order: here too."""
    return _wrap(np.sort(_unwrap(a, "sort"), axis=axis, kind="stable"))


def argsort(a, axis=-1):
    return _wrap(np.argsort(_unwrap(a, "argsort"), axis=axis, kind="stable"))


@lru_cache(maxsize=None)
def _function(name: str):
    fn = getattr(np, name)

    def device_function(*args, **kwargs):
        return _wrap(fn(*_unwrap(args, name),
                        **{k: _unwrap(v, name) for k, v in kwargs.items()}))
    device_function.__name__ = name
    return device_function


def __getattr__(name: str):
    """Every other name: NumPy's, its functions taking and giving device arrays."""
    if name.startswith("__"):
        raise AttributeError(name)
    attr = getattr(np, name)              # AttributeError for what NumPy lacks too
    if isinstance(attr, type) or not callable(attr):
        return attr                       # dtypes, constants
    return _function(name)


# -- streams, events, devices ------------------------------------------------------------

def _synchronize() -> None:
    die = _die()
    die.completed = die.submitted


class Event:
    """Done once the die has retired the ticks queued before `record`."""

    def __init__(self, block: bool = False, disable_timing: bool = False,
                 interprocess: bool = False):
        self.die, self.target = _die(), 0

    def record(self, stream=None) -> None:
        self.die = _die()
        self.target = self.die.submitted

    @property
    def done(self) -> bool:
        die = self.die
        if die.completed < self.target:
            die.completed += 1           # each query lets the die get one tick further
        return die.completed >= self.target

    def synchronize(self) -> None:
        self.die.completed = max(self.die.completed, self.target)


class Stream:
    """One stream per die (the null stream): `with Stream():` is accepted and ordered."""

    null = None

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False):
        self.ptr = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def use(self):
        return self

    def synchronize(self) -> None:
        _synchronize()

    def record(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    @property
    def done(self) -> bool:
        die = _die()
        return die.completed >= die.submitted


class _Device:
    def __init__(self, device: int | None = None):
        self.id = _current_index() if device is None else int(device)
        if not 0 <= self.id < MAX_DEVICES:
            raise CUDARuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal {self.id}")

    def use(self) -> None:
        _local.device = self.id

    def __enter__(self):
        self._previous = _current_index()
        self.use()
        return self

    def __exit__(self, *exc):
        _local.device = self._previous
        return False

    def synchronize(self) -> None:
        _synchronize()

    @property
    def compute_capability(self) -> str:
        return "37"

    @property
    def mem_info(self) -> tuple[int, int]:
        return _runtime.memGetInfo()


class _Runtime:
    CUDARuntimeError = CUDARuntimeError

    @staticmethod
    def getDeviceCount() -> int:
        return MAX_DEVICES

    @staticmethod
    def getDeviceProperties(index: int) -> dict:
        _Device(index)
        die = _die(index)
        return {"name": NAME.encode(), "major": 3, "minor": 7, "totalGlobalMem": die.memory,
                "multiProcessorCount": 13, "memoryClockRate": 2_505_000,
                "memoryBusWidth": 384}

    @staticmethod
    def memGetInfo() -> tuple[int, int]:
        die = _die()
        return die.memory - die.used, die.memory


class _MemoryModule:
    OutOfMemoryError = OutOfMemoryError


class _MemoryPool:
    """The default pool: nothing is cached, so freeing is immediate."""

    def used_bytes(self) -> int:
        return _die().used

    def total_bytes(self) -> int:
        return _die().used

    def free_all_blocks(self, stream=None) -> None:
        pass


class _Cuda:
    Device = _Device
    Event = Event
    Stream = Stream
    runtime = _Runtime()
    memory = _MemoryModule()

    @staticmethod
    def get_current_stream(device=None) -> Stream:
        return Stream()

    @staticmethod
    def get_device_id() -> int:
        return _current_index()


cuda = _Cuda()
_runtime = _Runtime()
_pool = _MemoryPool()


class _PinnedMemoryPool:
    """Page-locked host memory: the emulated die's host side is plain NumPy."""

    def n_free_blocks(self) -> int:
        return 0

    def free_all_blocks(self) -> None:
        pass


_pinned_pool = _PinnedMemoryPool()


def get_default_memory_pool() -> _MemoryPool:
    return _pool


def get_default_pinned_memory_pool() -> _PinnedMemoryPool:
    return _pinned_pool


# -- raw kernels -------------------------------------------------------------------------

@lru_cache(maxsize=None)
def _host_kernels(code: str):
    from .simt_host import HostKernels
    return HostKernels(code)


class RawKernel:
    """One kernel of a source, launched as `kernel(grid, block, args)` through the host
    shim; its arguments as CuPy takes them (device arrays and NumPy scalars)."""

    def __init__(self, code: str, name: str, options=(), backend: str = "nvrtc",
                 module: "RawModule | None" = None):
        self.code, self.name, self.options = code, name, options

    @property
    def kernel(self):
        kernels = _host_kernels(self.code)
        if self.name not in kernels.params:
            raise CUDARuntimeError(f"CUDA_ERROR_NOT_FOUND: named symbol not found: {self.name}")
        return kernels

    def compile(self) -> None:
        self.kernel

    def __call__(self, grid, block, args, shared_mem: int = 0, stream=None) -> None:
        grid, block = _dim(grid), _dim(block)
        host = []
        for a in args:
            if isinstance(a, np.ndarray):
                _refuse_host(a, f"kernel {self.name}")
            host.append(a._a if type(a) is ndarray else a)
        self.kernel.launch(self.name, grid, block, host)
        die = _die()
        die.submitted = max(die.submitted, die.completed) + LAUNCH_TICKS


def _dim(d) -> int:
    d = tuple(d) if isinstance(d, (tuple, list)) else (d,)
    if any(int(v) != 1 for v in d[1:]):
        raise ValueError("the host shim runs one-dimensional grids and blocks")
    return int(d[0])


class RawModule:
    """A source whose kernels `get_function` hands out; compiled on first use."""

    def __init__(self, code: str | None = None, path: str | None = None, options=(),
                 backend: str = "nvrtc", name_expressions=None):
        if code is None:
            raise ValueError("the emulated die compiles source code (code=...)")
        self.code, self.options = code, options

    def compile(self, log_stream=None) -> None:
        _host_kernels(self.code)

    def get_function(self, name: str) -> RawKernel:
        kernel = RawKernel(self.code, name, self.options)
        kernel.compile()
        return kernel


# -- the emulated die's description ------------------------------------------------------

def describe(index: int) -> str:
    """The die's name as the worker announces it (and /admin/dies shows it)."""
    return f"{NAME}, device {index}, {_format_size(_die(index).memory)}"


def _format_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n:,} bytes" if n < 1 << 20 else f"{n / 2**30:.2f} GiB"


import sys as _sys                                              # noqa: E402
_this = _sys.modules[__name__]
float16, float32, float64 = np.float16, np.float32, np.float64
int8, int32, int64, uint8, uint16, uint32 = np.int8, np.int32, np.int64, np.uint8, \
    np.uint16, np.uint32
newaxis, inf, nan, pi = None, math.inf, math.nan, math.pi
