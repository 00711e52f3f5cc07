"""A model's layer stack as data: one Block (a mixer, then an MLP) per layer.

Families (common/arch/<family>.py) build these from a config; the worker turns each
spec into its layer (worker/layers/, keyed by `kind`), and the frontend sizes a
replica's sequence state from them without any weights. A spec says what its
layer's state costs: attention keeps KV per position, a recurrent mixer a fixed
state per slot.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """How rotary frequencies are stretched beyond the trained context.

    kind: "linear" (every frequency / factor) or "llama3" (Llama 3.1's banded
    rule; a GGUF carries its result as the `rope_freqs` tensor instead).
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192


@dataclass(frozen=True, slots=True)
class Rope:
    """One rotary table: layers with equal Ropes share it."""

    theta: float
    dim: int                              # rotated dimensions of a head (rotate-half)
    scaling: RopeScaling | None = None


@dataclass(frozen=True, slots=True)
class Attention:
    """Causal (grouped-query) softmax attention over a KV cache.

    GGUF tensors per layer: attn_q, attn_k, attn_v, attn_output (.weight), with
    attn_{q,k,v}.bias when qkv_bias and attn_{q,k}_norm.weight when qk_norm.
    """

    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope: Rope
    scale: float                          # multiplies q (head_dim ** -0.5 unless a family says)
    window: int | None = None             # sliding window: a query sees the last `window`
                                          # positions, itself included; None: all of them
    qkv_bias: bool = False
    qk_norm: bool = False                 # RMSNorm over each head's q and k, before rope
    kind = "attention"

    def bytes_per_token(self, itemsize: float) -> int:
        # itemsize: mean bytes per element (q8_0 34/32, q4_0 18/32: exact for a head_dim
        # of whole blocks)
        return int(2 * self.n_kv_heads * self.head_dim * itemsize)

    def tensors(self, p: str, d_model: int) -> dict[str, tuple[int, ...]]:
        """GGUF name → shape ([out, in] for a matrix) of every tensor the layer reads."""
        qd, kvd, hd = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.head_dim
        out = {p + "attn_q.weight": (qd, d_model), p + "attn_k.weight": (kvd, d_model),
               p + "attn_v.weight": (kvd, d_model), p + "attn_output.weight": (d_model, qd)}
        if self.qkv_bias:
            out |= {p + "attn_q.bias": (qd,), p + "attn_k.bias": (kvd,), p + "attn_v.bias": (kvd,)}
        if self.qk_norm:
            out |= {p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,)}
        return out

    def bytes_per_slot(self) -> int:
        return 0


@dataclass(frozen=True, slots=True)
class GatedAttention:
    """Qwen3.5's full-attention layer: softmax attention over a KV cache whose q
    projection carries a per-head output gate, q/k RMSNorm, rope on the first
    `rope.dim` dims of a head only, and the output times sigmoid(gate).

    GGUF tensors per layer: attn_q ([2 n_heads head_dim, D]: per head query | gate
    rows), attn_k, attn_v, attn_output, attn_q_norm, attn_k_norm (.weight).
    """

    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope: Rope                            # dim: the rotated dims (head_dim x partial factor)
    kind = "gated_attention"

    @property
    def scale(self) -> float:
        return float(self.head_dim) ** -0.5

    def bytes_per_token(self, itemsize: float) -> int:
        # itemsize: mean bytes per element (q8_0 34/32, q4_0 18/32: exact for a head_dim
        # of whole blocks)
        return int(2 * self.n_kv_heads * self.head_dim * itemsize)

    def bytes_per_slot(self) -> int:
        return 0

    def tensors(self, p: str, d_model: int) -> dict[str, tuple[int, ...]]:
        qd, kvd, hd = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.head_dim
        return {p + "attn_q.weight": (2 * qd, d_model), p + "attn_k.weight": (kvd, d_model),
                p + "attn_v.weight": (kvd, d_model), p + "attn_output.weight": (d_model, qd),
                p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,)}


@dataclass(frozen=True, slots=True)
class GatedDeltaNet:
    """Linear attention by the gated delta rule (Qwen3.5, Qwen3-Next), whose state per
    slot is fixed: a [n_v_heads, d_k, d_v] matrix and the last conv_kernel - 1
    inputs of its causal convolution, float32, whatever the length.

    GGUF tensors per layer: attn_qkv [conv_dim, D], attn_gate (z) [n_v d_v, D],
    ssm_beta, ssm_alpha [n_v, D], ssm_conv1d [conv_dim, K], ssm_dt.bias, ssm_a [n_v],
    ssm_norm [d_v], ssm_out [D, n_v d_v]. `hf_layout`: the tensors as a Hugging Face
    checkpoint holds them instead: A_log (ssm_a = -exp(A_log)), conv1d [conv_dim, 1, K],
    the value heads grouped by key head (value head h reads key head h // r; in a
    GGUF they are tiled, h reads h % n_k_heads).
    """

    n_k_heads: int
    n_v_heads: int
    d_k: int
    d_v: int
    conv_kernel: int
    hf_layout: bool = False
    kind = "gated_deltanet"

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.d_k

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.d_v

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """One slot's recurrent state: the conv tail and the delta-rule matrix."""
        return {"conv": (self.conv_kernel - 1, self.conv_dim),
                "ssm": (self.n_v_heads, self.d_k, self.d_v)}

    def bytes_per_token(self, itemsize: int) -> int:
        return 0

    def bytes_per_slot(self) -> int:
        return 4 * sum(math.prod(s) for s in self.state_shapes().values())

    def tensors(self, p: str, d_model: int) -> dict[str, tuple[int, ...]]:
        nv, c, k = self.n_v_heads, self.conv_dim, self.conv_kernel
        return {p + "attn_qkv.weight": (c, d_model), p + "attn_gate.weight": (self.value_dim, d_model),
                p + "ssm_beta.weight": (nv, d_model), p + "ssm_alpha.weight": (nv, d_model),
                p + "ssm_conv1d.weight": (c, 1, k) if self.hf_layout else (c, k),
                p + "ssm_dt.bias": (nv,), p + "ssm_a": (nv,), p + "ssm_norm.weight": (self.d_v,),
                p + "ssm_out.weight": (d_model, self.value_dim)}


@dataclass(frozen=True, slots=True)
class MLP:
    """down(act(gate(x)) * up(x)): GGUF ffn_gate, ffn_up, ffn_down."""

    d_ff: int
    act: str = "silu"                     # "silu" (SwiGLU) | "gelu_tanh" (GeGLU)

    def tensors(self, p: str, d_model: int) -> dict[str, tuple[int, ...]]:
        return {p + "ffn_gate.weight": (self.d_ff, d_model), p + "ffn_up.weight": (self.d_ff, d_model),
                p + "ffn_down.weight": (d_model, self.d_ff)}


@dataclass(frozen=True, slots=True)
class Block:
    """x += mixer(norm(x)); x += mlp(norm(x)).

    GGUF norms: attn_norm before the mixer, `mlp_norm` (ffn_norm) before the MLP; with
    `sandwich` (Gemma) also post_attention_norm after the mixer and post_ffw_norm
    after the MLP, each applied to the branch before it joins the residual.
    """

    mixer: Attention | GatedAttention | GatedDeltaNet
    mlp: MLP
    sandwich: bool = False
    mlp_norm: str = "ffn_norm"            # the pre-MLP norm's name (Qwen3.5: post_attention_norm)

    def tensors(self, layer: int, d_model: int) -> dict[str, tuple[int, ...]]:
        p = f"blk.{layer}."
        out = {p + "attn_norm.weight": (d_model,), p + f"{self.mlp_norm}.weight": (d_model,)}
        if self.sandwich:
            out |= {p + "post_attention_norm.weight": (d_model,),
                    p + "post_ffw_norm.weight": (d_model,)}
        return out | self.mixer.tensors(p, d_model) | self.mlp.tensors(p, d_model)


def expected_tensors(cfg) -> dict[str, tuple[int, ...]]:
    """Every tensor a model of `cfg` must have (GGUF names), with its shape. The output
    head (output.weight, [vocab, d_model]) is optional: without it the head is tied."""
    d = cfg.d_model
    out = {"token_embd.weight": (cfg.vocab_size, d), "output_norm.weight": (d,)}
    for i, block in enumerate(cfg.blocks):
        out |= block.tensors(i, d)
    return out
