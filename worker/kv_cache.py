"""Per-slot KV memory, allocated once at load.

Layout: keys and values of every layer, slot and position in two arrays of
shape [n_layers, n_slots, n_kv_heads, ctx, head_dim]. A slot's history for one
layer and head is then contiguous, so attention reads it without a gather.
Invariant: positions [0, length) of a slot hold valid state only as far as
its owner has written them; the cache itself does not track lengths.
"""
from __future__ import annotations

import numpy as np

from ..common.model_file import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, n_slots: int, ctx: int, xp, dtype):
        if n_slots < 1 or ctx < 1:
            raise ValueError(f"KV cache needs at least one slot and one position "
                             f"(slots={n_slots}, ctx={ctx})")
        shape = (cfg.n_layers, n_slots, cfg.n_kv_heads, ctx, cfg.head_dim)
        self.xp = xp
        self.n_slots, self.ctx = n_slots, ctx
        # committed now: zeros() maps pages lazily, so write every page at load; the RSS
        # after a load is then the steady state and no request needs new memory
        self.k = xp.empty(shape, dtype=dtype)
        self.v = xp.empty(shape, dtype=dtype)
        self.k.fill(0)
        self.v.fill(0)

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)

    @staticmethod
    def bytes_needed(cfg: ModelConfig, n_slots: int, ctx: int, itemsize: int = 4) -> int:
        return n_slots * ctx * cfg.kv_bytes_per_token(itemsize)

    def write(self, layer: int, slot: int, start: int, k, v) -> None:
        """Store k, v [n, n_kv_heads, head_dim] at positions [start, start + n)."""
        n = k.shape[0]
        self.k[layer, slot, :, start:start + n] = k.transpose(1, 0, 2)
        self.v[layer, slot, :, start:start + n] = v.transpose(1, 0, 2)

    def view(self, layer: int, slot: int, length: int):
        """Keys and values [n_kv_heads, length, head_dim] of one slot, no copy."""
        return self.k[layer, slot, :, :length], self.v[layer, slot, :, :length]

    def save(self, slot: int, length: int):
        """A host copy of a slot's first `length` positions: (state, nbytes)."""
        to_host = getattr(self.xp, "asnumpy", np.array)   # a copy on either die
        k = to_host(self.k[:, slot, :, :length])
        v = to_host(self.v[:, slot, :, :length])
        return (k, v), int(k.nbytes + v.nbytes)

    def restore(self, slot: int, state) -> int:
        """Put a saved state back at the start of `slot`; returns its length."""
        k, v = state
        length = k.shape[2]
        self.k[:, slot, :, :length] = self.xp.asarray(k)
        self.v[:, slot, :, :length] = self.xp.asarray(v)
        return length

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Make slot `dst` start with the first `length` positions of slot `src`."""
        if length > self.ctx:
            raise ValueError(f"prefix of {length} positions exceeds the context {self.ctx}")
        if src != dst and length > 0:
            self.k[:, dst, :, :length] = self.k[:, src, :, :length]
            self.v[:, dst, :, :length] = self.v[:, src, :, :length]
