"""The array module of a die: NumPy on the CPU die, CuPy on a GPU die, the emulated
CuPy (worker/emulated.py) on an emulated GPU die.

Everything device-specific lives here so that the forward is written once.
CuPy is imported lazily: a CPU host never needs it installed.
"""
from __future__ import annotations

import ctypes
import gc
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from ..common import settings
from ..common.die_spec import parse_die

log = logging.getLogger(__name__)


class DeviceError(RuntimeError):
    """The requested die cannot be used (no CuPy, no such GPU, ...)."""


@dataclass(frozen=True)
class Device:
    """One die: `kind` is "cpu" or "cuda"; `index` is the CUDA ordinal. An emulated
    die is a "cuda" die whose `xp` is worker/emulated.py."""

    kind: str
    index: int
    xp: object           # numpy, cupy or the emulated cupy
    name: str
    weight_dtype: object  # fp32 on the CPU, fp16 (default) or fp32 on a GPU
    poll_us: int = field(default_factory=settings.async_poll_us)   # PN_ASYNC_POLL_US
    emulated: bool = False

    @property
    def die_id(self) -> str:
        if self.kind == "cpu":
            return "cpu"
        return f"emu:{self.index}" if self.emulated else str(self.index)

    def to_host(self, array) -> np.ndarray:
        """A NumPy copy of `array` (no copy on the CPU die)."""
        return array if self.xp is np else self.xp.asnumpy(array)

    def synchronize(self) -> None:
        if self.xp is not np:
            self.xp.cuda.get_current_stream().synchronize()

    def settle(self) -> int:
        """Wait for the work queued on this die without spinning a host core on it (a
        blocking copy may spin: eight GPU workers on two cores would starve each other).
        Polls an event, sleeping at most `poll_us` between polls; returns the polls."""
        if self.xp is np:
            return 0
        event = self.xp.cuda.Event(block=False, disable_timing=True)
        event.record()
        return wait_polled(lambda: event.done, self.poll_us)

    def release(self) -> None:
        """Give the memory of what was just dropped (an unloaded model) back to the host:
        collect the reference cycles that hold it (an engine and its scheduler point at
        each other), hand CuPy's pooled blocks back to the driver, and trim glibc's heaps:
        freed chunks below glibc's mmap threshold stay in the worker's RSS until trimmed
        (SmolLM2 at --ctx 256, load / unload cycles: 160 MB after each unload with the
        trim, 260 MB without)."""
        gc.collect()
        if self.xp is not np:
            self.xp.get_default_memory_pool().free_all_blocks()
            self.xp.get_default_pinned_memory_pool().free_all_blocks()
        trim_heap()

    def memory(self) -> tuple[int, int]:
        """(total, free) bytes of the die's memory (host RAM for the CPU die)."""
        if self.xp is np:
            import psutil
            vm = psutil.virtual_memory()
            return vm.total, vm.available
        free, total = self.xp.cuda.runtime.memGetInfo()
        return total, free


M_MMAP_THRESHOLD = -3                # mallopt's parameter number (glibc's malloc.h)
MMAP_THRESHOLD = 4 << 20             # blocks this large and larger: their own mappings


def pin_mmap_threshold() -> None:
    """Fix glibc's mmap threshold at 4 MiB. Left dynamic, each freed mapped block raises
    it (up to 32 MiB), so a later model's buffers of that size land in the heap, where
    malloc_trim cannot always give them back: an unload then kept ~30 MB once in a few
    load / unload cycles. A step's temporaries stay below it, in the heap as before."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def trim_heap() -> None:
    """malloc_trim(0): glibc returns the free pages of every heap to the OS (a no-op
    where the C library is not glibc)."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)


def wait_polled(done, max_sleep_us: int, first_us: float = 10.0) -> int:
    """Call `done()` until it is true, sleeping between calls: first `first_us`, doubling
    up to `max_sleep_us` (0: only yield). Returns the number of polls."""
    polls, sleep_us = 1, min(first_us, max_sleep_us)
    while not done():
        time.sleep(sleep_us * 1e-6)
        sleep_us = min(sleep_us * 2, max_sleep_us)
        polls += 1
    return polls


def cpu_device() -> Device:
    return Device("cpu", -1, np, "cpu", np.float32)


def cuda_device(index: int, fp16: bool | None = None) -> Device:
    """A CUDA die. Weights are fp16 where the GPU computes in fp16 at speed (compute
    capability 6.0 and up), else fp32: a Kepler K80 (3.7) has no fast fp16 math."""
    try:
        import cupy
    except ImportError as exc:
        raise DeviceError("GPU dies need CuPy: pip install 'pantheon[cuda12]' "
                          "(or [cuda11] for Kepler-era drivers)") from exc
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        raise DeviceError(f"no CUDA device usable: {exc}") from exc
    if not 0 <= index < count:
        raise DeviceError(f"CUDA device {index} does not exist ({count} found)")
    cupy.cuda.Device(index).use()
    props = cupy.cuda.runtime.getDeviceProperties(index)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    if fp16 is None:
        fp16 = props["major"] >= 6
    return Device("cuda", index, cupy, name, cupy.float16 if fp16 else cupy.float32)


def emulated_device(index: int = 0, memory: int | None = None,
                    fp16: bool = True) -> Device:
    """A GPU die on the emulated CuPy (worker/emulated.py): for tests and development.
    Its weights and KV are fp16 unless `fp16` is False; `memory` bytes (default 12 GiB)."""
    from . import emulated
    from ..common.die_spec import EMU_MEMORY
    emulated.configure(index, EMU_MEMORY if memory is None else memory)
    emulated.cuda.Device(index).use()
    return Device("cuda", index, emulated, emulated.describe(index),
                  np.float16 if fp16 else np.float32, emulated=True)


def open_device(die: str, fp16: bool | None = None) -> Device:
    """`die` as common/die_spec.py reads it: "cpu", "cpu:1", a CUDA ordinal as text
    ("0", "1", ...), "emu:0" or "emu:0:2G"."""
    spec = parse_die(die)
    pin_mmap_threshold()
    if spec.kind == "cpu":
        return cpu_device()
    if spec.kind == "emu":
        return emulated_device(spec.index, spec.memory, fp16=fp16 is not False)
    return cuda_device(spec.index, fp16=fp16)


def array_module(a):
    """The module of array `a`: numpy, cupy or the emulated cupy."""
    if isinstance(a, np.ndarray):
        return np
    from . import emulated
    if type(a) is emulated.ndarray:
        return emulated
    import cupy
    return cupy.get_array_module(a)


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one device (for test skips)."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False
