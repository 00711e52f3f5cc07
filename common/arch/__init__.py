"""The architecture registry: one module per model family, nothing about a family elsewhere.

A family module (common/arch/llama.py, qwen2.py, qwen3.py, gemma3.py, qwen35.py) defines
FAMILY:
- its config fields beyond BASE_FIELDS: where each lives in a GGUF file
  (`{arch}.` + key) and in a Hugging Face config.json, and its default;
- its tensor names: Hugging Face parameter names inside a layer → the GGUF names
  the loader reads (ours are llama.cpp's), and the transforms between the two
  (llama.cpp's q/k row order, norms stored as w or as 1 + w);
- its layer stack: `blocks(cfg)` → one stack.Block per layer.
The frontend reads configs and sizes states from the stack (common/ only); the
worker builds each block's layers from their specs (worker/layers/). Adding a
family is a module here and a test; a new kind of mixer is one module in
worker/layers/ as well. The forward's loop never names a family.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

REQUIRED = object()


@dataclass(frozen=True, slots=True)
class Field:
    """One config value: `gguf` is the key after "{arch}.", `hf` one or more config.json
    keys (the first present wins); None where a format does not carry it. `default`
    is a value or a callable of the values read so far; REQUIRED makes its absence a
    load error naming the key."""

    name: str
    gguf: str | None
    hf: str | tuple[str, ...] | None
    default: object = REQUIRED
    cast: Callable = int
    hf_default: object = REQUIRED         # REQUIRED here: the same as `default`


BASE_FIELDS: tuple[Field, ...] = (
    Field("n_layers", "block_count", "num_hidden_layers"),
    Field("d_model", "embedding_length", "hidden_size"),
    Field("n_heads", "attention.head_count", "num_attention_heads"),
    Field("n_kv_heads", "attention.head_count_kv", "num_key_value_heads",
          lambda v: v["n_heads"]),
    Field("head_dim", "attention.key_length", "head_dim",
          lambda v: v["d_model"] // v["n_heads"]),
    Field("d_ff", "feed_forward_length", "intermediate_size"),
    Field("vocab_size", "vocab_size", "vocab_size", lambda v: v["embedding_rows"]),
    Field("context_length", "context_length", "max_position_embeddings", hf_default=4096),
    Field("rms_eps", "attention.layer_norm_rms_epsilon", "rms_norm_eps", cast=float,
          hf_default=1e-6),
    # llama.cpp's embedding pooling (0 none, 1 mean, 2 cls, 3 last); a folder says none
    Field("pooling_type", "pooling_type", None, default=0),
)

# Parameter names outside the layers, every family (Hugging Face → GGUF).
HF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# Inside a layer, llama-style families (HF module path → GGUF name).
LLAMA_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


@dataclass(frozen=True)
class Family:
    name: str                              # GGUF general.architecture
    hf_model_types: tuple[str, ...]        # config.json model_type values it runs
    blocks: Callable                       # ModelConfig → tuple[stack.Block, ...]
    fields: tuple[Field, ...] = ()         # beyond BASE_FIELDS, read into cfg.params
    hf_layer_names: dict = field(default_factory=lambda: dict(LLAMA_LAYER_NAMES))
    hf_qkv_bias: bool = False              # attention_bias's default in config.json
    hf_qk_norm: bool = False
    hf_tied: bool = False                  # tie_word_embeddings's default in config.json
    gguf_qk_interleaved: bool = False      # llama.cpp permuted q/k rows (llama only)
    # added to a norm weight on load, per format: a (1 + w) norm stored as w
    norm_offset: dict = field(default_factory=dict)
    embed_scale: Callable | None = None    # ModelConfig → the embedding's multiplier
    configure: Callable | None = None      # (values, fmt, raw) → more values (rope, ...)
    rename: Callable | None = None         # HF name → GGUF name or None, instead of the tables
    hf_config: Callable | None = None      # config.json dict → the dict the fields read
                                           # (a multimodal wrapper's text_config)

    def hf_name(self, name: str) -> str:
        """A Hugging Face parameter name → the GGUF name (unknown names pass through)."""
        if self.rename is not None:
            return self.rename(name) or name
        if name in HF_GLOBAL_NAMES:
            return HF_GLOBAL_NAMES[name]
        parts = name.split(".")
        if len(parts) >= 5 and parts[0] == "model" and parts[1] == "layers":
            module = ".".join(parts[3:-1])
            if module in self.hf_layer_names:
                return f"blk.{parts[2]}.{self.hf_layer_names[module]}.{parts[-1]}"
        return name


def _families() -> dict[str, Family]:
    from . import gemma3, llama, qwen2, qwen3, qwen35
    return {m.FAMILY.name: m.FAMILY for m in (llama, qwen2, qwen3, gemma3, qwen35)}


FAMILIES: dict[str, Family] = _families()
SUPPORTED_ARCHS = tuple(FAMILIES)
HF_ARCH = {t: f.name for f in FAMILIES.values() for t in f.hf_model_types}


def family(arch: str) -> Family:
    from ..model_file import ModelFileError
    if arch not in FAMILIES:
        raise ModelFileError(f"unsupported model architecture {arch!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHS)}")
    return FAMILIES[arch]
