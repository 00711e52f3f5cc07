"""Weights of one model on one die, read tensor by tensor.

A GGUF file is memory-mapped and read one tensor at a time, so no transient
copy of the whole model ever exists. Hugging Face folders are read from their
`.safetensors` files the same way. Two ways to hold a matrix:

- quantized (the default, `quantize` "auto", "q8_0" or "q4"): a QMatrix
  (worker/qmatrix.py) in the file's own block format, repacked; float tensors
  stay 16-bit (or fp32), or are quantized at load when asked. Row-major
  [out, in]; the projections that read the same input are row-stacked into
  one matrix (q|k|v and gate|up) when their formats agree, else kept as a
  list whose outputs are concatenated.
- dense fp32 (`quantize` "none", the exact reference; fp16 on a GPU that
  computes fp16 at speed): every matrix transposed, [in, out], so a projection
  is the plain product x @ W (measured: OpenBLAS runs skinny products faster
  this way than with a transposed operand), fused as above.

A tied output head is stored once and the embedding lookup reads its rows
(quantized) or columns (dense).
"""
from __future__ import annotations

import json
import math
import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..common.gguf_file import open_gguf
from ..common.model_file import ModelConfig, ModelFileError
from . import qmatrix as qm
from .device import Device
from .qmatrix import QMatrix
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
    # a projection is a dense [in, out] array, a QMatrix [out, in], or a list of them
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
    embed: object | None    # [V, D] (dense or QMatrix); None when tied to the head
    layers: list[Layer]
    out_norm: object        # [D]
    head: object            # dense [D, V], or QMatrix [V, D]
    inv_freq: object        # [head_dim / 2] float32 rotary frequencies

    def embed_rows(self, tokens):
        """Embeddings of `tokens` [T] → [T, D] float32."""
        table = self.head if self.embed is None else self.embed
        if isinstance(table, QMatrix):
            from .linear import gather_rows
            return gather_rows(table, tokens)
        rows = table[:, tokens].T if self.embed is None else table[tokens]
        return rows.astype(np.float32)

    def nbytes(self) -> int:
        """Bytes the weights really take on the die."""
        items = [self.head, self.out_norm, self.inv_freq] + ([] if self.embed is None
                                                              else [self.embed])
        for layer in self.layers:
            items += [a for a in vars(layer).values() if a is not None]
        return sum(nbytes(a) for a in items)

    def formats(self) -> dict[str, int]:
        """Matrices by in-memory kind (and file type), for the record."""
        out: dict[str, int] = {}
        for item in [self.head] + ([self.embed] if self.embed is not None else []) + [
                a for layer in self.layers for a in (layer.wqkv, layer.wo, layer.w_gate_up,
                                                     layer.w_down)]:
            for m in item if isinstance(item, list) else [item]:
                key = f"{m.kind}<{m.source}" if isinstance(m, QMatrix) else str(m.dtype)
                out[key] = out.get(key, 0) + 1
        return out


def nbytes(item) -> int:
    if isinstance(item, list):
        return sum(nbytes(i) for i in item)
    return item.nbytes() if isinstance(item, QMatrix) else int(item.nbytes)


class GGUFSource:
    """Tensors of a GGUF file, dequantized one at a time on the device."""

    def __init__(self, path: Path, cfg: ModelConfig, reader=None):
        self.reader = reader if reader is not None else open_gguf(path)
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

    def qmatrix(self, name: str, mode: str):
        """Matrix `name` held as the mode asks: a QMatrix (host arrays), or None where
        it stays a dense float matrix (F32 as stored, a row not made of blocks)."""
        t = self.tensors.get(name)
        if t is None:
            raise ModelFileError(f"GGUF file lacks tensor {name}")
        shape = tuple(int(n) for n in reversed(t.shape))
        if len(shape) != 2:
            raise ModelFileError(f"tensor {name} has shape {shape}, not a matrix")
        qtype = qm.QT(t.tensor_type)
        raw = np.asarray(t.data).reshape(-1).view(np.uint8)
        if qtype in qm.FLOATS:
            if mode in ("q8_0", "q4") and shape[1] % 32 == 0:
                m = qm.quantize(dequantize(raw, qtype, shape), mode, qtype.name)
            elif qtype == qm.QT.F32 or shape[1] % 32:
                return None
            else:
                m = qm.from_gguf(raw, qtype, shape, name)
        else:
            m = qm.from_gguf(raw, qtype, shape, name)
        if self.cfg.arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = self.cfg.n_heads if "attn_q" in name else self.cfg.n_kv_heads
            m = m.take_rows(unpermute_rows(np.arange(shape[0])[:, None], heads, np)[:, 0])
        self.release(t)
        return m

    def release(self, t) -> None:
        """Drop the file pages of a tensor already repacked from this process's memory
        (they stay in the page cache): the load's peak RSS is the weights, not the file
        plus the weights."""
        mm = getattr(self.reader.data, "_mmap", None)
        if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = int(t.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE
        end = int(t.data_offset) + int(t.n_bytes)
        try:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):
            pass


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

    def qmatrix(self, name: str, mode: str):
        """As GGUFSource.qmatrix: BF16 and F16 stay 16-bit, F32 stays dense, unless the
        mode quantizes them."""
        if name not in self.index:
            raise ModelFileError(f"checkpoint lacks tensor {name}")
        data, info = self.index[name]
        shape = tuple(info["shape"])
        if len(shape) != 2 or shape[1] % 32:
            return None
        if mode in ("q8_0", "q4"):
            host = Device("cpu", -1, np, "cpu", np.float32)
            return qm.quantize(self.get(name, host), mode, info["dtype"])
        if info["dtype"] == "F32":
            return None
        start, end = info["data_offsets"]
        bits = np.array(data[start:end].view(np.uint16).reshape(shape))
        return QMatrix("bf16" if info["dtype"] == "BF16" else "f16", *shape, bits,
                       source=info["dtype"])


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


def open_source(path: Path, cfg: ModelConfig, reader=None):
    return SafetensorsSource(path) if path.is_dir() else GGUFSource(path, cfg, reader)


def load_weights(path: str | Path, cfg: ModelConfig, device: Device, progress=None,
                 quantize: str = "auto", reader=None) -> Weights:
    """Read and place every tensor; `progress(done, total)` per layer.

    quantize: "auto" (GGUF blocks as stored, floats as stored), "q8_0" / "q4" (floats
    quantized at load), "none" (everything dequantized to dense fp32: the reference)."""
    if quantize not in qm.QUANTIZE_MODES:
        raise ValueError(f"quantize must be one of {', '.join(qm.QUANTIZE_MODES)}, "
                         f"not {quantize!r}")
    xp, wdt = device.xp, device.weight_dtype
    src = open_source(Path(path), cfg, reader)

    def norm(name):  # norms and biases stay fp32: they are tiny and precision-sensitive
        return src.get(name, device, np.float32)

    def proj(names: list[str]):
        """One projection from the tensors `names` (row-stacked outputs)."""
        if quantize != "none":
            parts = [src.qmatrix(n, quantize) for n in names]
            if all(p is not None for p in parts):
                parts = [qm.stack(parts)] if qm.stackable(parts) else parts
                parts = [p.to(xp) if xp is not np else p for p in parts]
                return parts[0] if len(parts) == 1 else parts
        return transposed(xp, src, names, device, wdt)       # dense: [in, sum(out)]

    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        qkv = [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]
        layers.append(Layer(
            attn_norm=norm(p + "attn_norm.weight"),
            wqkv=proj(qkv),
            bqkv=(transposed(xp, src, [n.replace("weight", "bias") for n in qkv], device,
                             np.float32) if cfg.qkv_bias else None),
            q_norm=norm(p + "attn_q_norm.weight") if cfg.qk_norm else None,
            k_norm=norm(p + "attn_k_norm.weight") if cfg.qk_norm else None,
            wo=proj([p + "attn_output.weight"]),
            ffn_norm=norm(p + "ffn_norm.weight"),
            w_gate_up=proj([p + "ffn_gate.weight", p + "ffn_up.weight"]),
            w_down=proj([p + "ffn_down.weight"]),
        ))
        if progress:
            progress(i + 1, cfg.n_layers)
    tied = cfg.tied_embeddings or "output.weight" not in src
    head = proj(["token_embd.weight" if tied else "output.weight"])   # one tensor: no list
    if tied:
        embed = None
    elif quantize != "none":
        embed = proj(["token_embd.weight"])
        if not isinstance(embed, QMatrix):                     # dense: rows are tokens
            embed = xp.ascontiguousarray(embed.T)
    else:
        embed = src.get("token_embd.weight", device, wdt)
    factors = None
    if "rope_freqs.weight" in src:
        factors = device.to_host(src.get("rope_freqs.weight", device, np.float32))
    inv_freq = xp.asarray(rope_inv_freq(cfg, factors))
    return Weights(embed=embed, layers=layers, out_norm=norm("output_norm.weight"),
                   head=head, inv_freq=inv_freq)
