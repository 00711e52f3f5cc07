"""Model-file metadata: what a model is, read without touching its weights.

Both sides need this: the frontend to know a model's context, vocabulary and
chat template; the worker to shape its forward. Two formats are understood:
a GGUF file (llama.cpp's format, read through the `gguf` package) and a
Hugging Face folder (`config.json`, `*.safetensors`, `tokenizer.json`).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import gguf

from .gguf_file import open_gguf

log = logging.getLogger(__name__)

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")
# Hugging Face `model_type`s that run on one of our architectures unchanged.
HF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


class ModelFileError(ValueError):
    """The file is missing, unreadable, or describes a model we cannot run."""


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
class ModelConfig:
    """The shapes and constants of one decoder-only transformer."""

    arch: str                  # one of SUPPORTED_ARCHS
    fmt: str                   # "gguf" | "hf"
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    context_length: int        # trained context
    rms_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tied_embeddings: bool      # output head shares the embedding matrix
    qkv_bias: bool             # qwen2
    qk_norm: bool              # qwen3
    name: str = ""

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def kv_bytes_per_token(self, itemsize: int = 4) -> int:
        return 2 * self.n_layers * self.kv_dim * itemsize


def check_arch(arch: str) -> str:
    if arch not in SUPPORTED_ARCHS:
        raise ModelFileError(f"unsupported model architecture {arch!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHS)}")
    return arch


def field_value(reader: gguf.GGUFReader, key: str, default=None):
    """One scalar or string metadata value of a GGUF file (arrays: use contents())."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def read_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a `.gguf` file or a Hugging Face model folder."""
    return open_model_file(path)[0]


def open_model_file(path: str | Path):
    """(ModelConfig, the open GGUF reader or None for a folder): a loader reads the
    tensors through the same reader (parsing a 151k-token vocabulary costs ~0.9 s)."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"model not found: {path}")
    if path.is_dir():
        return config_from_hf(path), None
    try:
        reader = open_gguf(path)
    except Exception as exc:  # gguf raises ValueError, struct.error, ...
        raise ModelFileError(f"{path} is not a readable GGUF file: {exc}") from exc
    return config_from_gguf(reader, name=path.stem), reader


def config_from_gguf(reader: gguf.GGUFReader, name: str = "") -> ModelConfig:
    arch = field_value(reader, "general.architecture")
    if arch is None:
        raise ModelFileError("GGUF file has no general.architecture")
    check_arch(arch)

    def get(key, default=None):
        value = field_value(reader, f"{arch}.{key}", default)
        if value is None:
            raise ModelFileError(f"GGUF file lacks {arch}.{key}")
        return value

    tensors = {t.name for t in reader.tensors}
    d_model = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    head_dim = int(field_value(reader, f"{arch}.attention.key_length", d_model // n_heads))
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab = int(field_value(reader, f"{arch}.vocab_size", int(embd.shape[1])))
    scaling = None
    kind = field_value(reader, f"{arch}.rope.scaling.type")
    factor = field_value(reader, f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor:
        scaling = RopeScaling("linear", float(factor))
    elif kind not in (None, "none", "linear"):
        log.warning("rope scaling %r is not applied; fine within the original context", kind)
    return ModelConfig(
        arch=arch, fmt="gguf", name=name,
        n_layers=int(get("block_count")),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(field_value(reader, f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        d_ff=int(get("feed_forward_length")),
        vocab_size=vocab,
        context_length=int(get("context_length")),
        rms_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(field_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        tied_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
    )


def hf_rope(cfg: dict) -> tuple[float, RopeScaling | None]:
    """rope theta and scaling from a config.json (transformers 4 or 5 spelling)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3", float(params["factor"]),
            float(params.get("low_freq_factor", 1.0)),
            float(params.get("high_freq_factor", 4.0)),
            int(params.get("original_max_position_embeddings", 8192)))
    raise ModelFileError(f"unsupported rope scaling {kind!r}; supported: linear, llama3")


def config_from_hf(folder: Path) -> ModelConfig:
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise ModelFileError(f"{folder} has no config.json (not a Hugging Face model folder)")
    cfg = json.loads(cfg_path.read_text())
    model_type = cfg.get("model_type", "")
    if model_type not in HF_ARCH:
        raise ModelFileError(f"unsupported model architecture {model_type!r}; supported: "
                             f"{', '.join(sorted(HF_ARCH))}")
    arch = HF_ARCH[model_type]
    n_heads = int(cfg["num_attention_heads"])
    d_model = int(cfg["hidden_size"])
    theta, scaling = hf_rope(cfg)
    return ModelConfig(
        arch=arch, fmt="hf", name=folder.name,
        n_layers=int(cfg["num_hidden_layers"]),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or d_model // n_heads),
        d_ff=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        context_length=int(cfg.get("max_position_embeddings", 4096)),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
        qk_norm=arch == "qwen3",
    )
