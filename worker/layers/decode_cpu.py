"""A decode step's attention layers in one C call each, on the CPU.

When every span of a step is a single token, a plain pre-norm attention block (any
qkv bias, q / k norms, sliding window or partial rotary) with a SwiGLU MLP runs as
kernels.c's pn_decode_layer: the kernels the Python layer calls one by one (norm,
products, rotary, attention, silu * up), in the same order over the same buffers'
values, so the same bits come out, without the ~20 Python-level calls, checks and
temporaries per layer in between. At batch 1 those took about a fifth of SmolLM2's
step (0.06 ms of Python per layer against a layer's 0.2 ms of kernels).

A layer takes this way only if the integer kernels take each of its matrices at the
step's batch (kernels.c's pn_int_ok); any other layer, step or die runs the Python
forward, which stays the reference (tests compare the two bit for bit).
"""
from __future__ import annotations

import ctypes

import numpy as np

from .. import kernels_cpu
from ..qmatrix import QMatrix
from . import attention
from .attention import AttentionLayer, DecodeGroup
from .mlp import GatedMLP

F32 = np.float32
_P = ctypes.c_void_p

# False: every step takes the Python layers (tests compare the two ways)
ENABLED = [True]


class _CLayer(ctypes.Structure):        # kernels.c's PnLayer
    _fields_ = [("qkv", _P * 3), ("o", _P * 3), ("gu", _P * 3), ("down", _P * 3),
                ("bqkv", _P), ("norm1", _P), ("norm2", _P), ("q_norm", _P), ("k_norm", _P),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("D", ctypes.c_int64), ("Hq", ctypes.c_int64), ("Hkv", ctypes.c_int64),
                ("hd", ctypes.c_int64), ("d_ff", ctypes.c_int64), ("half", ctypes.c_int64),
                ("K", _P), ("V", _P), ("ctx", ctypes.c_int64), ("kv16", ctypes.c_int64)]


class _CStep(ctypes.Structure):         # kernels.c's PnStep
    _fields_ = [("B", ctypes.c_int64), ("slots", _P), ("last", _P),
                *[(name, _P) for name in ("h", "qkv", "part", "qn", "kn", "qr", "kr", "attn",
                                          "y", "gu", "act")],
                ("xq", _P), ("xd", _P), ("xs", _P)]


def _parts(w) -> list[QMatrix] | None:
    """A projection's matrices if the integer kernels can hold them (up to 3 parts)."""
    parts = w if isinstance(w, list) else [w]
    if not 1 <= len(parts) <= 3:
        return None
    for m in parts:
        if not (isinstance(m, QMatrix) and isinstance(m.qs, np.ndarray)
                and m.kind in kernels_cpu.CODES):
            return None
    return parts


def _vector(a, n: int) -> bool:
    return isinstance(a, np.ndarray) and a.dtype == F32 and a.shape == (n,) \
        and a.flags.c_contiguous


class _Layer:
    """One block's PnLayer (and what its pointers point into, kept alive)."""

    def __init__(self, block, mats: dict, d_model: int):
        mixer, spec, w = block.mixer, block.mixer.spec, block.mixer.w
        self.window, self.rope, self.mats = spec.window, mixer.rope, mats
        self.keep = [w.bqkv, block.mixer_norm, block.mlp_norm, w.q_norm, w.k_norm,
                     mixer.state.k, mixer.state.v]
        half = mixer.rope.cos.shape[-1]
        c = self.c = _CLayer()
        for name, parts in mats.items():
            getattr(c, name)[:] = [kernels_cpu._cmat(m) for m in parts] + [None] * (3 - len(parts))
        ptr = kernels_cpu._ptr
        c.bqkv = None if w.bqkv is None else ptr(w.bqkv)
        c.norm1, c.norm2 = ptr(block.mixer_norm), ptr(block.mlp_norm)
        c.q_norm = None if w.q_norm is None else ptr(w.q_norm)
        c.k_norm = None if w.k_norm is None else ptr(w.k_norm)
        c.eps, c.scale = mixer.eps, spec.scale
        c.D, c.Hq, c.Hkv, c.hd = d_model, spec.n_heads, spec.n_kv_heads, spec.head_dim
        c.d_ff, c.half = block.mlp.d_ff, half
        c.K, c.V, c.ctx = ptr(mixer.state.k), ptr(mixer.state.v), mixer.state.k.shape[2]
        c.kv16 = kernels_cpu.kv_code(mixer.state.k, mixer.state.v, spec.head_dim)
        self.addr = ctypes.addressof(c)
        self.cache_shape = mixer.state.k.shape

    @classmethod
    def of(cls, block, d_model: int):
        """The block's C layer, or None where pn_decode_layer cannot run it."""
        mixer, mlp = block.mixer, block.mlp
        if type(mixer) is not AttentionLayer or type(mlp) is not GatedMLP or not mlp.silu \
                or block.post_mixer_norm is not None or block.post_mlp_norm is not None \
                or mixer.rope is None or not isinstance(mixer.rope.cos, np.ndarray):
            return None
        spec, w, kv = mixer.spec, mixer.w, mixer.state
        qd, kvd, hd = mixer.qd, mixer.kvd, spec.head_dim
        if not (isinstance(kv.k, np.ndarray) and isinstance(kv.v, np.ndarray)
                and kernels_cpu.kv_code(kv.k, kv.v, hd) is not None) \
                or 2 * mixer.rope.cos.shape[-1] > hd:
            return None
        if not (_vector(block.mixer_norm, d_model) and _vector(block.mlp_norm, d_model)
                and (w.bqkv is None or _vector(w.bqkv, qd + 2 * kvd))
                and (w.q_norm is None or (_vector(w.q_norm, hd) and _vector(w.k_norm, hd)))):
            return None
        mats = {"qkv": _parts(w.wqkv), "o": _parts(w.wo), "gu": _parts(mlp.w.w_gate_up),
                "down": _parts(mlp.w.w_down)}
        if any(p is None for p in mats.values()):
            return None
        shapes = {"qkv": (qd + 2 * kvd, d_model), "o": (d_model, qd),
                  "gu": (2 * mlp.d_ff, d_model), "down": (d_model, mlp.d_ff)}
        for name, parts in mats.items():
            if (sum(m.rows for m in parts), parts[0].cols) != shapes[name] \
                    or any(m.cols != parts[0].cols for m in parts):
                return None
        return cls(block, mats, d_model)

    def takes(self, batch: int) -> bool:
        lib = kernels_cpu.library()
        return all(lib.pn_int_ok(kernels_cpu._cmat(m), batch)
                   for parts in self.mats.values() for m in parts)


class _Buffers:
    """A step's scratch rows for `batch` queries: every layer's widest."""

    def __init__(self, layers: list[_Layer], batch: int):
        cs = [layer.c for layer in layers]
        width = {"h": max(c.D for c in cs),
                 "qkv": max(c.Hq * c.hd + 2 * c.Hkv * c.hd for c in cs),
                 "part": max(m.rows for layer in layers for p in layer.mats.values() for m in p),
                 "qn": max(c.Hq * c.hd for c in cs), "kn": max(c.Hkv * c.hd for c in cs),
                 "gu": max(2 * c.d_ff for c in cs), "act": max(c.d_ff for c in cs)}
        width |= {"qr": width["qn"], "kr": width["kn"], "attn": width["qn"], "y": width["h"]}
        cols = max(max(m.cols for p in layer.mats.values() for m in p) for layer in layers)
        zeros = kernels_cpu.aligned_zeros
        self.arrays = {name: zeros((batch, n), F32) for name, n in width.items()}
        self.arrays |= {"xq": zeros((batch, cols), np.int16),
                        "xd": zeros((batch, cols // 32), F32),
                        "xs": zeros((batch, cols // 32), F32)}
        c = self.c = _CStep()
        c.B = batch
        for name, a in self.arrays.items():
            setattr(c, name, kernels_cpu._ptr(a))
        self.addr = ctypes.addressof(c)


class DecodeLayers:
    """The model's layers that pn_decode_layer can run (index → _Layer)."""

    def __init__(self, blocks, d_model: int):
        self.layers = {i: layer for i, block in enumerate(blocks)
                       if (layer := _Layer.of(block, d_model)) is not None}
        self._by_batch: dict[int, tuple] = {}

    def step(self, batch):
        """A Step for this batch, or None (a prefill chunk in it, or no layer fits)."""
        if not ENABLED[0] or not attention.C_ATTENTION[0] or not self.layers \
                or any(s.n != 1 for s in batch.spans) or batch.T != batch.n:
            return None
        n = batch.n
        hit = self._by_batch.get(n)
        if hit is None:
            if len(self._by_batch) > 64:
                self._by_batch.clear()
            taken = {i: layer for i, layer in self.layers.items() if layer.takes(n)}
            hit = self._by_batch[n] = (taken, _Buffers(list(taken.values()), n) if taken else None)
        taken, buffers = hit
        return Step(taken, buffers, batch) if taken else None


class Step:
    """One decode step's C layers: run(i, x) does block i, or says it cannot."""

    def __init__(self, layers: dict, buffers: _Buffers, batch):
        self.layers, self.buffers, self.batch = layers, buffers, batch
        self.group = batch.memo("decodes", DecodeGroup)
        self.firsts: dict = {}
        self.ropes: dict = {}
        self.lib = kernels_cpu.library()

    def run(self, i: int, x: np.ndarray) -> bool:
        layer = self.layers.get(i)
        if layer is None:
            return False
        if layer.window not in self.firsts:
            bounds = self.group.bounds(layer.window, layer.cache_shape)
            slots, first, last = bounds.ptrs
            self.buffers.c.slots, self.buffers.c.last = slots, last
            self.firsts[layer.window] = (bounds, first)
        key = id(layer.rope)
        if key not in self.ropes:
            cos, sin = self.batch.rope(layer.rope)
            assert cos.flags.c_contiguous and sin.flags.c_contiguous
            self.ropes[key] = (cos, sin, kernels_cpu._ptr(cos), kernels_cpu._ptr(sin))
        _, _, cos, sin = self.ropes[key]
        done = self.lib.pn_decode_layer(layer.addr, self.buffers.addr, self.firsts[layer.window][1],
                                        cos, sin, kernels_cpu._ptr(x))
        assert done, "a product the kernels said they take was refused"
        return True
