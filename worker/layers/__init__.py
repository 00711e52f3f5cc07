"""The worker's side of a layer stack: one implementation per mixer kind, and the MLP.

A mixer kind (common/arch/stack.py spec `kind`) maps to a class with
    load(ld, prefix, spec, d_model) → its weights (a dataclass with MATRICES: the
        names of its projection fields), read through the weights Loader;
    new_state(spec, n_slots, ctx, xp, dtype) → its per-layer sequence state
        (worker/sequence_state.py: KVState, RecurrentState or alike);
    cls(spec, weights, state, rope_table, eps) → a callable (h [T, D], batch) → [T, D].
A new kind is one module here and one entry below.
"""
from __future__ import annotations

from .attention import AttentionLayer
from .gated_attention import GatedAttentionLayer
from .gated_deltanet import GatedDeltaNetLayer
from .mlp import GatedMLP, load_mlp

MIXERS = {"attention": AttentionLayer, "gated_attention": GatedAttentionLayer,
          "gated_deltanet": GatedDeltaNetLayer}

__all__ = ["MIXERS", "GatedMLP", "load_mlp"]
