"""Llama (SmolLM2, TinyLlama, Llama 2/3, Mistral): pre-norm attention + SwiGLU blocks.

GGUF q/k rows are in llama.cpp's interleaved rotary order (undone on load); Llama-3
rope scaling comes as config.json `rope_scaling` or a GGUF `rope_freqs` tensor.
"""
from __future__ import annotations

from . import Family
from .stack import MLP, Attention, Block, Rope


def llama_blocks(cfg) -> tuple[Block, ...]:
    """Every layer the same: full attention (rope over the whole head), SwiGLU."""
    attn = Attention(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                     Rope(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling),
                     scale=float(cfg.head_dim) ** -0.5, qkv_bias=cfg.qkv_bias,
                     qk_norm=cfg.qk_norm)
    return (Block(attn, MLP(cfg.d_ff, "silu")),) * cfg.n_layers


FAMILY = Family("llama", ("llama", "mistral"), llama_blocks, gguf_qk_interleaved=True)
