"""Qwen3.5 (text): Gated DeltaNet (linear-attention) layers and gated full-attention layers.

Two sources: a GGUF written by llama.cpp's converter (arch `qwen35`), and a Hugging
Face folder (`model_type` "qwen3_5_text", Qwen3_5ForCausalLM, names `model.layers.N.…`;
or "qwen3_5", the multimodal wrapper: its text config is `text_config`, its names
`model.language_model.layers.N.…`; the vision tower and the MTP layers are not read).

- Layer types: config.json `layer_types` ("linear_attention" / "full_attention"),
  else `full_attention_interval` (layer i is full attention iff (i + 1) % interval
  == 0; llama.cpp's default 4, and all a GGUF carries).
- Every block: x += mixer(norm(x)); x += SwiGLU(norm(x)), the second norm named
  post_attention_norm (not ffn_norm).
- Zero-centred norms (attn_norm, post_attention_norm, attn_q_norm, attn_k_norm,
  output_norm) multiply by 1 + w: the converter stores 1 + w, a checkpoint w (its 1
  is added on load). The DeltaNet's gated ssm_norm is plain in both.
- The converter's other transforms are not redone on a checkpoint: its layers run
  as transformers holds them (stack.GatedDeltaNet.hf_layout): A_log (ssm_a =
  -exp(A_log) on load), conv1d [C, 1, K], and the value heads in grouped order
  (value head h reads key head h // r, r = n_v / n_k), where a GGUF has them tiled
  (h reads h % n_k) because ggml broadcasts that way. Permuting a checkpoint's
  rows and columns would give the same numbers; reading them as they are keeps a
  16-bit matrix as stored, and a quantized one needs no permutation at all.
- Gated attention: q_proj rows per head [query | gate]; rope on head_dim x
  partial_rotary_factor dims (GGUF rope.dimension_count); q scaled by head_dim^-0.5.

GGUF metadata (qwen35.*): block_count (+ nextn_predict_layers MTP blocks, not run),
embedding_length, feed_forward_length, context_length, attention.head_count,
attention.head_count_kv, attention.key_length, attention.layer_norm_rms_epsilon,
rope.freq_base, rope.dimension_count, ssm.conv_kernel, ssm.state_size (linear key
head dim), ssm.group_count (linear key heads), ssm.time_step_rank (linear value
heads), ssm.inner_size (value head dim x value heads), full_attention_interval.
Not read: the mrope sections (a text position is the same in every section).
"""
from __future__ import annotations

from . import Family, Field
from .stack import MLP, Block, GatedAttention, GatedDeltaNet, Rope

LINEAR, FULL = "linear_attention", "full_attention"


def _value_head_dim(v: dict) -> int:
    if v["ssm_inner_size"] is None:                  # a config.json without it
        from ..model_file import ModelFileError
        raise ModelFileError("config.json field 'linear_value_head_dim' is missing")
    return v["ssm_inner_size"] // v["linear_num_value_heads"]


FIELDS = (
    Field("linear_num_key_heads", "ssm.group_count", "linear_num_key_heads"),
    Field("linear_num_value_heads", "ssm.time_step_rank", "linear_num_value_heads"),
    Field("linear_key_head_dim", "ssm.state_size", "linear_key_head_dim"),
    Field("ssm_inner_size", "ssm.inner_size", None, hf_default=None),
    Field("linear_value_head_dim", None, "linear_value_head_dim", _value_head_dim),
    Field("linear_conv_kernel_dim", "ssm.conv_kernel", "linear_conv_kernel_dim", hf_default=4),
    Field("full_attention_interval", "full_attention_interval", "full_attention_interval", 4),
    Field("layer_types", None, "layer_types", None, cast=list),
    Field("rotary_dim", "rope.dimension_count", None, hf_default=None),
    Field("nextn_predict_layers", "nextn_predict_layers", None, 0),
)

# Hugging Face layer-name suffix → GGUF layer-name suffix (gguf-py's map for QWEN35).
HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
HF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def hf_name(name: str) -> str | None:
    """A checkpoint name (either prefix) → its GGUF name, or None if not ours (mtp.*, visual)."""
    if name.startswith("model.language_model."):
        name = "model." + name[len("model.language_model."):]
    if name in HF_GLOBAL:
        return HF_GLOBAL[name]
    if name.startswith("model.layers."):
        idx, _, rest = name[len("model.layers."):].partition(".")
        if idx.isdigit() and rest in HF_TO_GGUF:
            return f"blk.{idx}.{HF_TO_GGUF[rest]}"
    return None


def hf_config(raw: dict) -> dict:
    """The multimodal wrapper's text_config (its tie_word_embeddings may sit outside)."""
    if raw.get("model_type") != "qwen3_5":
        return raw
    text = raw.get("text_config")
    if not isinstance(text, dict) or not text:
        from ..model_file import ModelFileError
        raise ModelFileError("config.json (qwen3_5) lacks text_config")
    return {"tie_word_embeddings": raw.get("tie_word_embeddings", False), **text}


def configure(values: dict, fmt: str, get) -> dict:
    """The rotary dims of a checkpoint, the MTP blocks of a GGUF, and the consistency of
    the linear-attention sizes."""
    from ..model_file import ModelFileError
    out = {}
    if fmt == "gguf":
        out["n_layers"] = values["n_layers"] - int(values["nextn_predict_layers"])
    else:
        rope = get("rope_parameters") or {}
        factor = float(rope.get("partial_rotary_factor", get("partial_rotary_factor") or 0.25))
        out["rotary_dim"] = int(values["head_dim"] * factor)
    rot, hd = out.get("rotary_dim", values["rotary_dim"]), values["head_dim"]
    if rot % 2 or not 0 < rot <= hd:
        raise ModelFileError(f"qwen35: rotary dim {rot} does not fit head_dim {hd}")
    nk, nv = values["linear_num_key_heads"], values["linear_num_value_heads"]
    if nk < 1 or nv % nk:
        raise ModelFileError(f"qwen35: linear_num_value_heads ({nv}) is not a multiple of "
                             f"linear_num_key_heads ({nk})")
    if values["linear_conv_kernel_dim"] < 1:
        raise ModelFileError(f"qwen35: linear_conv_kernel_dim {values['linear_conv_kernel_dim']} < 1")
    if values["full_attention_interval"] < 1:
        raise ModelFileError(f"qwen35: full_attention_interval "
                             f"{values['full_attention_interval']} < 1")
    return out


def layer_types(cfg) -> list[str]:
    p = cfg.params
    if p["layer_types"] is None:
        k = p["full_attention_interval"]
        return [FULL if (i + 1) % k == 0 else LINEAR for i in range(cfg.n_layers)]
    types = list(p["layer_types"])
    if len(types) != cfg.n_layers or not set(types) <= {LINEAR, FULL}:
        from ..model_file import ModelFileError
        raise ModelFileError(f"qwen35: layer_types {types} do not describe {cfg.n_layers} "
                             f"linear/full attention layers")
    return types


def qwen35_blocks(cfg) -> tuple[Block, ...]:
    p = cfg.params
    linear = GatedDeltaNet(p["linear_num_key_heads"], p["linear_num_value_heads"],
                           p["linear_key_head_dim"], p["linear_value_head_dim"],
                           p["linear_conv_kernel_dim"], hf_layout=cfg.fmt == "hf")
    full = GatedAttention(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                          Rope(cfg.rope_theta, p["rotary_dim"], cfg.rope_scaling))
    mlp = MLP(cfg.d_ff, "silu")
    return tuple(Block(linear if t == LINEAR else full, mlp, mlp_norm="post_attention_norm")
                 for t in layer_types(cfg))


FAMILY = Family("qwen35", ("qwen3_5_text", "qwen3_5"), qwen35_blocks, FIELDS,
                norm_offset={"hf": 1.0}, configure=configure, rename=hf_name,
                hf_config=hf_config)
