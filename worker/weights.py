"""Weights of one model on one die, read tensor by tensor.

A GGUF file is memory-mapped and each tensor is dequantized on its own (on a
GPU die the quantized bytes are uploaded and dequantized there), so no
transient copy of the whole model ever exists. Hugging Face folders are read
from their `.safetensors` files the same way.

Layout: every matrix is stored transposed, [in, out], so a projection is the
plain product x @ W (measured: OpenBLAS runs skinny products faster this way
than with a transposed operand), and the projections that read the same input
are fused into one matrix (q|k|v and gate|up) so that a layer costs four
matmuls instead of seven. A tied output head is stored once, as [D, V], and
the embedding lookup reads its columns.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..common.gguf_file import open_gguf
from ..common.model_file import ModelConfig, ModelFileError
from .device import Device
from .quants import dequantize

# Hugging Face parameter names → GGUF names (our canonical names).
HF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
HF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


@dataclass
class Layer:
    attn_norm: object       # [D]
    wqkv: object            # [D, q_dim + 2 kv_dim]
    bqkv: object | None     # [q_dim + 2 kv_dim]            (qwen2)
    q_norm: object | None   # [head_dim]                     (qwen3)
    k_norm: object | None   # [head_dim]
    wo: object              # [q_dim, D]
    ffn_norm: object        # [D]
    w_gate_up: object       # [D, 2 d_ff]
    w_down: object          # [d_ff, D]


@dataclass
class Weights:
    embed: object | None    # [V, D]; None when tied to the head
    layers: list[Layer]
    out_norm: object        # [D]
    head: object            # [D, V]
    inv_freq: object        # [head_dim / 2] float32 rotary frequencies

    def embed_rows(self, tokens):
        """Embeddings of `tokens` [T] → [T, D] float32."""
        rows = self.head[:, tokens].T if self.embed is None else self.embed[tokens]
        return rows.astype(np.float32)

    def nbytes(self) -> int:
        arrays = [self.head, self.out_norm] + ([] if self.embed is None else [self.embed])
        for layer in self.layers:
            arrays += [a for a in vars(layer).values() if a is not None]
        return sum(int(a.nbytes) for a in arrays)


class GGUFSource:
    """Tensors of a GGUF file, dequantized one at a time on the device."""

    def __init__(self, path: Path, cfg: ModelConfig):
        self.reader = open_gguf(path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.cfg = cfg

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self.tensors[name].shape))

    def get(self, name: str, device: Device, dtype=np.float32):
        t = self.tensors.get(name)
        if t is None:
            raise ModelFileError(f"GGUF file lacks tensor {name}")
        shape = tuple(int(n) for n in reversed(t.shape))   # GGUF lists ne innermost-first
        raw = np.asarray(t.data).reshape(-1).view(np.uint8)
        if device.xp is not np:
            raw = device.xp.asarray(raw)
        out = dequantize(raw, t.tensor_type, shape, xp=device.xp, out_dtype=dtype)
        if self.cfg.arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = self.cfg.n_heads if "attn_q" in name else self.cfg.n_kv_heads
            out = unpermute_rows(out, heads, device.xp)
        return out


def unpermute_rows(w, n_heads: int, xp):
    """Undo llama.cpp's q/k row order (interleaved rotary pairs → halves).

    convert_hf_to_gguf.py reorders each head's rows from [x0..x31, y0..y31]
    to [x0, y0, x1, y1, ...]; we use the Hugging Face (rotate-half) order.
    """
    rows, cols = w.shape
    half = rows // n_heads // 2
    return xp.ascontiguousarray(w.reshape(n_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols))


class SafetensorsSource:
    """Tensors of a Hugging Face folder's `*.safetensors` files.

    The format (8-byte header size, JSON header, raw little-endian data) is
    read directly with a memory map: the `safetensors` package cannot give
    bfloat16 tensors to NumPy, and most checkpoints are bfloat16.
    """

    DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}

    def __init__(self, folder: Path):
        self.index: dict[str, tuple[np.memmap, dict]] = {}
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ModelFileError(f"{folder} holds no .safetensors files")
        for file in files:
            with open(file, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(size))
            data = np.memmap(file, dtype=np.uint8, mode="r", offset=8 + size)
            for name, info in header.items():
                if name != "__metadata__":
                    self.index[HF_NAMES.get(name) or hf_layer_name(name)] = (data, info)

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.index[name][1]["shape"])

    def get(self, name: str, device: Device, dtype=np.float32):
        if name not in self.index:
            raise ModelFileError(f"checkpoint lacks tensor {name}")
        data, info = self.index[name]
        if info["dtype"] not in self.DTYPES:
            raise ModelFileError(f"tensor {name}: unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        arr = data[start:end].view(self.DTYPES[info["dtype"]]).reshape(info["shape"])
        if info["dtype"] == "BF16":   # bfloat16 is the top half of a float32
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        return device.xp.asarray(arr).astype(dtype, copy=False)


def hf_layer_name(name: str) -> str:
    parts = name.split(".")
    if len(parts) >= 5 and parts[0] == "model" and parts[1] == "layers":
        module = ".".join(parts[3:-1])
        if module in HF_LAYER_NAMES:
            return f"blk.{parts[2]}.{HF_LAYER_NAMES[module]}.{parts[-1]}"
    return name


def transposed(xp, source, names: list[str], device: Device, dtype):
    """[out, in] tensors side by side as one [in, sum(out)] matrix (1-D: concatenated).

    Each tensor is read, placed and dropped before the next is read, so the
    transient is one tensor, never the whole group twice.
    """
    first = source.get(names[0], device, dtype)
    widths = [first.shape[0]] + [source.shape(n)[0] for n in names[1:]]
    out = xp.empty(first.shape[1:] + (sum(widths),), dtype=dtype)
    col = 0
    for name, width in zip(names, widths):
        part = first if col == 0 else source.get(name, device, dtype)
        out[..., col:col + width] = part.T
        col += width
    return out


def rope_inv_freq(cfg: ModelConfig, factors: np.ndarray | None = None) -> np.ndarray:
    """Rotary inverse frequencies [head_dim / 2], float32, scaling applied.

    `factors` is a GGUF `rope_freqs` tensor (llama.cpp divides each frequency
    by it); otherwise the config's scaling rule is computed here.
    """
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    s = cfg.rope_scaling
    if factors is not None:
        inv = inv / factors.astype(np.float64)
    elif s is not None and s.kind == "linear":
        inv = inv / s.factor
    elif s is not None and s.kind == "llama3":
        low_wavelen = s.original_context / s.low_freq_factor
        high_wavelen = s.original_context / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (s.original_context / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor)
        blended = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, blended, scaled)
    return inv.astype(np.float32)


def open_source(path: Path, cfg: ModelConfig):
    return SafetensorsSource(path) if path.is_dir() else GGUFSource(path, cfg)


def load_weights(path: str | Path, cfg: ModelConfig, device: Device, progress=None) -> Weights:
    """Read, dequantize and place every tensor; `progress(done, total)` per layer."""
    xp, wdt = device.xp, device.weight_dtype
    src = open_source(Path(path), cfg)

    def norm(name):  # norms and biases stay fp32: they are tiny and precision-sensitive
        return src.get(name, device, np.float32)

    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        qkv = [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]
        layers.append(Layer(
            attn_norm=norm(p + "attn_norm.weight"),
            wqkv=transposed(xp, src, qkv, device, wdt),
            bqkv=(transposed(xp, src, [n.replace("weight", "bias") for n in qkv], device,
                             np.float32) if cfg.qkv_bias else None),
            q_norm=norm(p + "attn_q_norm.weight") if cfg.qk_norm else None,
            k_norm=norm(p + "attn_k_norm.weight") if cfg.qk_norm else None,
            wo=transposed(xp, src, [p + "attn_output.weight"], device, wdt),
            ffn_norm=norm(p + "ffn_norm.weight"),
            w_gate_up=transposed(xp, src, [p + "ffn_gate.weight", p + "ffn_up.weight"],
                                 device, wdt),
            w_down=transposed(xp, src, [p + "ffn_down.weight"], device, wdt),
        ))
        if progress:
            progress(i + 1, cfg.n_layers)
    tied = cfg.tied_embeddings or "output.weight" not in src
    head = transposed(xp, src, ["token_embd.weight" if tied else "output.weight"], device, wdt)
    embed = None if tied else src.get("token_embd.weight", device, wdt)
    factors = None
    if "rope_freqs.weight" in src:
        factors = device.to_host(src.get("rope_freqs.weight", device, np.float32))
    inv_freq = xp.asarray(rope_inv_freq(cfg, factors))
    return Weights(embed=embed, layers=layers, out_norm=norm("output_norm.weight"),
                   head=head, inv_freq=inv_freq)
