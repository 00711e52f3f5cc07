"""The forward pass: one implementation over an array module `xp`.

A step runs a *mixed batch*: several sequences (each bound to a KV slot) at
different positions, each contributing one token (decode) or a chunk of
tokens (prefill). Their tokens are concatenated into one [T, D] activation so
that every weight matrix is read once per layer for all of them; only
attention, which depends on each sequence's own history, runs per sequence.
Logits are computed only for the positions that will be sampled.

Activations stay float32 everywhere. Every projection goes through
worker/linear.py: dense weights (fp32, or fp16 on a GPU) are multiplied in
their own dtype, quantized ones (QMatrix) by the die's kernels; the result is
float32 either way.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..common.model_file import ModelConfig
from .kv_cache import KVCache
from .linear import is_quantized, matmul
from .weights import Weights

F32 = np.float32


@dataclass(frozen=True, slots=True)
class Span:
    """One sequence's share of a mixed batch."""

    slot: int            # KV slot the sequence lives in
    start: int           # positions already in the slot's cache
    n: int               # tokens this step adds (1 for decode, a chunk for prefill)
    logits: bool = True  # whether the last of those positions needs logits


def rms_norm(x, w, eps: float):
    """x [..., d] normalized by its root mean square, times w [d]."""
    xp = _xp(x)
    ms = (x * x).mean(axis=-1, keepdims=True)
    return x * (1.0 / xp.sqrt(ms + eps)) * w


def linear(x, w, b=None):
    """x [T, in] @ W (+ b) → [T, out] float32, W held any way (worker/linear.py)."""
    y = matmul(x, w)
    if b is not None:
        y += b
    return y


def rope(x, cos, sin):
    """Rotate-half rotary embedding. x [T, H, hd]; cos, sin [T, 1, hd/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return _xp(x).concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def silu(x):
    """x * sigmoid(x), written with tanh so large |x| never overflows exp."""
    return x * (0.5 + 0.5 * _xp(x).tanh(0.5 * x))


def attend(q, k, v, start: int):
    """Causal grouped-query attention of one sequence against its cache.

    q [n, Hq, hd] (already scaled) for positions [start, start + n);
    k, v [Hkv, start + n, hd] → [n, Hq * hd].
    """
    xp = _xp(q)
    n, n_heads, hd = q.shape
    n_kv, length = k.shape[0], k.shape[1]
    group = n_heads // n_kv
    # query head h reads kv head h // group: group the queries by kv head
    qg = q.reshape(n, n_kv, group, hd).transpose(1, 2, 0, 3).reshape(n_kv, group * n, hd)
    s = (qg.astype(k.dtype, copy=False) @ k.transpose(0, 2, 1)).astype(F32, copy=False)
    if n > 1:  # position start+i sees keys 0..start+i (an additive mask: same on CuPy)
        future = xp.arange(length)[None, :] > (start + xp.arange(n))[:, None]     # [n, L]
        bias = xp.where(future, F32(-np.inf), F32(0.0))
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
    is 0 where a key is valid and -inf past each slot's length; sel [B] says
    which of the S slots each query belongs to. → [B, Hq * hd].
    """
    xp = _xp(q)
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


class DecodeGroup:
    """The single-token spans of a step, prepared once and used by every layer."""

    def __init__(self, spans: list[Span], xp):
        rows, slots, pos, row = [], [], [], 0
        for s in spans:
            if s.n == 1:
                rows.append(row), slots.append(s.slot), pos.append(s.start)
            row += s.n
        self.size = len(rows)
        if not self.size:
            return
        self.lo, self.hi = min(slots), max(slots) + 1
        self.length = max(pos) + 1
        self.rows, self.slots, self.pos = (xp.asarray(a) for a in (rows, slots, pos))
        self.sel = self.slots - self.lo
        lengths = np.full(self.hi - self.lo, self.length)        # unused slots: nothing masked
        lengths[np.asarray(slots) - self.lo] = np.asarray(pos) + 1
        bias = np.where(np.arange(self.length)[None, :] < lengths[:, None], 0.0, -np.inf)
        self.bias = xp.asarray(bias.astype(F32)[:, None, None, :])

    def run(self, kv: KVCache, layer: int, q, k, v, attn) -> None:
        """Write the group's k, v into the cache and its attention into `attn` rows."""
        kv.k[layer, self.slots, :, self.pos] = k[self.rows]
        kv.v[layer, self.slots, :, self.pos] = v[self.rows]
        kc = kv.k[layer, self.lo:self.hi, :, :self.length]
        vc = kv.v[layer, self.lo:self.hi, :, :self.length]
        attn[self.rows] = attend_decodes(q[self.rows], kc, vc, self.bias, self.sel)


def _xp(a):
    return np if isinstance(a, np.ndarray) else __import__("cupy").get_array_module(a)


class Model:
    """Weights, rotary tables and KV memory of one model replica on one die."""

    def __init__(self, cfg: ModelConfig, weights: Weights, xp, n_slots: int, ctx: int,
                 kv_dtype=F32):
        self.cfg, self.w, self.xp = cfg, weights, xp
        self.ctx = ctx
        self.kv = KVCache(cfg, n_slots, ctx, xp, kv_dtype)
        # float32 angles, as the reference computes them: position * inv_freq
        angles = xp.arange(ctx, dtype=F32)[:, None] * weights.inv_freq[None, :]
        self.cos, self.sin = xp.cos(angles), xp.sin(angles)        # [ctx, hd/2]
        self.scale = float(cfg.head_dim) ** -0.5                    # a Python float: stays f32
        # OpenBLAS runs skinny products fastest at row counts that are multiples
        # of 8 (measured: 8 rows cost less than 2..7), so on the CPU a batch of
        # dense weights is padded with zero rows that no span owns; the quantized
        # kernels cost in proportion to the rows and get none.
        dense = not is_quantized(weights.layers[0].wqkv) if weights.layers else True
        self.row_multiple = 8 if xp is np and dense else 1

    def forward(self, tokens, spans: list[Span]):
        """Run one mixed batch; returns logits [n_sampled, V] float32 (on the die).

        tokens: the spans' new token ids, concatenated in span order.
        """
        xp, cfg, w = self.xp, self.cfg, self.w
        for s in spans:
            if s.n < 1 or s.start + s.n > self.ctx:
                raise ValueError(f"span {s} does not fit the context of {self.ctx}")
        tokens = xp.asarray(tokens, dtype=xp.int64)
        positions = np.concatenate([np.arange(s.start, s.start + s.n) for s in spans])
        if tokens.shape[0] != positions.shape[0]:
            raise ValueError(f"{tokens.shape[0]} tokens for spans covering {positions.shape[0]}")
        pos = xp.asarray(positions)
        cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]   # [T, 1, hd/2]
        n, hd, qd, kvd = len(positions), cfg.head_dim, cfg.q_dim, cfg.kv_dim
        T = n if n == 1 else -(-n // self.row_multiple) * self.row_multiple
        x = xp.zeros((T, cfg.d_model), dtype=F32)                          # [T, D]
        x[:n] = w.embed_rows(tokens)
        attn = xp.zeros((T, qd), dtype=F32)                                # [T, Hq*hd]
        decodes = DecodeGroup(spans, xp)
        chunks = [(row, s) for row, s in zip(np.cumsum([0] + [s.n for s in spans]), spans)
                  if s.n > 1]
        for li, layer in enumerate(w.layers):
            h = rms_norm(x, layer.attn_norm, cfg.rms_eps)
            qkv = linear(h, layer.wqkv, layer.bqkv)                        # [T, qd + 2 kvd]
            q = qkv[:n, :qd].reshape(n, cfg.n_heads, hd)
            k = qkv[:n, qd:qd + kvd].reshape(n, cfg.n_kv_heads, hd)
            v = qkv[:n, qd + kvd:].reshape(n, cfg.n_kv_heads, hd)
            if cfg.qk_norm:
                q = rms_norm(q, layer.q_norm, cfg.rms_eps)
                k = rms_norm(k, layer.k_norm, cfg.rms_eps)
            q = rope(q, cos, sin) * self.scale
            k = rope(k, cos, sin)
            if decodes.size:
                decodes.run(self.kv, li, q, k, v, attn)
            for row, s in chunks:
                end = row + s.n
                self.kv.write(li, s.slot, s.start, k[row:end], v[row:end])
                kc, vc = self.kv.view(li, s.slot, s.start + s.n)
                attn[row:end] = attend(q[row:end], kc, vc, s.start)
            x += linear(attn, layer.wo)
            h = rms_norm(x, layer.ffn_norm, cfg.rms_eps)
            gate_up = linear(h, layer.w_gate_up)                           # [T, 2 d_ff]
            x += linear(silu(gate_up[:, :cfg.d_ff]) * gate_up[:, cfg.d_ff:], layer.w_down)
        assert x.dtype == F32, f"activations drifted to {x.dtype}"
        ends = np.cumsum([s.n for s in spans]) - 1
        rows = [int(e) for e, s in zip(ends, spans) if s.logits]
        if not rows:
            return xp.empty((0, cfg.vocab_size), dtype=F32)
        h = rms_norm(x[rows], w.out_norm, cfg.rms_eps)
        return linear(h, w.head)                                           # [n, V]
