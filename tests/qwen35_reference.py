"""A standalone Qwen3.5 reference for tests: llama.cpp's converter transforms and their
inverse, the dense GGUF-layout weights, and a whole-sequence forward.

The engine (worker/layers/gated_deltanet.py, gated_attention.py) runs a checkpoint as
transformers holds it and a GGUF as the converter wrote it; this module converts a
checkpoint to the GGUF layout the way conversion/qwen.py does (Qwen3NextModel and
_LinearAttentionVReorderBase.modify_tensors), so the reference can check that the
converter's layout and transformers' agree, and runs it through the engine's own pure
functions with an attention and a KV history of its own:

- zero-centred norms (input_layernorm, post_attention_layernorm, q_norm, k_norm,
  model.norm): w + 1 (the multiplier); `linear_attn.norm` is plain.
- `A_log` → `ssm_a` = -exp(A_log); `dt_bias` → `ssm_dt.bias`; conv1d [C, 1, K] → [C, K].
- when nv != nk, the v heads go from transformers' grouped order ([k0v0, k0v1, …,
  k1v0, …]) to the tiled order ggml broadcasts in ([k0v0, k1v0, …, k0v1, …]): the v
  rows of in_proj_qkv and the v channels of conv1d (head size dv), the rows of
  in_proj_z (dv), of in_proj_a, in_proj_b and the entries of A_log, dt_bias (size 1),
  and the columns of out_proj (dv). q_proj is kept as it is.
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

from pantheon.common.arch.qwen35 import HF_GLOBAL, HF_TO_GGUF, LINEAR, hf_name
from pantheon.common.model_file import ModelConfig, ModelFileError, read_config
from pantheon.worker.layers import gated_deltanet as gdn
from pantheon.worker.layers.ops import rms_norm, sigmoid, silu
from pantheon.worker.linear import matmul

F32 = np.float32
FOLDED_NORMS = ("attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight",
                "attn_k_norm.weight")


@dataclass(frozen=True)
class Ref:
    """The sizes the reference reads, from a ModelConfig (duck-types a GatedDeltaNet spec
    in the GGUF layout for the engine's pure functions)."""

    cfg: ModelConfig
    hf_layout = False

    def __getattr__(self, name):
        return getattr(self.cfg, name)

    n_k_heads = property(lambda s: s.cfg.params["linear_num_key_heads"])
    n_v_heads = property(lambda s: s.cfg.params["linear_num_value_heads"])
    d_k = property(lambda s: s.cfg.params["linear_key_head_dim"])
    d_v = property(lambda s: s.cfg.params["linear_value_head_dim"])
    conv_kernel = property(lambda s: s.cfg.params["linear_conv_kernel_dim"])
    rotary_dim = property(lambda s: s.cfg.params["rotary_dim"])
    key_dim = property(lambda s: s.n_k_heads * s.d_k)
    value_dim = property(lambda s: s.n_v_heads * s.d_v)
    conv_dim = property(lambda s: 2 * s.key_dim + s.value_dim)

    @property
    def layer_types(self) -> tuple[str, ...]:
        return tuple("full_attention" if b.mixer.kind == "gated_attention" else LINEAR
                     for b in self.cfg.blocks)

    def is_linear(self, layer: int) -> bool:
        return self.layer_types[layer] == LINEAR

    def state_bytes(self) -> int:
        return self.cfg.fixed_bytes_per_slot()


def config(raw: dict) -> Ref:
    """The registry's config of a config.json dict (written to a temporary folder)."""
    folder = Path(tempfile.mkdtemp(prefix="qwen35-cfg-"))
    (folder / "config.json").write_text(json.dumps(raw))
    return Ref(read_config(folder))


def layer_shapes(cfg: Ref, layer: int) -> dict[str, tuple[int, ...]]:
    """GGUF name suffix → shape ([out, in] for a matrix) of layer `layer`, GGUF layout."""
    block = cfg.cfg.blocks[layer]
    out = {k.split(".", 2)[2]: v for k, v in block.tensors(layer, cfg.d_model).items()}
    if "ssm_conv1d.weight" in out:
        out["ssm_conv1d.weight"] = (cfg.conv_dim, cfg.conv_kernel)
    return out


def tensor_shapes(cfg: Ref) -> dict[str, tuple[int, ...]]:
    out = {"token_embd.weight": (cfg.vocab_size, cfg.d_model), "output_norm.weight": (cfg.d_model,)}
    if not cfg.tied_embeddings:
        out["output.weight"] = (cfg.vocab_size, cfg.d_model)
    for i in range(cfg.n_layers):
        out.update({f"blk.{i}.{k}": v for k, v in layer_shapes(cfg, i).items()})
    return out


def check_tensors(tensors: Mapping[str, object], cfg: Ref, source: str = "GGUF file"):
    for name, want in tensor_shapes(cfg).items():
        if name not in tensors:
            raise ModelFileError(f"{source} lacks tensor {name}")
        got = tuple(int(n) for n in tensors[name].shape)
        if got != want:
            raise ModelFileError(f"tensor {name} has shape {list(got)}, the config implies "
                                 f"{list(want)}")


# --- the converter's transforms ---------------------------------------------------------

def reorder_v_heads(a, axis: int, n_outer: int, n_inner: int, head: int):
    """View `axis` as [n_outer, n_inner, head] and swap the first two: grouped → tiled
    with (nk, r); the inverse is the same call with (r, nk)."""
    a = np.moveaxis(np.asarray(a), axis, 0)
    rest = a.shape[1:]
    a = a.reshape(n_outer, n_inner, head, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.ascontiguousarray(np.moveaxis(a, 0, axis))


def _v_reorder(suffix: str, a, cfg: Ref, outer: int, inner: int):
    kd2, dv = 2 * cfg.key_dim, cfg.d_v
    if suffix in ("attn_qkv.weight", "ssm_conv1d.weight"):
        return np.concatenate([a[:kd2], reorder_v_heads(a[kd2:], 0, outer, inner, dv)])
    if suffix == "attn_gate.weight":
        return reorder_v_heads(a, 0, outer, inner, dv)
    if suffix in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_dt.bias", "ssm_a"):
        return reorder_v_heads(a, 0, outer, inner, 1)
    if suffix == "ssm_out.weight":
        return reorder_v_heads(a, 1, outer, inner, dv)
    return a


def from_hf_tensors(hf: Mapping[str, np.ndarray], cfg: Ref) -> dict[str, np.ndarray]:
    """A checkpoint's float32 tensors → the GGUF tensors llama.cpp's converter writes."""
    out: dict[str, np.ndarray] = {}
    r = cfg.n_v_heads // cfg.n_k_heads
    for name, a in hf.items():
        g = hf_name(name)
        if g is None:
            continue
        a = np.asarray(a, dtype=np.float32)
        suffix = g.split(".", 2)[-1] if g.startswith("blk.") else g
        if suffix == "ssm_conv1d.weight":
            a = a.reshape(a.shape[0], a.shape[-1])
        if r > 1:
            a = _v_reorder(suffix, a, cfg, cfg.n_k_heads, r)
        if suffix == "ssm_a":
            a = -np.exp(a)
        elif suffix in FOLDED_NORMS or g == "output_norm.weight":
            a = a + np.float32(1.0)
        out[g] = np.ascontiguousarray(a, dtype=np.float32)
    if cfg.tied_embeddings:
        out.pop("output.weight", None)
    check_tensors(out, cfg, "checkpoint")
    return out


def to_hf_tensors(gg: Mapping[str, np.ndarray], cfg: Ref) -> dict[str, np.ndarray]:
    """Undo the converter exactly: GGUF tensors → transformers' Qwen3_5ForCausalLM state dict."""
    check_tensors(gg, cfg)
    back = {v: k for k, v in HF_TO_GGUF.items()}
    glob = {v: k for k, v in HF_GLOBAL.items()}
    r = cfg.n_v_heads // cfg.n_k_heads
    out: dict[str, np.ndarray] = {}
    for g in tensor_shapes(cfg):
        a = np.asarray(gg[g], dtype=np.float32)
        if g.startswith("blk."):
            idx, suffix = g.split(".", 2)[1:]
            name = f"model.layers.{idx}.{back[suffix]}"
        else:
            suffix, name = g, glob[g]
        if suffix == "ssm_a":
            a = np.log(-a)
        elif suffix in FOLDED_NORMS or g == "output_norm.weight":
            a = a - np.float32(1.0)
        if r > 1:
            a = _v_reorder(suffix, a, cfg, r, cfg.n_k_heads)
        if suffix == "ssm_conv1d.weight":
            a = a[:, None, :]
        out[name] = np.ascontiguousarray(a, dtype=np.float32)
    return out


def dense_layers(gg: Mapping[str, np.ndarray], cfg: Ref):
    """GGUF-layout float tensors → (globals, per-layer dicts): matrices transposed to the
    dense [in, out] that linear.matmul multiplies, the rest as is. Keys drop the
    `blk.N.` prefix and the `.weight`/`.bias` suffix."""
    check_tensors(gg, cfg)

    def key(suffix):
        return suffix.rsplit(".", 1)[0] if suffix.endswith((".weight", ".bias")) else suffix

    def prep(suffix, a):
        a = np.asarray(a, dtype=np.float32)
        mat = a.ndim == 2 and suffix not in ("ssm_conv1d.weight", "token_embd.weight")
        return np.ascontiguousarray(a.T) if mat else a

    layers = [{key(s): prep(s, gg[f"blk.{i}.{s}"]) for s in layer_shapes(cfg, i)}
              for i in range(cfg.n_layers)]
    embed = np.asarray(gg["token_embd.weight"], dtype=np.float32)                 # [V, D]
    head = np.asarray(gg["output.weight" if "output.weight" in gg and not cfg.tied_embeddings
                         else "token_embd.weight"], dtype=np.float32)
    glob = {"token_embd": embed, "output_norm": np.asarray(gg["output_norm.weight"], np.float32),
            "output": np.ascontiguousarray(head.T)}                                # [D, V]
    return glob, layers


# --- the reference mixers (whole sequences, dict weights) -------------------------------

def mlp(x, w):
    """SwiGLU: x [T, D] → [T, D]."""
    return matmul(silu(matmul(x, w["ffn_gate"])) * matmul(x, w["ffn_up"]), w["ffn_down"])


def new_deltanet_state(cfg: Ref, batch: tuple[int, ...] = ()):
    return (np.zeros(batch + (cfg.conv_kernel - 1, cfg.conv_dim), dtype=F32),
            np.zeros(batch + (cfg.n_v_heads, cfg.d_k, cfg.d_v), dtype=F32))


def deltanet_project(x, w, cfg: Ref):
    T = x.shape[0]
    mixed = matmul(x, w["attn_qkv"])
    z = matmul(x, w["attn_gate"]).reshape(T, cfg.n_v_heads, cfg.d_v)
    beta, g = gdn.gates(matmul(x, w["ssm_beta"]), matmul(x, w["ssm_alpha"]), w["ssm_a"], w["ssm_dt"])
    return mixed, z, beta, g


def deltanet_output(o, z, w, cfg: Ref):
    return gdn.deltanet_output(o, z, w["ssm_norm"], w["ssm_out"], cfg.rms_eps)


def gated_deltanet(x, w, cfg: Ref, tail, state):
    """One sequence: x [n, D] (normed) → (y [n, D], tail, state)."""
    mixed, z, beta, g = deltanet_project(x, w, cfg)
    o, tail, state = gdn.deltanet_core(mixed, beta, g, w["ssm_conv1d"], cfg, tail, state)
    return deltanet_output(o, z, w, cfg), tail, state


def rope_tables(positions, cfg: Ref):
    """cos, sin [T, R/2] float32 for the rotary dims (float32 angles, as transformers)."""
    R = cfg.rotary_dim
    inv_freq = (1.0 / (cfg.rope_theta ** (np.arange(0, R, 2, dtype=np.float32) / R))).astype(F32)
    angles = np.asarray(positions, dtype=F32)[:, None] * inv_freq[None, :]
    return np.cos(angles), np.sin(angles)


def partial_rope(x, cos, sin):
    half = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * half:]], axis=-1)


def attend(q, k, v, start: int):
    """Causal GQA of one sequence: q [n, H, hd] (scaled); k, v [L, Hkv, hd], L = start + n."""
    n, H, hd = q.shape
    L, Hkv = k.shape[0], k.shape[1]
    qg = np.ascontiguousarray(q.reshape(n, Hkv, H // Hkv, hd).transpose(1, 2, 0, 3))
    s = qg @ np.ascontiguousarray(k.transpose(1, 2, 0))[:, None]                     # [Hkv, g, n, L]
    future = np.arange(L)[None, :] > (start + np.arange(n))[:, None]
    s = s + np.where(future, -np.inf, 0.0).astype(F32)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    o = p @ np.ascontiguousarray(v.transpose(1, 0, 2))[:, None]
    return o.transpose(2, 0, 1, 3).reshape(n, H * hd)


def gated_attention(x, w, cfg: Ref, start: int, k_cache=None, v_cache=None):
    """One sequence: x [n, D] (normed) at [start, start + n), its k, v history
    → (y [n, D], k, v [start + n, Hkv, hd])."""
    n, H, hd = x.shape[0], cfg.n_heads, cfg.head_dim
    cos, sin = rope_tables(np.arange(start, start + n), cfg)
    qg = matmul(x, w["attn_q"]).reshape(n, H, 2 * hd)
    gate = qg[..., hd:].reshape(n, H * hd)
    q = rms_norm(qg[..., :hd], w["attn_q_norm"], cfg.rms_eps)
    k = rms_norm(matmul(x, w["attn_k"]).reshape(n, cfg.n_kv_heads, hd), w["attn_k_norm"], cfg.rms_eps)
    v = matmul(x, w["attn_v"]).reshape(n, cfg.n_kv_heads, hd)
    q, k = partial_rope(q, cos, sin) * (hd ** -0.5), partial_rope(k, cos, sin)
    if k_cache is not None and k_cache.shape[0]:
        k, v = np.concatenate([k_cache, k]), np.concatenate([v_cache, v])
    return matmul(attend(q, k, v, start) * sigmoid(gate), w["attn_output"]), k, v
