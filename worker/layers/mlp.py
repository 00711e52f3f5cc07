"""The gated MLP: down(act(gate(x)) * up(x)), SwiGLU (silu) or GeGLU (gelu_tanh)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...common.arch.stack import MLP
from .. import kernels_cpu
from .ops import ACTIVATIONS, linear


@dataclass
class MLPWeights:
    w_gate_up: object       # [D, 2 d_ff] (gate | up, fused)
    w_down: object          # [d_ff, D]
    MATRICES = ("w_gate_up", "w_down")


def load_mlp(ld, p: str, spec: MLP, d_model: int) -> MLPWeights:
    ff = spec.d_ff
    return MLPWeights(
        w_gate_up=ld.proj([p + "ffn_gate.weight", p + "ffn_up.weight"], [(ff, d_model)] * 2),
        w_down=ld.proj([p + "ffn_down.weight"], [(d_model, ff)]))


class GatedMLP:
    def __init__(self, spec: MLP, w: MLPWeights):
        if spec.act not in ACTIVATIONS:
            raise ValueError(f"unknown MLP activation {spec.act!r}")
        self.d_ff, self.act, self.w = spec.d_ff, ACTIVATIONS[spec.act], w
        self.act_name, self.silu = spec.act, spec.act == "silu"

    def __call__(self, h):
        """h [T, D] → [T, D]."""
        gate_up = linear(h, self.w.w_gate_up)                          # [T, 2 d_ff]
        if self.silu and isinstance(gate_up, np.ndarray):   # the CPU: one C call
            inner = kernels_cpu.silu_mul(gate_up, self.d_ff)
            if inner is not None:
                return linear(inner, self.w.w_down)
        return linear(self.act(gate_up[:, :self.d_ff]) * gate_up[:, self.d_ff:], self.w.w_down)
