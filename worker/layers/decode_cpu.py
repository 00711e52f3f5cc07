"""A decode step's layers in one C call each, on the CPU, built from each block's spec.

When every span of a step is a single token, a block runs as pn_decode_layer
(worker/kernels/layer.c): the kernels the Python layer calls one by one, in the same
order over the same buffers' values, without the ~20 Python-level calls, checks and temporaries per
layer in between (at batch 1 those took about a fifth of SmolLM2's step: 0.06 ms of
Python per layer against a layer's 0.2 ms of kernels). The C layer is described by the
spec's features, each a field of PnLayer (worker/kernels/pantheon.h):

    pre-norms, and the post-norms of a sandwich block (Gemma 3)      norm1/2, post1/2
    (1 + w) norms: the loader adds the 1 (worker/weights.py)         (a plain multiplier)
    the MLP's gate: SiLU or tanh-GELU                                 gelu
    attention: qkv bias, q / k norms, rotary on the first 2·half
        dims of a head, a sliding window, the output gated by
        sigmoid(gate) (Qwen3.5's gated attention)                     bqkv, q/k_norm, half,
                                                                      first[], gated
    Gated DeltaNet's decode update: conv step, gated delta rule,
        gated output norm (Qwen3.5's linear attention)                mixer = 1, conv, ...

A block whose features the C layer lacks (a new mixer kind or activation), or whose
matrices the integer kernels cannot hold, runs the Python layers, and the load log says
which blocks and why (DecodeLayers.describe): a new family feature is a flag here, never a
silent fallback. The llama-shaped layer gives the Python layer's bits; tanh, exp and the
delta rule's sums agree with NumPy's to float32 rounding (tests/test_decode_cpu.py).

A layer takes this way only if the integer kernels take each of its matrices at the
step's batch (the C kernels' pn_int_ok); any other step or die runs the Python forward,
which stays the reference.
"""
from __future__ import annotations

import ctypes

import numpy as np

from .. import kernels_cpu
from ..qmatrix import QMatrix
from . import attention
from .attention import AttentionLayer, DecodeGroup
from .gated_attention import GatedAttentionLayer
from .gated_deltanet import GatedDeltaNetLayer
from .mlp import GatedMLP

F32 = np.float32

# False: every step takes the Python layers (tests compare the two ways)
ENABLED = [True]

_CLayer = kernels_cpu.DECLS.structs["PnLayer"]    # worker/kernels/pantheon.h's PnLayer, PnStep
_CStep = kernels_cpu.DECLS.structs["PnStep"]


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


def _array(a, shape) -> bool:
    return isinstance(a, np.ndarray) and a.dtype == F32 and a.shape == tuple(shape) \
        and a.flags.c_contiguous


class Unfused(Exception):
    """Why a block runs the Python layers (the load log says it)."""


def _need(ok, why: str) -> None:
    if not ok:
        raise Unfused(why)


def _matrices(named: dict, shapes: dict) -> dict:
    """name → its parts, checked against the [out, in] shape the C layer assumes."""
    mats = {}
    for name, w in named.items():
        parts = _parts(w)
        _need(parts is not None, f"{name}: not a matrix the integer kernels hold")
        _need((sum(m.rows for m in parts), parts[0].cols) == shapes[name]
              and all(m.cols == parts[0].cols for m in parts), f"{name}: an unexpected shape")
        mats[name] = parts
    return mats


class _Layer:
    """One block's PnLayer (and what its pointers point into, kept alive)."""

    def __init__(self, block, d_model: int):
        mixer, mlp = block.mixer, block.mlp
        c = self.c = _CLayer()
        self.keep, self.window, self.rope, self.state = [], None, None, None
        _need(type(mlp) is GatedMLP and mlp.act_name in ("silu", "gelu_tanh"),
              f"an MLP the C layer lacks ({type(mlp).__name__}, "
              f"{getattr(mlp, 'act_name', 'no activation')})")
        _need(_vector(block.mixer_norm, d_model) and _vector(block.mlp_norm, d_model),
              "its norms are not float32 vectors")
        for name, post in (("post1", block.post_mixer_norm), ("post2", block.post_mlp_norm)):
            _need(post is None or _vector(post, d_model), "a post-norm not a float32 vector")
            setattr(c, name, self._ptr(post))
        c.norm1, c.norm2 = self._ptr(block.mixer_norm), self._ptr(block.mlp_norm)
        c.eps, c.D, c.d_ff, c.gelu = mixer.eps, d_model, mlp.d_ff, mlp.act_name == "gelu_tanh"
        ff = mlp.d_ff
        self.mats = _matrices({"gu": mlp.w.w_gate_up, "down": mlp.w.w_down},
                              {"gu": (2 * ff, d_model), "down": (d_model, ff)})
        if type(mixer) in (AttentionLayer, GatedAttentionLayer):
            self._attention(mixer, d_model)
        elif type(mixer) is GatedDeltaNetLayer:
            self._deltanet(mixer, d_model)
        else:
            raise Unfused(f"a mixer the C layer lacks ({type(mixer).__name__})")
        for name, parts in self.mats.items():
            getattr(c, name)[:] = [kernels_cpu._cmat(m) for m in parts] + [None] * (3 - len(parts))
        self.addr = ctypes.addressof(c)
        self.features = self._features(block)

    def _ptr(self, a):
        if a is None:
            return None
        self.keep.append(a)
        return kernels_cpu._ptr(a)

    def _attention(self, mixer, d_model: int) -> None:
        spec, w, kv, c = mixer.spec, mixer.w, mixer.state, self.c
        gated = type(mixer) is GatedAttentionLayer
        qd, kvd, hd = mixer.qd, mixer.kvd, spec.head_dim
        qw = 2 * qd if gated else qd
        _need(mixer.rope is not None and isinstance(mixer.rope.cos, np.ndarray)
              and 2 * mixer.rope.cos.shape[-1] <= hd, "no rotary table on the CPU")
        _need(isinstance(kv.k, np.ndarray) and isinstance(kv.v, np.ndarray)
              and kernels_cpu.kv_code(kv.k, kv.v, hd) is not None,
              f"a KV cache the C attention lacks ({kv.k.dtype})")
        bias = getattr(w, "bqkv", None)
        _need(bias is None or _vector(bias, qw + 2 * kvd), "a qkv bias of another shape")
        _need((w.q_norm is None and not gated)
              or (_vector(w.q_norm, hd) and _vector(w.k_norm, hd)), "q / k norms of another shape")
        self.mats |= _matrices({"qkv": w.wqkv, "o": w.wo},
                               {"qkv": (qw + 2 * kvd, d_model), "o": (d_model, qd)})
        self.window, self.rope = getattr(spec, "window", None), mixer.rope
        c.bqkv, c.q_norm, c.k_norm = self._ptr(bias), self._ptr(w.q_norm), self._ptr(w.k_norm)
        c.scale, c.gated = spec.scale, gated
        c.Hq, c.Hkv, c.hd, c.half = spec.n_heads, spec.n_kv_heads, hd, mixer.rope.cos.shape[-1]
        c.K, c.V, c.ctx = self._ptr(kv.k), self._ptr(kv.v), kv.k.shape[2]
        c.kv16 = kernels_cpu.kv_code(kv.k, kv.v, hd)     # k type | v type << 2
        self.cache_shape = kv.k.shape

    def _deltanet(self, mixer, d_model: int) -> None:
        spec, w, c = mixer.spec, mixer.w, self.c
        nk, nv, dk, dv, K = spec.n_k_heads, spec.n_v_heads, spec.d_k, spec.d_v, spec.conv_kernel
        conv_dim = spec.conv_dim
        _need(nv % nk == 0 and K >= 1, "value heads not a multiple of key heads")
        _need(_array(mixer.conv_state, mixer.conv_state.shape[:1] + (K - 1, conv_dim))
              and _array(mixer.ssm_state, mixer.ssm_state.shape[:1] + (nv, dk, dv)),
              "a recurrent state not float32 on the CPU")
        _need(_array(w.conv, (conv_dim, K)) and _vector(w.dt, nv) and _vector(w.a, nv)
              and _vector(w.norm, dv), "conv / gate / norm weights not float32 vectors")
        named = {"qkv": w.w_in, "o": w.w_out}
        if _array(w.w_ba, (d_model, 2 * nv)):      # a file's F32 rows, dense [in, out]
            c.ba_dense = self._ptr(w.w_ba)
        else:
            named["ba"] = w.w_ba
        self.mats |= _matrices(named, {"qkv": (conv_dim + nv * dv, d_model),
                                       "ba": (2 * nv, d_model), "o": (d_model, nv * dv)})
        c.mixer = 1
        c.conv, c.dt, c.a, c.ssm_norm = (self._ptr(a) for a in (w.conv, w.dt, w.a, w.norm))
        c.conv_state, c.ssm_state = self._ptr(mixer.conv_state), self._ptr(mixer.ssm_state)
        c.nk, c.nv, c.dk, c.dv, c.kconv, c.tiled = nk, nv, dk, dv, K, not spec.hf_layout
        self.state = mixer.state

    def _features(self, block) -> str:
        c, out = self.c, []
        if c.mixer == 1:
            out.append("gated deltanet")
        else:
            out.append("gated attention" if c.gated else "attention")
            if c.bqkv:
                out.append("qkv bias")
            if c.q_norm:
                out.append("q/k norms")
            if 2 * c.half < c.hd:
                out.append(f"rope {2 * c.half}/{c.hd}")
            if self.window is not None:
                out.append(f"window {self.window}")
        if c.post1 or c.post2:
            out.append("post-norms")
        out.append("gelu_tanh" if c.gelu else "silu")
        return ", ".join(out)

    @classmethod
    def of(cls, block, d_model: int):
        """The block's C layer, or the reason pn_decode_layer cannot run it."""
        try:
            return cls(block, d_model)
        except Unfused as e:
            return str(e)

    def takes(self, batch: int) -> bool:
        lib = kernels_cpu.library()
        return all(lib.pn_int_ok(kernels_cpu._cmat(m), batch)
                   for parts in self.mats.values() for m in parts)


class _Buffers:
    """A step's scratch rows for `batch` queries: every layer's widest."""

    def __init__(self, layers: list[_Layer], batch: int):
        cs = [layer.c for layer in layers]

        def widest(f):
            return max(1, max(f(c) for c in cs))
        rows = [sum(m.rows for m in layer.mats["qkv"]) for layer in layers]
        width = {"h": widest(lambda c: c.D), "qkv": max(rows),
                 "part": max(m.rows for layer in layers for p in layer.mats.values() for m in p),
                 "qn": widest(lambda c: c.Hq * c.hd), "kn": widest(lambda c: c.Hkv * c.hd),
                 "gu": widest(lambda c: 2 * c.d_ff), "act": widest(lambda c: c.d_ff),
                 "attn": widest(lambda c: max(c.Hq * c.hd, c.nv * c.dv)),
                 "ba": widest(lambda c: 2 * c.nv),
                 "conv": widest(lambda c: 2 * c.nk * c.dk + c.nv * c.dv)}
        width |= {"qr": width["qn"], "kr": width["kn"], "y": width["h"]}
        cols = max(max(m.cols for p in layer.mats.values() for m in p) for layer in layers)
        zeros = kernels_cpu.aligned_zeros
        self.arrays = {name: zeros((batch, n), F32) for name, n in width.items()}
        self.arrays |= {"xq": zeros((batch, cols), np.int16),
                        "xd": zeros((batch, cols // 32), F32),
                        "xs": zeros((batch, cols // 32), F32)}
        c = self.c = _CStep()
        c.B = batch
        for name, a in self.arrays.items():     # x's int16 scratch: the PnScratch s
            setattr(c.s if name in ("xq", "xd", "xs") else c, name, kernels_cpu._ptr(a))
        self.addr = ctypes.addressof(c)


class DecodeLayers:
    """The model's layers that pn_decode_layer can run (index → _Layer), and why the
    others cannot (index → reason)."""

    def __init__(self, blocks, d_model: int):
        built = {i: _Layer.of(block, d_model) for i, block in enumerate(blocks)}
        self.layers = {i: b for i, b in built.items() if isinstance(b, _Layer)}
        self.reasons = {i: b for i, b in built.items() if isinstance(b, str)}
        self._by_batch: dict[int, tuple] = {}

    def describe(self) -> list[str]:
        """Per run of equal layers: what runs fused, or why it runs the Python layers."""
        n = len(self.layers) + len(self.reasons)
        says = [f"fused ({self.layers[i].features})" if i in self.layers
                else f"Python layers: {self.reasons[i]}" for i in range(n)]
        out, i = [], 0
        while i < n:
            j = i
            while j + 1 < n and says[j + 1] == says[i]:
                j += 1
            out.append(f"layer{'s' if j > i else ''} {i}{f'-{j}' if j > i else ''}: {says[i]}")
            i = j + 1
        return out

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
        self.slots = None

    def run(self, i: int, x: np.ndarray) -> bool:
        layer = self.layers.get(i)
        if layer is None:
            return False
        if layer.state is not None:                     # a recurrent layer
            return self._recurrent(layer, x)
        if layer.window not in self.firsts:
            bounds = self.group.bounds(layer.window, layer.cache_shape)
            self.firsts[layer.window] = (bounds, bounds.ptrs[1])
        bounds, first = self.firsts[layer.window]
        slots, _, last = bounds.ptrs
        self.buffers.c.slots, self.buffers.c.last = slots, last
        key = id(layer.rope)
        if key not in self.ropes:
            cos, sin = self.batch.rope(layer.rope)
            assert cos.flags.c_contiguous and sin.flags.c_contiguous
            self.ropes[key] = (cos, sin, kernels_cpu._ptr(cos), kernels_cpu._ptr(sin))
        _, _, cos, sin = self.ropes[key]
        done = self.lib.pn_decode_layer(layer.addr, self.buffers.addr, first, cos, sin,
                                        kernels_cpu._ptr(x))
        assert done, "a product the kernels said they take was refused"
        return True

    def _recurrent(self, layer: _Layer, x: np.ndarray) -> bool:
        group, st = self.group, layer.state
        if self.slots is None:
            self.slots = np.ascontiguousarray(group.host_slots, dtype=np.int64)
        for slot, pos in zip(group.host_slots, group.host_pos):
            st.begin(int(slot), int(pos))
        self.buffers.c.slots = kernels_cpu._ptr(self.slots)
        done = self.lib.pn_decode_layer(layer.addr, self.buffers.addr, None, None, None,
                                        kernels_cpu._ptr(x))
        assert done, "a product the kernels said they take was refused"
        for slot in group.host_slots:
            st.absorbed(int(slot), 1)
        return True
