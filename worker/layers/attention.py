"""Softmax attention over a KV cache: full, or within a sliding window.

Per step the decode spans (one token each) of every attention layer run as one
batched product over their slots' caches (DecodeGroup, prepared once per step and
shared by the layers); each prefill chunk attends alone, against its slot's history.
A sliding window is exact everywhere: a query at position p sees keys (p - window,
p], whether its prompt came in one chunk, in many, or token by token; only the keys
a window can reach are read.

On the CPU the C kernels (worker/kernels/attention.c) run both; on a GPU die each layer's step is
a few launches of worker/attention_cuda.py's kernels (the step's keys and values written,
quantized once; the decodes; the prefill chunks in tiles), which read the cache in its
stored type with no float copy of anyone's history. The NumPy expressions below are
the reference.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...common.arch.stack import Attention
from .. import attention_cuda, kernels_cpu
from ..sequence_state import KVState
from .ops import F32, linear, rms_norm, rope, xp_of


@dataclass
class AttentionWeights:
    wqkv: object            # [D, q_dim + 2 kv_dim] (q | k | v, fused)
    bqkv: object | None     # [q_dim + 2 kv_dim]               (qwen2)
    q_norm: object | None   # [head_dim]                        (qwen3, gemma3)
    k_norm: object | None   # [head_dim]
    wo: object              # [q_dim, D]
    MATRICES = ("wqkv", "wo")


def load_attention(ld, p: str, spec: Attention, d_model: int) -> AttentionWeights:
    qd, kvd, hd = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim, spec.head_dim
    qkv = [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]
    return AttentionWeights(
        wqkv=ld.proj(qkv, [(qd, d_model), (kvd, d_model), (kvd, d_model)]),
        bqkv=(ld.vector([n.replace("weight", "bias") for n in qkv], [qd, kvd, kvd])
              if spec.qkv_bias else None),
        q_norm=ld.norm(p + "attn_q_norm.weight", hd) if spec.qk_norm else None,
        k_norm=ld.norm(p + "attn_k_norm.weight", hd) if spec.qk_norm else None,
        wo=ld.proj([p + "attn_output.weight"], [(d_model, qd)]))


def attend(q, k, v, start: int, lo: int = 0, window: int | None = None):
    """Causal grouped-query attention of one sequence against its cache.

    q [n, Hq, hd] (already scaled) for positions [start, start + n);
    k, v [Hkv, L, hd] for positions [lo, lo + L), L = start + n - lo → [n, Hq * hd].
    With a window, position start + i sees keys (start + i - window, start + i].
    """
    xp = xp_of(q)
    if k.dtype != F32:     # an fp16 cache: products in float32 (a K80 has no fp16 math)
        k, v = k.astype(F32), v.astype(F32)
    n, n_heads, hd = q.shape
    n_kv, length = k.shape[0], k.shape[1]
    group = n_heads // n_kv
    # query head h reads kv head h // group: group the queries by kv head
    qg = q.reshape(n, n_kv, group, hd).transpose(1, 2, 0, 3).reshape(n_kv, group * n, hd)
    s = (qg.astype(k.dtype, copy=False) @ k.transpose(0, 2, 1)).astype(F32, copy=False)
    if n > 1 or window is not None:    # an additive mask: the same on CuPy
        key_pos = lo + xp.arange(length)[None, :]                                 # [1, L]
        q_pos = (start + xp.arange(n))[:, None]                                   # [n, 1]
        hidden = key_pos > q_pos
        if window is not None:
            hidden |= key_pos <= q_pos - window
        bias = xp.where(hidden, F32(-np.inf), F32(0.0))                           # [n, L]
        s = (s.reshape(n_kv, group, n, length) + bias).reshape(n_kv, group * n, length)
    s -= s.max(axis=-1, keepdims=True)
    p = xp.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    o = (p.astype(v.dtype, copy=False) @ v).astype(F32, copy=False)      # [Hkv, group*n, hd]
    return o.reshape(n_kv, group, n, hd).transpose(2, 0, 1, 3).reshape(n, n_heads * hd)


def attend_decodes(q, k, v, bias, sel):
    """Attention of many single-token sequences at once, over their slots' caches.

    q [B, Hq, hd] (scaled); k, v [S, Hkv, L, hd]: a contiguous range of S >= B
    slots, read in place (a view: no copy of anyone's history); bias [S, 1, 1, L]
    is 0 where a key is visible and -inf elsewhere; sel [B] says which of the S
    slots each query belongs to. → [B, Hq * hd].
    """
    xp = xp_of(q)
    if k.dtype != F32:
        k, v = k.astype(F32), v.astype(F32)
    n_seq, n_heads, hd = q.shape
    n_slots, n_kv = k.shape[0], k.shape[1]
    group = n_heads // n_kv
    qg = q.reshape(n_seq, n_kv, group, hd)
    if n_seq != n_slots or not (sel == xp.arange(n_slots)).all():
        full = xp.zeros((n_slots, n_kv, group, hd), dtype=q.dtype)
        full[sel] = qg
        qg = full
    s = (qg.astype(k.dtype, copy=False) @ k.transpose(0, 1, 3, 2)).astype(F32, copy=False)
    s += bias                                                         # [S, Hkv, g, L]
    s -= s.max(axis=-1, keepdims=True)
    p = xp.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    o = (p.astype(v.dtype, copy=False) @ v).astype(F32, copy=False)  # [S, Hkv, g, hd]
    return o[sel].reshape(n_seq, n_heads * hd)


# the CPU's attention runs in worker/kernels/attention.c (False: the NumPy expressions above, the
# reference a test compares it with); a GPU die's in worker/attention_cuda.py
C_ATTENTION = [True]


class DecodeGroup:
    """The single-token spans of a step, prepared once and used by every attention layer."""

    def __init__(self, spans, xp):
        rows, slots, pos, row = [], [], [], 0
        for s in spans:
            if s.n == 1:
                rows.append(row), slots.append(s.slot), pos.append(s.start)
            row += s.n
        self.size = len(rows)
        if not self.size:
            return
        self.xp = xp
        self.lo, self.hi = min(slots), max(slots) + 1
        self.length = max(pos) + 1
        self.rows, self.slots, self.pos = (xp.asarray(a) for a in (rows, slots, pos))
        self.sel = self.slots - self.lo
        self.host_slots, self.host_pos = np.asarray(slots), np.asarray(pos)
        self.leading = rows == list(range(self.size))     # the step's first rows
        self.masks: dict = {}

    def mask(self, window: int | None):
        """(first key position read, bias [S, 1, 1, L]) for layers of this window."""
        if window not in self.masks:
            lo = 0 if window is None else max(0, int(self.host_pos.min()) - window + 1)
            keys = np.arange(lo, self.length)[None, :]
            seen = np.ones((self.hi - self.lo, 1), dtype=bool)        # unused slots: see all
            first = np.full((self.hi - self.lo, 1), lo)
            last = np.full((self.hi - self.lo, 1), self.length - 1)
            last[self.host_slots - self.lo, 0] = self.host_pos
            if window is not None:
                first[self.host_slots - self.lo, 0] = self.host_pos - window + 1
            visible = seen & (keys >= first) & (keys <= last)
            bias = np.where(visible, 0.0, -np.inf).astype(F32)[:, None, None, :]
            self.masks[window] = lo, self.xp.asarray(bias)
        return self.masks[window]

    def bounds(self, window: int | None, cache_shape) -> kernels_cpu.DecodeBounds:
        """The cache rows each query reads (positions first .. last of its slot)."""
        key = ("bounds", window)
        if key not in self.masks:
            first = np.zeros_like(self.host_pos) if window is None else \
                np.maximum(self.host_pos - window + 1, 0)
            self.masks[key] = kernels_cpu.DecodeBounds(self.host_slots, first, self.host_pos,
                                                       cache_shape)
        return self.masks[key]

    def run(self, kv: KVState, q, k, v, out, window: int | None) -> None:
        """Write the group's k, v into the cache and its attention into `out` rows."""
        if self.xp is np and C_ATTENTION[0] \
                and kernels_cpu.kv_code(kv.k, kv.v, q.shape[2]) is not None:     # one C call
            bounds = self.bounds(window, kv.k.shape)
            if self.leading:                  # rows 0 .. size - 1: read and written in place
                kernels_cpu.attend_decodes(q[:self.size], k[:self.size], v[:self.size],
                                           kv.k, kv.v, bounds, out[:self.size])
                return
            res = np.empty((self.size, out.shape[1]), dtype=np.float32)
            kernels_cpu.attend_decodes(q[self.rows], k[self.rows], v[self.rows], kv.k, kv.v,
                                       bounds, res)
            out[self.rows] = res
            return
        kv.write_rows(self.slots, self.pos, k[self.rows], v[self.rows])
        lo, bias = self.mask(window)
        kc, vc = kv.window(slice(self.lo, self.hi), lo, self.length)
        out[self.rows] = attend_decodes(q[self.rows], kc, vc, bias, self.sel)


class AttentionLayer:
    """One attention layer: its weights, its KV state and its forward."""

    load = staticmethod(load_attention)

    def __init__(self, spec: Attention, w: AttentionWeights, state: KVState, rope_table,
                 eps: float):
        self.spec, self.w, self.state, self.rope, self.eps = spec, w, state, rope_table, eps
        self.qd, self.kvd = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim

    @staticmethod
    def new_state(spec: Attention, n_slots: int, ctx: int, xp, dtype) -> KVState:
        return KVState(n_slots, spec.n_kv_heads, ctx, spec.head_dim, xp, dtype)

    def __call__(self, h, batch):
        """h [T, D] (normed) → the layer's output [T, D], caching this step's k, v."""
        spec, w, n, qd, kvd = self.spec, self.w, batch.n, self.qd, self.kvd
        qkv = linear(h, w.wqkv, w.bqkv)                                # [T, qd + 2 kvd]
        q = qkv[:n, :qd].reshape(n, spec.n_heads, spec.head_dim)
        k = qkv[:n, qd:qd + kvd].reshape(n, spec.n_kv_heads, spec.head_dim)
        v = qkv[:n, qd + kvd:].reshape(n, spec.n_kv_heads, spec.head_dim)
        if w.q_norm is not None:
            q = rms_norm(q, w.q_norm, self.eps)
            k = rms_norm(k, w.k_norm, self.eps)
        cos, sin = batch.rope(self.rope)                               # [n, 1, r/2]
        q = rope(q, cos, sin, spec.scale)
        k = rope(k, cos, sin)
        attn = attend_batch(self.state, q, k, v, batch, spec.window)  # [T, Hq*hd]
        return linear(attn, w.wo)


def attend_batch(state: KVState, q, k, v, batch, window: int | None):
    """A step's attention for one layer: q [n, Hq, hd] (scaled, roped), k, v [n, Hkv, hd]
    are cached at their spans' positions; → [T, Hq * hd] (a step scratch buffer, padding
    rows zero): the decodes as one group, each prefill chunk alone."""
    attn = batch.scratch(q.shape[1] * q.shape[2])
    if not isinstance(q, np.ndarray):     # a GPU die: the whole step in a few launches
        plan = batch.memo("cuda", attention_cuda.StepPlan)
        attention_cuda.write(state, k, v, plan)         # quantized once, as written
        attention_cuda.attend(state, q, attn, plan, window)   # read where they are stored
        return attn
    decodes = batch.memo("decodes", DecodeGroup)
    if decodes.size:
        decodes.run(state, q, k, v, attn, window)
    for row, s in batch.chunks:
        end, stop = row + s.n, s.start + s.n
        if isinstance(q, np.ndarray) and C_ATTENTION[0] \
                and kernels_cpu.kv_code(state.k, state.v, q.shape[2]) is not None:
            # the CPU: a chunk is n queries of one slot at positions start .. stop - 1, each
            # writing its own key and value first: the decode kernel, causal as it stands
            pos = np.arange(s.start, stop)
            first = np.zeros_like(pos) if window is None else np.maximum(pos - window + 1, 0)
            bounds = kernels_cpu.DecodeBounds(np.full(s.n, s.slot), first, pos, state.k.shape)
            kernels_cpu.attend_decodes(q[row:end], k[row:end], v[row:end], state.k, state.v,
                                       bounds, attn[row:end])
            continue
        lo = 0 if window is None else max(0, s.start - window + 1)
        state.write(s.slot, s.start, k[row:end], v[row:end])
        kc, vc = state.view(s.slot, lo, stop)
        attn[row:end] = attend(q[row:end], kc, vc, s.start, lo, window)
    return attn
