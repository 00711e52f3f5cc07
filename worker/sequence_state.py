"""Per-layer sequence state of every slot, allocated once at load.

Each mixer owns the state of its layer for every slot:
- KVState (attention): keys and values [n_slots, n_kv_heads, ctx, head_dim]. A
  slot's history for one head is contiguous, so attention reads it without a
  gather. Any prefix of what a slot holds is itself a valid state (truncatable):
  the owner tracks lengths, the cache does not.
- RecurrentState (linear attention, convolutions): named fixed-size arrays per
  slot, [n_slots, *shape] each, whatever the length. Such a state is valid only
  at the exact length it has absorbed, which it records per slot; a mixer calls
  `begin(slot, start)` before feeding a span (start 0 clears the slot) and
  `absorbed(slot, n)` after.
SequenceState bundles a model's layers; the scheduler, its forks (n > 1) and the
host prefix cache use it (save / restore / copy_prefix) without knowing which
kinds it holds, and ask `truncatable` whether a state may be resumed at a length
shorter than it was saved at.
"""
from __future__ import annotations

import numpy as np

from ..common.kv_cache import BLOCK, QUANTIZED, KVUnreadable
from .kv_quant import dequantize, quantize, storage

F32 = np.float32


class StateError(ValueError):
    """A state asked to resume at a length it does not hold."""


def _to_host(xp):
    return getattr(xp, "asnumpy", np.array)        # a copy on either die


def _commit_zeros(a) -> None:
    """a[...] = 0, every page written: on the CPU by the kernels' threads (the faults of
    first touch are most of the cost), NumPy's way where they cannot be built."""
    if isinstance(a, np.ndarray):
        from . import kernels_cpu
        kernels_cpu.zero(a)
    else:
        a.fill(0)


class KVState:
    """Keys and values of one attention layer, every slot and position."""

    truncatable = True

    def __init__(self, n_slots: int, n_kv_heads: int, ctx: int, head_dim: int, xp, dtype):
        """dtype: float32 / float16, or (k, v) KV type names (common/kv_cache.py): a
        q8_0 / q4_0 cache holds each head's row as uint8 blocks [.., ctx, row bytes]."""
        shape = (n_slots, n_kv_heads, ctx, head_dim)
        self.xp, self.ctx, self.head_dim = xp, ctx, head_dim
        if isinstance(dtype, str):
            dtype = (dtype, dtype)
        if not isinstance(dtype, tuple):
            kind = "f16" if np.dtype(dtype) == np.float16 else "f32"
            dtype = (kind, kind)
        self.kinds = dtype
        if any(k in QUANTIZED for k in dtype) and head_dim % BLOCK:
            raise KVUnreadable(f"a {'/'.join(dtype)} KV cache needs a head size that is "
                               f"a multiple of {BLOCK}; this model's is {head_dim}: use "
                               f"--kv-cache f16 or f32")
        if xp is not np:                # a GPU die: worker/attention_cuda.py reads it
            from .attention_cuda import check_head
            check_head(head_dim)
        # committed now: zeros() maps pages lazily, so write every page at load; the RSS
        # after a load is then the steady state and no request needs new memory
        kd, ks = storage(dtype[0], shape, head_dim)
        vd, vs = storage(dtype[1], shape, head_dim)
        self.k = xp.empty(ks, dtype=kd)
        self.v = xp.empty(vs, dtype=vd)
        for a in (self.k, self.v):
            _commit_zeros(a)

    @property
    def quantized(self) -> bool:
        return self.kinds[0] in QUANTIZED or self.kinds[1] in QUANTIZED

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)

    def write(self, slot: int, start: int, k, v) -> None:
        """Store k, v [n, n_kv_heads, head_dim] at positions [start, start + n)."""
        n = k.shape[0]
        self.k[slot, :, start:start + n] = quantize(k.transpose(1, 0, 2), self.kinds[0])
        self.v[slot, :, start:start + n] = quantize(v.transpose(1, 0, 2), self.kinds[1])

    def write_rows(self, slots, pos, k, v) -> None:
        """Store k, v [B, n_kv_heads, head_dim] at (slots[b], pos[b])."""
        self.k[slots, :, pos] = quantize(k, self.kinds[0])
        self.v[slots, :, pos] = quantize(v, self.kinds[1])

    def view(self, slot: int, lo: int, hi: int):
        """Keys and values [n_kv_heads, hi - lo, head_dim] of positions [lo, hi): no copy
        of a float cache; float rows of a quantized one for the NumPy reference path
        (the C attention and the GPU's kernels read blocks in place and never ask)."""
        if not self.quantized:
            return self.k[slot, :, lo:hi], self.v[slot, :, lo:hi]
        k, v = self.window(slice(slot, slot + 1), lo, hi)
        return k[0], v[0]

    def window(self, slots: slice, lo: int, hi: int):
        """Keys and values [S, n_kv_heads, hi - lo, head_dim] of slots, positions [lo, hi):
        float views, or float rows of quantized blocks (the NumPy reference path only)."""
        k, v = self.k[slots, :, lo:hi], self.v[slots, :, lo:hi]
        if not self.quantized:
            return k, v
        return (dequantize(k, self.kinds[0], self.head_dim),
                dequantize(v, self.kinds[1], self.head_dim))

    def save(self, slot: int, length: int):
        to_host = _to_host(self.xp)
        return to_host(self.k[slot, :, :length]), to_host(self.v[slot, :, :length])

    def restore(self, slot: int, saved) -> int:
        k, v = saved
        length = k.shape[1]
        self.k[slot, :, :length] = self.xp.asarray(k)
        self.v[slot, :, :length] = self.xp.asarray(v)
        return length

    def copy(self, src: int, dst: int, length: int) -> None:
        self.k[dst, :, :length] = self.k[src, :, :length]
        self.v[dst, :, :length] = self.v[src, :, :length]

    @staticmethod
    def saved_nbytes(saved) -> int:
        return int(sum(a.nbytes for a in saved))


class RecurrentState:
    """Fixed-size per-slot arrays of one recurrent layer (e.g. a delta-rule matrix
    [n_heads, d_k, d_v] and a convolution tail), valid at one length per slot."""

    truncatable = False

    def __init__(self, n_slots: int, shapes: dict[str, tuple[int, ...]], xp, dtype=F32):
        self.xp = xp
        self.arrays = {name: xp.zeros((n_slots,) + tuple(shape), dtype=dtype)
                       for name, shape in shapes.items()}
        self.length = np.zeros(n_slots, dtype=np.int64)   # positions each slot has absorbed

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.arrays.values()))

    def begin(self, slot: int, start: int) -> None:
        """Before a span at `start` is fed: start 0 clears the slot; any other start must
        be exactly where the slot's state is."""
        if start == 0:
            for a in self.arrays.values():
                a[slot] = 0
            self.length[slot] = 0
        elif start != self.length[slot]:
            raise StateError(f"slot {slot} holds a recurrent state of {self.length[slot]} "
                             f"positions, not {start}")

    def absorbed(self, slot: int, n: int) -> None:
        self.length[slot] += n

    def _check(self, slot: int, length: int) -> None:
        if length != self.length[slot]:
            raise StateError(f"slot {slot} holds a recurrent state of {self.length[slot]} "
                             f"positions, not {length}: it cannot be cut")

    def save(self, slot: int, length: int):
        self._check(slot, length)
        to_host = _to_host(self.xp)
        return {name: to_host(a[slot]) for name, a in self.arrays.items()}, length

    def restore(self, slot: int, saved) -> int:
        arrays, length = saved
        for name, a in self.arrays.items():
            a[slot] = self.xp.asarray(arrays[name])
        self.length[slot] = length
        return length

    def copy(self, src: int, dst: int, length: int) -> None:
        self._check(src, length)
        for a in self.arrays.values():
            a[dst] = a[src]
        self.length[dst] = length

    @staticmethod
    def saved_nbytes(saved) -> int:
        return int(sum(a.nbytes for a in saved[0].values()))


class SequenceState:
    """Every layer's state of a model replica: what the scheduler calls its `kv`."""

    def __init__(self, layers: list, n_slots: int, ctx: int):
        if n_slots < 1 or ctx < 1:
            raise ValueError(f"sequence state needs at least one slot and one position "
                             f"(slots={n_slots}, ctx={ctx})")
        self.layers, self.n_slots, self.ctx = layers, n_slots, ctx

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.layers)

    @property
    def truncatable(self) -> bool:
        """Whether a state saved at length L may be resumed at any length <= L."""
        return all(s.truncatable for s in self.layers)

    def save(self, slot: int, length: int):
        """A host copy of a slot's state at `length` positions: (state, nbytes)."""
        saved = [s.save(slot, length) for s in self.layers]
        nbytes = sum(s.saved_nbytes(x) for s, x in zip(self.layers, saved))
        return (length, saved), nbytes

    def restore(self, slot: int, state) -> int:
        """Put a saved state back in `slot`; returns its length."""
        length, saved = state
        for s, x in zip(self.layers, saved):
            s.restore(slot, x)
        return length

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Make slot `dst` hold slot `src`'s state at its first `length` positions."""
        if length > self.ctx:
            raise ValueError(f"prefix of {length} positions exceeds the context {self.ctx}")
        if src != dst and length > 0:
            for s in self.layers:
                s.copy(src, dst, length)
