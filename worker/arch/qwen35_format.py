"""What a Qwen3.5 model file holds: config fields, tensor names, the converter's transforms.

Two sources: a GGUF written by llama.cpp's converter (arch `qwen35`), and a
Hugging Face folder (`model_type` "qwen3_5_text", Qwen3_5ForCausalLM, names
`model.layers.N.…`; or "qwen3_5", the multimodal wrapper, whose text config is
`text_config` and whose names are `model.language_model.layers.N.…`).

The canonical layout is llama.cpp's, because a GGUF's quantized blocks cannot
be permuted for free while a checkpoint's float tensors can: `from_hf_tensors`
applies the converter's transforms (conversion/qwen.py, Qwen3NextModel and
_LinearAttentionVReorderBase.modify_tensors) and `to_hf_tensors` undoes them
(exact but for the float32 rounding of the +1 and of log(exp)). They are, per tensor:

- names: HF_TO_GGUF below (gguf-py's tensor map for MODEL_ARCH.QWEN35);
  `post_attention_layernorm` is `post_attention_norm` here, not `ffn_norm`.
- zero-centred norms (input_layernorm, post_attention_layernorm, q_norm,
  k_norm, model.norm): w + 1 (the multiplier). `linear_attn.norm` is plain: kept.
- `A_log` → `ssm_a` = -exp(A_log); `dt_bias` → `ssm_dt.bias`.
- `conv1d.weight` [C, 1, K] → `ssm_conv1d.weight` [C, K].
- when nv != nk, the v heads go from transformers' grouped order (value head
  h = key head h // r, then its r values: [k0v0, k0v1, …, k1v0, …]) to the
  tiled order ggml broadcasts in (h = vi·nk + ki: [k0v0, k1v0, …, k0v1, …]):
  the v rows of in_proj_qkv and the v channels of conv1d (head size dv), the
  rows of in_proj_z (dv), of in_proj_a, in_proj_b and the entries of A_log,
  dt_bias (size 1), and the columns of out_proj (dv). The q/k parts are kept.
- q_proj is kept as it is: per head [query (hd) | gate (hd)] rows.

GGUF metadata (qwen35.*): block_count (+ nextn_predict_layers MTP blocks, not
run here), embedding_length, feed_forward_length, context_length,
attention.head_count, attention.head_count_kv, attention.key_length /
value_length (head_dim), attention.layer_norm_rms_epsilon, rope.freq_base,
rope.dimension_count (head_dim · partial_rotary_factor), rope.dimension_sections,
ssm.conv_kernel, ssm.state_size (linear_key_head_dim), ssm.group_count
(linear_num_key_heads), ssm.time_step_rank (linear_num_value_heads),
ssm.inner_size (linear_value_head_dim · linear_num_value_heads),
full_attention_interval (layer i is full attention iff (i + 1) % interval == 0;
llama.cpp's default 4). Not read: `attn_output_gate` (transformers' Qwen3.5
always gates), the mrope sections (text positions are the same in every section).

For a registry module: config_from_hf / config_from_gguf give the Qwen35Config;
tensor_shapes / layer_shapes list what to load per layer (by layer type) and
check_tensors validates it; from_hf_tensors turns a checkpoint's floats into
the GGUF layout (quantize after it); dense_layers gives the reference [in, out]
dicts that qwen35_ops reads (keys: the GGUF names without blk.N. and suffix).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ...common.model_file import ModelFileError, field_value

LINEAR, FULL = "linear_attention", "full_attention"
ARCH = "qwen35"
HF_MODEL_TYPES = ("qwen3_5_text", "qwen3_5")


@dataclass(frozen=True, slots=True)
class Qwen35Config:
    """The shapes and constants of one Qwen3.5 text model."""

    n_layers: int
    d_model: int
    d_ff: int
    vocab_size: int
    context_length: int
    rms_eps: float
    n_heads: int              # gated attention
    n_kv_heads: int
    head_dim: int
    rotary_dim: int           # head_dim · partial_rotary_factor
    rope_theta: float
    layer_types: tuple[str, ...]
    n_k_heads: int            # Gated DeltaNet: linear_num_key_heads
    n_v_heads: int            # linear_num_value_heads
    d_k: int                  # linear_key_head_dim
    d_v: int                  # linear_value_head_dim
    conv_kernel: int          # linear_conv_kernel_dim
    tied_embeddings: bool

    def __post_init__(self):
        if len(self.layer_types) != self.n_layers:
            raise ModelFileError(f"layer_types has {len(self.layer_types)} entries for "
                                 f"{self.n_layers} layers")
        bad = sorted(set(self.layer_types) - {LINEAR, FULL})
        if bad:
            raise ModelFileError(f"layer_types: unknown layer type {bad[0]!r}")
        if self.n_v_heads % self.n_k_heads:
            raise ModelFileError(f"linear_num_value_heads ({self.n_v_heads}) is not a multiple "
                                 f"of linear_num_key_heads ({self.n_k_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ModelFileError(f"num_attention_heads ({self.n_heads}) is not a multiple of "
                                 f"num_key_value_heads ({self.n_kv_heads})")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ModelFileError(f"rotary dim {self.rotary_dim} does not fit head_dim "
                                 f"{self.head_dim}")
        if self.conv_kernel < 1:
            raise ModelFileError(f"linear_conv_kernel_dim {self.conv_kernel} < 1")

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.d_k

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.d_v

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def is_linear(self, layer: int) -> bool:
        return self.layer_types[layer] == LINEAR

    def state_bytes(self) -> int:
        """One sequence's recurrent state over all linear layers (fp32; attention KV apart)."""
        per = (self.conv_kernel - 1) * self.conv_dim + self.n_v_heads * self.d_k * self.d_v
        return 4 * per * sum(map(self.is_linear, range(self.n_layers)))


def _interval_types(n_layers: int, interval: int) -> tuple[str, ...]:
    if interval < 1:
        raise ModelFileError(f"full_attention_interval {interval} < 1")
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers))


def config_from_hf(cfg: dict) -> Qwen35Config:
    """From a config.json dict ("qwen3_5_text", or "qwen3_5" with its text_config)."""
    model_type = cfg.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ModelFileError(f"model_type {model_type!r} is not Qwen3.5 ({', '.join(HF_MODEL_TYPES)})")
    text = (cfg.get("text_config") or {}) if model_type == "qwen3_5" else cfg
    if model_type == "qwen3_5" and not text:
        raise ModelFileError("config.json (qwen3_5) lacks text_config")

    def need(key):
        if key not in text or text[key] is None:
            raise ModelFileError(f"config.json lacks {key}")
        return text[key]

    rope = text.get("rope_parameters") or {}
    n_layers, d_model, n_heads = int(need("num_hidden_layers")), int(need("hidden_size")), \
        int(need("num_attention_heads"))
    head_dim = int(text.get("head_dim") or d_model // n_heads)
    factor = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
    types = text.get("layer_types")
    layer_types = tuple(types) if types else _interval_types(
        n_layers, int(text.get("full_attention_interval", 4)))
    kind = rope.get("rope_type", "default")
    if kind != "default":
        raise ModelFileError(f"unsupported rope_type {kind!r} for Qwen3.5 (default only)")
    return Qwen35Config(
        n_layers=n_layers, d_model=d_model, d_ff=int(need("intermediate_size")),
        vocab_size=int(need("vocab_size")),
        context_length=int(text.get("max_position_embeddings", 32768)),
        rms_eps=float(text.get("rms_norm_eps", 1e-6)),
        n_heads=n_heads, n_kv_heads=int(text.get("num_key_value_heads") or n_heads),
        head_dim=head_dim, rotary_dim=int(head_dim * factor),
        rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
        layer_types=layer_types,
        n_k_heads=int(need("linear_num_key_heads")), n_v_heads=int(need("linear_num_value_heads")),
        d_k=int(need("linear_key_head_dim")), d_v=int(need("linear_value_head_dim")),
        conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
        tied_embeddings=bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
    )


def config_from_gguf(reader) -> Qwen35Config:
    """From a GGUF reader (gguf.GGUFReader or common.gguf_file.GGUFFile) of arch qwen35."""
    arch = field_value(reader, "general.architecture")
    if arch != ARCH:
        raise ModelFileError(f"GGUF architecture {arch!r} is not {ARCH!r}")

    def get(key, default=None):
        value = field_value(reader, f"{ARCH}.{key}", default)
        if value is None:
            raise ModelFileError(f"GGUF file lacks {ARCH}.{key}")
        return value

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelFileError("GGUF file lacks tensor token_embd.weight")
    n_layers = int(get("block_count")) - int(get("nextn_predict_layers", 0))
    d_model, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
    nv = int(get("ssm.time_step_rank"))
    inner = int(get("ssm.inner_size"))
    if inner % nv:
        raise ModelFileError(f"{ARCH}.ssm.inner_size {inner} is not a multiple of "
                             f"{ARCH}.ssm.time_step_rank {nv}")
    vocab = int(field_value(reader, f"{ARCH}.vocab_size",
                            int(tensors["token_embd.weight"].shape[1])))
    return Qwen35Config(
        n_layers=n_layers, d_model=d_model, d_ff=int(get("feed_forward_length")),
        vocab_size=vocab, context_length=int(get("context_length")),
        rms_eps=float(get("attention.layer_norm_rms_epsilon")),
        n_heads=n_heads, n_kv_heads=int(get("attention.head_count_kv", n_heads)),
        head_dim=int(get("attention.key_length", d_model // n_heads)),
        rotary_dim=int(get("rope.dimension_count")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        layer_types=_interval_types(n_layers, int(get("full_attention_interval", 4))),
        n_k_heads=int(get("ssm.group_count")), n_v_heads=nv,
        d_k=int(get("ssm.state_size")), d_v=inner // nv,
        conv_kernel=int(get("ssm.conv_kernel")),
        tied_embeddings="output.weight" not in tensors,
    )


# --- tensor names and shapes ------------------------------------------------------------

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
# zero-centred norms: the GGUF holds 1 + w
FOLDED_NORMS = ("attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight",
                "attn_k_norm.weight")


def layer_shapes(cfg: Qwen35Config, layer: int) -> dict[str, tuple[int, ...]]:
    """GGUF name suffix → shape as NumPy reads it ([out, in] for a matrix) for layer `layer`."""
    D, ff = cfg.d_model, cfg.d_ff
    out = {"attn_norm.weight": (D,), "post_attention_norm.weight": (D,),
           "ffn_gate.weight": (ff, D), "ffn_up.weight": (ff, D), "ffn_down.weight": (D, ff)}
    if cfg.is_linear(layer):
        nv = cfg.n_v_heads
        out.update({"attn_qkv.weight": (cfg.conv_dim, D), "attn_gate.weight": (cfg.value_dim, D),
                    "ssm_beta.weight": (nv, D), "ssm_alpha.weight": (nv, D),
                    "ssm_conv1d.weight": (cfg.conv_dim, cfg.conv_kernel), "ssm_dt.bias": (nv,),
                    "ssm_a": (nv,), "ssm_norm.weight": (cfg.d_v,),
                    "ssm_out.weight": (D, cfg.value_dim)})
    else:
        q, kv, hd = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.head_dim
        out.update({"attn_q.weight": (2 * q, D), "attn_k.weight": (kv, D),
                    "attn_v.weight": (kv, D), "attn_output.weight": (D, q),
                    "attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)})
    return out


def tensor_shapes(cfg: Qwen35Config) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs (full GGUF names) → its NumPy shape."""
    out = {"token_embd.weight": (cfg.vocab_size, cfg.d_model), "output_norm.weight": (cfg.d_model,)}
    if not cfg.tied_embeddings:
        out["output.weight"] = (cfg.vocab_size, cfg.d_model)
    for i in range(cfg.n_layers):
        out.update({f"blk.{i}.{k}": v for k, v in layer_shapes(cfg, i).items()})
    return out


def _why(cfg: Qwen35Config, name: str) -> str:
    suffix = name.split(".", 2)[-1] if name.startswith("blk.") else name
    return {
        "attn_qkv.weight": "2·linear_num_key_heads·linear_key_head_dim + linear_num_value_heads·"
                           "linear_value_head_dim, hidden_size",
        "ssm_conv1d.weight": "conv_dim, linear_conv_kernel_dim",
        "attn_q.weight": "2·num_attention_heads·head_dim (query and gate), hidden_size",
    }.get(suffix, "the config")


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


def check_tensors(tensors: Mapping[str, object], cfg: Qwen35Config, source: str = "GGUF file"):
    """Every needed tensor is present with the shape the config implies, else a
    ModelFileError naming the tensor."""
    for name, want in tensor_shapes(cfg).items():
        if name not in tensors:
            raise ModelFileError(f"{source} lacks tensor {name}")
        got = tuple(int(n) for n in tensors[name].shape)
        if got != want:
            raise ModelFileError(f"tensor {name} has shape {list(got)}, the config implies "
                                 f"{list(want)} ({_why(cfg, name)})")


# --- the converter's transforms ---------------------------------------------------------

def reorder_v_heads(a, axis: int, n_outer: int, n_inner: int, head: int):
    """View `axis` as [n_outer, n_inner, head] and swap the first two: grouped → tiled
    with (nk, r); the inverse is the same call with (r, nk)."""
    a = np.moveaxis(np.asarray(a), axis, 0)
    rest = a.shape[1:]
    a = a.reshape(n_outer, n_inner, head, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.ascontiguousarray(np.moveaxis(a, 0, axis))


def _v_reorder(suffix: str, a, cfg: Qwen35Config, outer: int, inner: int):
    """The v-head permutation of one linear-attention tensor (converter order: before
    the other transforms; conv1d already squeezed to [C, K])."""
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


def from_hf_tensors(hf: Mapping[str, np.ndarray], cfg: Qwen35Config) -> dict[str, np.ndarray]:
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
    missing = [n for n in tensor_shapes(cfg) if n not in out]
    if missing:
        back = {v: k for k, v in HF_GLOBAL.items()}
        g = missing[0]
        hfn = back.get(g) or "model.layers.{}.{}".format(
            g.split(".")[1], {v: k for k, v in HF_TO_GGUF.items()}[g.split(".", 2)[2]])
        raise ModelFileError(f"checkpoint lacks tensor {hfn}")
    check_tensors(out, cfg, "checkpoint")
    return out


def to_hf_tensors(gg: Mapping[str, np.ndarray], cfg: Qwen35Config) -> dict[str, np.ndarray]:
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


def dense_layers(gg: Mapping[str, np.ndarray], cfg: Qwen35Config):
    """GGUF-layout float tensors → (globals, per-layer dicts) for worker/arch/qwen35_ops:
    matrices transposed to the dense [in, out] that linear.matmul multiplies, the rest as is.
    Keys drop the `blk.N.` prefix and the `.weight`/`.bias` suffix."""
    check_tensors(gg, cfg)

    def key(suffix):
        return suffix.rsplit(".", 1)[0] if suffix.endswith((".weight", ".bias")) else suffix

    def prep(suffix, a):
        a = np.asarray(a, dtype=np.float32)
        mat = a.ndim == 2 and suffix not in ("ssm_conv1d.weight", "token_embd.weight")
        return np.ascontiguousarray(a.T) if mat else a

    layers = []
    for i in range(cfg.n_layers):
        layers.append({key(s): prep(s, gg[f"blk.{i}.{s}"]) for s in layer_shapes(cfg, i)})
    embed = np.asarray(gg["token_embd.weight"], dtype=np.float32)                 # [V, D]
    head = np.asarray(gg["output.weight" if "output.weight" in gg and not cfg.tied_embeddings
                         else "token_embd.weight"], dtype=np.float32)
    glob = {"token_embd": embed, "output_norm": np.asarray(gg["output_norm.weight"], np.float32),
            "output": np.ascontiguousarray(head.T)}                                # [D, V]
    return glob, layers
