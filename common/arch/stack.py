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

    GGUF norms: attn_norm before the mixer, ffn_norm before the MLP; with
    `sandwich` (Gemma) also post_attention_norm after the mixer and post_ffw_norm
    after the MLP, each applied to the branch before it joins the residual.
    """

    mixer: Attention                      # or any mixer spec with kind / bytes_per_* / tensors
    mlp: MLP
    sandwich: bool = False

    def tensors(self, layer: int, d_model: int) -> dict[str, tuple[int, ...]]:
        p = f"blk.{layer}."
        out = {p + "attn_norm.weight": (d_model,), p + "ffn_norm.weight": (d_model,)}
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
