"""Gemma 3 (text): interleaved sliding-window and global attention, GeGLU, sandwich norms.

- Layer types: config.json `layer_types` ("sliding_attention" / "full_attention"),
  else every `sliding_window_pattern`-th layer (6) is global, as transformers and
  llama.cpp (hard-coded 6) both do. Local layers see the last `sliding_window`
  positions (themselves included) and rotate with their own base (10k: config.json
  `rope_local_base_freq` or rope_parameters.sliding_attention, GGUF rope.freq_base_swa);
  a GGUF without attention.sliding_window has only global layers, as in llama.cpp;
  global layers use `rope_theta` (1M) and any rope scaling (linear, 4B and up).
- q/k RMSNorm per head; q scaled by query_pre_attn_scalar ** -0.5 (GGUF has no key:
  llama.cpp uses head_dim, or d_model / n_heads for the 62-layer 27B, as HF does).
- Every norm is RMSNorm times (1 + w): Hugging Face stores w, llama.cpp's converter
  stores 1 + w (Gemma3Model.modify_tensors adds 1 to every `norm.weight`).
- The embedding is multiplied by sqrt(d_model), rounded to the checkpoint's dtype
  (transformers: embed_scale.to(weight.dtype)); llama.cpp scales in fp32.
- Tied embeddings (262k vocabulary), no logit soft-capping in Gemma 3.
"""
from __future__ import annotations

import math

import numpy as np

from . import Family, Field
from .stack import MLP, Attention, Block, Rope, RopeScaling

FIELDS = (
    # a GGUF without the key has no local layers (llama.cpp); transformers' default is 4096
    Field("sliding_window", "attention.sliding_window", "sliding_window", None, hf_default=4096),
    Field("rope_local_theta", "rope.freq_base_swa", None, 10000.0, cast=float),
    Field("query_pre_attn_scalar", None, "query_pre_attn_scalar",
          lambda v: v["d_model"] // v["n_heads"] if v["n_layers"] == 62 else v["head_dim"],
          cast=float, hf_default=256.0),
    Field("sliding_window_pattern", "attention.sliding_window_pattern",
          ("sliding_window_pattern", "_sliding_window_pattern"), 6, cast=lambda x: x),
    Field("layer_types", None, "layer_types", None, cast=list),
    Field("dtype", None, ("dtype", "torch_dtype"), "float32", cast=str),
    Field("final_logit_softcapping", "final_logit_softcapping", "final_logit_softcapping", None,
          cast=float),
    Field("attn_logit_softcapping", None, "attn_logit_softcapping", None, cast=float),
    Field("use_bidirectional_attention", None, "use_bidirectional_attention", False, cast=bool),
)

HF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def configure(values: dict, fmt: str, get) -> dict:
    """The two rope tables and the unsupported variants, from either format."""
    from ..model_file import ModelFileError, hf_rope
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if values[key]:                               # None or 0: none
            raise ModelFileError(f"gemma3: {key}={values[key]} is not supported")
    if values["use_bidirectional_attention"]:
        raise ModelFileError("gemma3: use_bidirectional_attention (an embedding model) "
                             "is not supported")
    out = {}
    if fmt == "hf":
        params = get("rope_parameters")
        if isinstance(params, dict) and "full_attention" in params:      # transformers 5
            out["rope_theta"], out["rope_scaling"] = hf_rope(params["full_attention"], 1e6)
            local, scaling = hf_rope(params.get("sliding_attention") or {}, 10000.0)
            if scaling is not None:
                raise ModelFileError("gemma3: rope scaling of the sliding-window layers "
                                     "is not supported")
            out["rope_local_theta"] = local
        else:                                                            # transformers 4
            out["rope_theta"], out["rope_scaling"] = hf_rope(
                {"rope_theta": get("rope_theta") or 1e6, **(get("rope_scaling") or {})}, 1e6)
            out["rope_local_theta"] = float(get("rope_local_base_freq") or 10000.0)
    return out


def is_sliding(cfg) -> list[bool]:
    p = cfg.params
    if not p["sliding_window"]:
        return [False] * cfg.n_layers
    if p["layer_types"] is not None:
        types = list(p["layer_types"])
        if len(types) != cfg.n_layers or not set(types) <= {"sliding_attention",
                                                            "full_attention"}:
            from ..model_file import ModelFileError
            raise ModelFileError(f"gemma3: layer_types {types} do not describe "
                                 f"{cfg.n_layers} sliding/full attention layers")
        return [t == "sliding_attention" for t in types]
    pattern = p["sliding_window_pattern"]
    if isinstance(pattern, (list, tuple)):           # llama.cpp's per-layer array: True = SWA
        if len(pattern) != cfg.n_layers:
            from ..model_file import ModelFileError
            raise ModelFileError(f"gemma3: attention.sliding_window_pattern lists "
                                 f"{len(pattern)} layers, the model has {cfg.n_layers}")
        return [bool(x) for x in pattern]
    return [bool((i + 1) % int(pattern)) for i in range(cfg.n_layers)]


def gemma3_blocks(cfg) -> tuple[Block, ...]:
    p = cfg.params
    hd = cfg.head_dim
    scale = float(p["query_pre_attn_scalar"]) ** -0.5
    mlp = MLP(cfg.d_ff, "gelu_tanh")
    local = Attention(cfg.n_heads, cfg.n_kv_heads, hd, Rope(p["rope_local_theta"], hd),
                      scale, window=int(p["sliding_window"]), qk_norm=True)
    full = Attention(cfg.n_heads, cfg.n_kv_heads, hd,
                     Rope(cfg.rope_theta, hd, cfg.rope_scaling), scale, qk_norm=True)
    return tuple(Block(local if s else full, mlp, sandwich=True) for s in is_sliding(cfg))


def embed_scale(cfg) -> float:
    """sqrt(d_model) as the checkpoint's dtype holds it (fp32 for a GGUF)."""
    scale = np.float32(math.sqrt(cfg.d_model))
    dtype = cfg.params.get("dtype") if cfg.fmt == "hf" else "float32"
    if dtype in ("bfloat16", "bf16"):
        bits = scale.view(np.uint32)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000   # round to nearest even
        scale = np.uint32(bits).view(np.float32)
    elif dtype in ("float16", "fp16"):
        scale = np.float32(np.float16(scale))
    return float(scale)


FAMILY = Family("gemma3", ("gemma3_text",), gemma3_blocks, FIELDS, HF_LAYER_NAMES,
                hf_qk_norm=True, hf_tied=True, norm_offset={"hf": 1.0}, embed_scale=embed_scale,
                configure=configure)
