"""Gated attention (Qwen3.5's full-attention layer): softmax attention with an output gate.

Per token (spec: common/arch/stack.py GatedAttention; H query heads, Hkv kv heads,
hd = head_dim, R = rope.dim rotated dims):

    qg = x @ attn_q  [H, 2·hd]: per head [query (hd) | gate (hd)]
    q = rms_norm(qg[:, :hd], attn_q_norm),  gate = qg[:, hd:]          [H, hd]
    k = rms_norm(x @ attn_k, attn_k_norm),  v = x @ attn_v             [Hkv, hd]
    q, k: rotate-half rope on the first R dims only (Qwen3.5's mrope sections
          coincide for text: every section sees the same position)
    a = softmax(q kᵀ / sqrt(hd) + causal) v     (GQA, over the slot's KV cache)
    y = (a · sigmoid(gate)).reshape(H·hd) @ attn_output                 [D]

The norms' weights are the multipliers 1 + w (a GGUF stores them so; a Hugging Face
checkpoint's w gets its 1 on load). The attention itself is worker/layers/attention.py's:
the decodes of a step as one group, each prefill chunk alone.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...common.arch.stack import GatedAttention
from .attention import AttentionLayer, attend_batch
from .ops import linear, rms_norm, rope, sigmoid


@dataclass
class GatedAttentionWeights:
    wqkv: object            # [D, 2 q_dim + 2 kv_dim] (query|gate per head, k, v: fused)
    q_norm: object          # [head_dim]
    k_norm: object          # [head_dim]
    wo: object              # [q_dim, D]
    MATRICES = ("wqkv", "wo")


def load_gated_attention(ld, p: str, spec: GatedAttention, d_model: int) -> GatedAttentionWeights:
    shapes = spec.tensors(p, d_model)
    names = [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]
    return GatedAttentionWeights(
        wqkv=ld.proj(names, [shapes[n] for n in names]),
        q_norm=ld.norm(p + "attn_q_norm.weight", spec.head_dim),
        k_norm=ld.norm(p + "attn_k_norm.weight", spec.head_dim),
        wo=ld.proj([p + "attn_output.weight"], [shapes[p + "attn_output.weight"]]))


class GatedAttentionLayer(AttentionLayer):
    """One gated-attention layer: attention's state and set-up, its own projections."""

    load = staticmethod(load_gated_attention)

    def __call__(self, h, batch):
        """h [T, D] (normed) → [T, D], caching this step's k, v."""
        spec, w, n, qd, kvd, hd = self.spec, self.w, batch.n, self.qd, self.kvd, self.spec.head_dim
        qkv = linear(h, w.wqkv)                                        # [T, 2 qd + 2 kvd]
        qg = qkv[:n, :2 * qd].reshape(n, spec.n_heads, 2 * hd)
        gate = qg[..., hd:].reshape(n, qd)
        q = rms_norm(qg[..., :hd], w.q_norm, self.eps)
        k = rms_norm(qkv[:n, 2 * qd:2 * qd + kvd].reshape(n, spec.n_kv_heads, hd), w.k_norm,
                     self.eps)
        v = qkv[:n, 2 * qd + kvd:].reshape(n, spec.n_kv_heads, hd)
        cos, sin = batch.rope(self.rope)                               # [n, 1, R/2]
        q = rope(q, cos, sin, spec.scale)
        k = rope(k, cos, sin)
        attn = attend_batch(self.state, q, k, v, batch, None)          # [T, H hd]
        attn[:n] *= sigmoid(gate)
        return linear(attn, w.wo)
