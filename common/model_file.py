"""Model-file metadata: what a model is, read without touching its weights.

Both sides need this: the frontend to know a model's context, vocabulary and
chat template; the worker to shape its forward. Two formats are understood:
a GGUF file (llama.cpp's format, read through the `gguf` package) and a
Hugging Face folder (`config.json`, `*.safetensors`, `tokenizer.json`).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

import gguf

from .arch import BASE_FIELDS, HF_ARCH, REQUIRED, SUPPORTED_ARCHS, Family, family
from .arch.stack import Block, RopeScaling
from .gguf_file import TruncatedFile, open_gguf, open_gguf_cached
from .regular_file import NotRegularFile, check_model_folder, require_regular

log = logging.getLogger(__name__)

__all__ = ["ModelConfig", "ModelFileError", "RopeScaling", "SUPPORTED_ARCHS", "HF_ARCH",
           "read_config", "open_model_file"]


class ModelFileError(ValueError):
    """The file is missing, unreadable, or describes a model we cannot run."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shapes and constants of one decoder-only model, and its layer stack.

    The attention fields are those of the family's attention layers; `blocks` (one
    common/arch/stack.Block per layer, from the family) is what the forward runs;
    `params` holds the family's own fields (common/arch/<family>.py).
    """

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
    blocks: tuple[Block, ...] = ()
    embed_scale: float = 1.0   # the embedding's multiplier (Gemma: sqrt(d_model))
    params: dict = field(default_factory=dict, compare=False)
    pooling_type: int = 0      # GGUF {arch}.pooling_type: 1 mean, 3 last (embedding models)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def family(self) -> Family:
        return family(self.arch)

    def kv_bytes_per_token(self, itemsize: float = 4) -> int:
        """Sequence-state bytes that grow with each position (attention KV), all layers."""
        return sum(b.mixer.bytes_per_token(itemsize) for b in self.blocks)

    def fixed_bytes_per_slot(self) -> int:
        """Sequence-state bytes of a slot whatever its length (recurrent layers)."""
        return sum(b.mixer.bytes_per_slot() for b in self.blocks)

    def state_bytes(self, n_slots: int, ctx: int, itemsize: float = 4) -> int:
        """What `n_slots` slots of `ctx` positions take on a die."""
        return n_slots * (ctx * self.kv_bytes_per_token(itemsize) + self.fixed_bytes_per_slot())


def field_value(reader: gguf.GGUFReader, key: str, default=None):
    """One scalar or string metadata value of a GGUF file (arrays: use contents())."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def read_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a `.gguf` file or a Hugging Face model folder."""
    return open_model_file(path, cached=True)[0]


def open_model_file(path: str | Path, cached: bool = False):
    """(ModelConfig, the open GGUF reader or None for a folder): a loader reads the
    tensors through the same reader (parsing a 151k-token vocabulary costs ~0.9 s).
    `cached`: the reader parsed once per process (for metadata reads; see gguf_file)."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"model not found: {path}")
    try:                          # stat only: a FIFO or a device is never opened
        check_model_folder(path) if path.is_dir() else require_regular(path)
    except NotRegularFile as exc:
        raise ModelFileError(str(exc)) from None
    if path.is_dir():
        return config_from_hf(path), None
    try:
        reader = (open_gguf_cached if cached else open_gguf)(path)
    except TruncatedFile as exc:
        raise ModelFileError(f"{path}: {exc}") from exc
    except Exception as exc:  # gguf raises ValueError, struct.error, ...
        raise ModelFileError(f"{path} is not a readable GGUF file: {exc}") from exc
    return config_from_gguf(reader, name=path.stem), reader


def read_fields(fields, fmt: str, lookup, where, values: dict) -> dict:
    """Each field's value from `lookup(key)` (None: absent), defaults applied; `where(key)`
    names a key in an error."""
    for f in fields:
        keys = f.gguf if fmt == "gguf" else f.hf
        keys = () if keys is None else (keys,) if isinstance(keys, str) else keys
        raw = next((v for v in map(lookup, keys) if v is not None), None)
        default = f.hf_default if fmt == "hf" and f.hf_default is not REQUIRED else f.default
        if raw is None:
            if default is REQUIRED:
                raise ModelFileError(f"{where(keys[0])} is missing" if keys else
                                     f"config field {f.name} is missing")
            raw = default(values) if callable(default) else default
            values[f.name] = raw
            continue
        try:
            values[f.name] = f.cast(raw)
        except (TypeError, ValueError) as exc:
            raise ModelFileError(f"{where(keys[0])} = {raw!r} is not valid: {exc}") from exc
    return values


def build_config(fam: Family, fmt: str, values: dict, lookup, where, **fixed) -> ModelConfig:
    """ModelConfig from the base values, the family's fields and its stack; bad sizes are
    load errors naming the field."""
    values = read_fields(fam.fields, fmt, lookup, where, values)
    if fam.configure is not None:
        values.update(fam.configure(values, fmt, lookup))
    for name in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                 "vocab_size", "context_length"):
        if int(values[name]) < 1:
            raise ModelFileError(f"config field {name} = {values[name]} must be positive")
    if values["n_heads"] % values["n_kv_heads"]:
        raise ModelFileError(f"config: n_heads {values['n_heads']} is not a multiple of "
                             f"n_kv_heads {values['n_kv_heads']}")
    base = {f.name for f in BASE_FIELDS} | {"rope_theta", "rope_scaling"}
    cfg = ModelConfig(arch=fam.name, fmt=fmt, **{k: v for k, v in values.items() if k in base},
                      **fixed, params={k: v for k, v in values.items() if k not in base})
    cfg = replace(cfg, blocks=tuple(fam.blocks(cfg)),
                  embed_scale=fam.embed_scale(cfg) if fam.embed_scale else 1.0)
    if len(cfg.blocks) != cfg.n_layers:
        raise ModelFileError(f"{fam.name}: {len(cfg.blocks)} layer specs for "
                             f"{cfg.n_layers} layers")
    return cfg


def config_from_gguf(reader: gguf.GGUFReader, name: str = "") -> ModelConfig:
    arch = field_value(reader, "general.architecture")
    if arch is None:
        raise ModelFileError("GGUF file has no general.architecture")
    fam = family(arch)
    tensors = {t.name: t for t in reader.tensors}
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise ModelFileError("GGUF file lacks tensor token_embd.weight")

    def lookup(key):
        return field_value(reader, f"{arch}.{key}")

    def where(key):
        return f"GGUF key {arch}.{key}"
    values = read_fields(BASE_FIELDS, "gguf", lookup, where,
                         {"embedding_rows": int(embd.shape[1])})
    del values["embedding_rows"]
    scaling = None
    kind = lookup("rope.scaling.type")
    factor = lookup("rope.scaling.factor")
    if kind == "linear" and factor:
        scaling = RopeScaling("linear", float(factor))
    elif kind not in (None, "none", "linear"):
        log.warning("rope scaling %r is not applied; fine within the original context", kind)
    values.update(rope_theta=float(lookup("rope.freq_base") or 10000.0), rope_scaling=scaling)
    return build_config(fam, "gguf", values, lookup, where, name=name,
                        tied_embeddings="output.weight" not in tensors,
                        qkv_bias="blk.0.attn_q.bias" in tensors,
                        qk_norm="blk.0.attn_q_norm.weight" in tensors)


def hf_rope(params: dict, default_theta: float = 10000.0) -> tuple[float, RopeScaling | None]:
    """rope theta and scaling from a config.json's rope dict (transformers 4 or 5 spelling)."""
    theta = float(params.get("rope_theta", default_theta))
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
                             f"{', '.join(HF_ARCH)}")
    fam = family(HF_ARCH[model_type])
    if fam.hf_config is not None:
        cfg = fam.hf_config(cfg)

    def where(key):
        return f"config.json field {key!r}"
    values = read_fields(BASE_FIELDS, "hf", cfg.get, where, {})
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    values["rope_theta"], values["rope_scaling"] = hf_rope(
        {"rope_theta": cfg.get("rope_theta", 10000.0), **params})
    return build_config(fam, "hf", values, cfg.get, where, name=folder.name,
                        tied_embeddings=bool(cfg.get("tie_word_embeddings", fam.hf_tied)),
                        qkv_bias=bool(cfg.get("attention_bias", fam.hf_qkv_bias)),
                        qk_norm=fam.hf_qk_norm)


def check_tensors(cfg: ModelConfig, tensors) -> None:
    """Refuse a model whose tensors (name, type, shape) lack one the stack needs or contradict
    the config, naming the tensor: checked before any upload (the worker's loader checks
    again as it reads)."""
    from .arch.stack import expected_tensors
    fam = cfg.family
    have = {(fam.hf_name(n) if cfg.fmt == "hf" else n): tuple(shape) for n, _, shape in tensors}
    want = expected_tensors(cfg)
    for name, shape in want.items():
        if name not in have:
            raise ModelFileError(f"{'checkpoint' if cfg.fmt == 'hf' else 'GGUF file'} lacks "
                                 f"tensor {name}, which the {cfg.arch} config needs")
        if have[name] != shape:
            raise ModelFileError(f"tensor {name} has shape {list(have[name])}, but the config "
                                 f"implies {list(shape)}")
    head = have.get("output.weight")
    if head is not None and head != want["token_embd.weight"]:
        raise ModelFileError(f"tensor output.weight has shape {list(head)}, but the config "
                             f"implies {list(want['token_embd.weight'])}")
