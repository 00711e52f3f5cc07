"""A model's layer stack as data: one Block (a mixer, then an MLP) per layer.

Families (common/arch/<family>.py) build these from a config; the worker turns each
spec into its layer (worker/layers/, keyed by `kind`), and the frontend sizes a
replica's sequence state from them without any weights. A spec says what its
layer's state costs: attention keeps KV per position, a recurrent mixer a fixed
state per slot.
"""
from __future__ import annotations

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

    def bytes_per_token(self, itemsize: int) -> int:
        return 2 * self.n_kv_heads * self.head_dim * itemsize

    def bytes_per_slot(self) -> int:
        return 0


@dataclass(frozen=True, slots=True)
class MLP:
    """down(act(gate(x)) * up(x)): GGUF ffn_gate, ffn_up, ffn_down."""

    d_ff: int
    act: str = "silu"                     # "silu" (SwiGLU) | "gelu_tanh" (GeGLU)


@dataclass(frozen=True, slots=True)
class Block:
    """x += mixer(norm(x)); x += mlp(norm(x)).

    GGUF norms: attn_norm before the mixer, ffn_norm before the MLP; with
    `sandwich` (Gemma) also post_attention_norm after the mixer and post_ffw_norm
    after the MLP, each applied to the branch before it joins the residual.
    """

    mixer: Attention                      # or any mixer spec with kind / bytes_per_*
    mlp: MLP
    sandwich: bool = False
