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

from ..common.arch.stack import Rope
from ..common.formats import FORMATS
from ..common.gguf_file import open_gguf
from ..common.model_file import ModelConfig, ModelFileError
from ..common.regular_file import require_regular
from ..common.weight_format import QUANTIZE_MODES, check_safetensors_size
from . import matrices as qm
from .device import Device
from .qmatrix import QMatrix
from .quants import dequantize


@dataclass
class BlockWeights:
    """One layer's weights: its mixer's and MLP's (worker/layers/) and the norms around."""

    mixer_norm: object               # [D] attn_norm
    mixer: object                    # the mixer kind's weights dataclass
    mlp_norm: object                 # [D] ffn_norm (the block spec's mlp_norm)
    mlp: object                      # MLPWeights
    post_mixer_norm: object = None   # [D] post_attention_norm (sandwich blocks)
    post_mlp_norm: object = None     # [D] post_ffw_norm


@dataclass
class Weights:
    embed: object | None    # [V, D] (dense or QMatrix); None when tied to the head
    blocks: list[BlockWeights]
    out_norm: object        # [D]
    head: object | None     # dense [D, V], or QMatrix [V, D]; None on a split replica's
                            # second stage (the first holds the embedding and the head)
    rope_factors: object | None = None   # host [r/2]: a GGUF rope_freqs tensor (llama3)

    def embed_rows(self, tokens):
        """Embeddings of `tokens` [T] → [T, D] float32."""
        table = self.head if self.embed is None else self.embed
        if table is None:
            raise RuntimeError("a split replica's second stage holds no embedding")
        if isinstance(table, QMatrix):
            from .linear import gather_rows
            return gather_rows(table, tokens)
        rows = table[:, tokens].T if self.embed is None else table[tokens]
        return rows.astype(np.float32)

    def matrices(self) -> list:
        """Every projection (a dense array, a QMatrix or a list of them), head first."""
        out = [m for m in (self.head, self.embed) if m is not None]
        for b in self.blocks:
            for part in (b.mixer, b.mlp):
                out += [getattr(part, name) for name in part.MATRICES]
        return out

    def forward_matrices(self) -> list:
        """The projections in the order a forward multiplies by them: each layer's, then
        the head (the embedding is a lookup)."""
        out = []
        for b in self.blocks:
            for part in (b.mixer, b.mlp):
                out += [getattr(part, name) for name in part.MATRICES]
        return out + ([] if self.head is None else [self.head])

    def nbytes(self) -> int:
        """Bytes the weights really take on the die."""
        items = [m for m in (self.head, self.out_norm, self.embed) if m is not None]
        for b in self.blocks:
            items += [a for a in vars(b).values() if a is not None and not is_part(a)]
            items += [a for part in (b.mixer, b.mlp) for a in vars(part).values()
                      if a is not None]
        return sum(nbytes(a) for a in items)

    def formats(self) -> dict[str, int]:
        """Matrices by in-memory kind (and file type), for the record."""
        out: dict[str, int] = {}
        for item in self.matrices():
            for m in item if isinstance(item, list) else [item]:
                key = f"{m.kind}<{m.source}" if isinstance(m, QMatrix) else str(m.dtype)
                out[key] = out.get(key, 0) + 1
        return out


def is_part(a) -> bool:
    return hasattr(a, "MATRICES")


def nbytes(item) -> int:
    if isinstance(item, list):
        return sum(nbytes(i) for i in item)
    return item.nbytes() if isinstance(item, QMatrix) else int(item.nbytes)


SCAN_BYTES = 1 << 24                     # a float tensor is scanned in pieces of this


def check_finite(name: str, raw: np.ndarray, type_name: str) -> None:
    """Refuse a tensor (its bytes as stored) holding NaN or Inf, naming it: such weights
    load, then poison every logit. Float tensors are scanned whole; quantized ones by the
    high byte of each fp16 field (exponent all ones: NaN or Inf), a strided read of a few
    bytes per block (SmolLM2's file: about 10 ms)."""
    raw = raw.reshape(-1).view(np.uint8)
    fmt = FORMATS.get(type_name)
    if fmt is not None and fmt.fp16_fields:
        size = fmt.block_bytes
        blocks = raw[:raw.size // size * size].reshape(-1, size)
        for off in fmt.fp16_fields:
            bad = np.flatnonzero((blocks[:, off + 1] & 0x7C) == 0x7C)
            if bad.size:
                raise ModelFileError(f"tensor {name} holds NaN or Inf (the scale of its "
                                     f"{type_name} block {bad[0]}): the file is corrupt")
        return
    item = {"F32": 4, "F16": 2, "BF16": 2}.get(type_name)
    if item is None:
        return
    step = SCAN_BYTES // item * item
    for start in range(0, raw.size, step):
        part = raw[start:start + step]
        if type_name == "F32":
            bad = np.flatnonzero(~np.isfinite(part.view(np.float32)))
        else:                                    # the exponent's bits all ones
            mask = 0x7C00 if type_name == "F16" else 0x7F80
            bad = np.flatnonzero((part.view(np.uint16) & mask) == mask)
        if bad.size:
            raise ModelFileError(f"tensor {name} holds NaN or Inf (element "
                                 f"{start // item + bad[0]}): the file is corrupt")


class GGUFSource:
    """Tensors of a GGUF file, dequantized one at a time on the device."""

    def __init__(self, path: Path, cfg: ModelConfig, reader=None):
        self.reader = reader if reader is not None else open_gguf(path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.cfg = cfg

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.tensors:
            raise ModelFileError(f"GGUF file lacks tensor {name}")
        return tuple(int(n) for n in reversed(self.tensors[name].shape))

    def interleaved(self, name: str) -> int:
        """Heads whose q/k rows llama.cpp interleaved (0: none)."""
        if not self.cfg.family.gguf_qk_interleaved:
            return 0
        if name.endswith("attn_q.weight"):
            return self.cfg.n_heads
        return self.cfg.n_kv_heads if name.endswith("attn_k.weight") else 0

    def get(self, name: str, device: Device, dtype=np.float32):
        t = self.tensors.get(name)
        if t is None:
            raise ModelFileError(f"GGUF file lacks tensor {name}")
        shape = tuple(int(n) for n in reversed(t.shape))   # GGUF lists ne innermost-first
        raw = np.asarray(t.data).reshape(-1).view(np.uint8)
        check_finite(name, raw, t.tensor_type.name)
        if device.xp is not np:
            raw = device.xp.asarray(raw)
        out = dequantize(raw, t.tensor_type, shape, xp=device.xp, out_dtype=dtype)
        if heads := self.interleaved(name):
            out = unpermute_rows(out, heads, device.xp)
        return out

    def qmatrix(self, name: str, mode: str, copy: bool = True):
        """Matrix `name` held as the mode asks: a QMatrix (host arrays), or None where
        it stays a dense float matrix (F32 as stored, a row not made of blocks). With
        `copy` False a kind held as the file stores it may still view the file's pages
        (for a caller that copies it anyway: a row stack)."""
        t = self.tensors.get(name)
        if t is None:
            raise ModelFileError(f"GGUF file lacks tensor {name}")
        shape = tuple(int(n) for n in reversed(t.shape))
        if len(shape) != 2:
            raise ModelFileError(f"tensor {name} has shape {shape}, not a matrix")
        qtype = qm.QT(t.tensor_type)
        raw = np.asarray(t.data).reshape(-1).view(np.uint8)
        check_finite(name, raw, qtype.name)
        if qtype in qm.FLOATS:
            if mode in ("q8_0", "q4") and shape[1] % 32 == 0:
                m = qm.quantize(dequantize(raw, qtype, shape), mode, qtype.name)
            elif qtype == qm.QT.F32 or shape[1] % 32:
                return None
            else:
                m = qm.from_gguf(raw, qtype, shape, name)
        else:
            m = qm.from_gguf(raw, qtype, shape, name, copy=copy)
        if heads := self.interleaved(name):
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

    def __init__(self, folder: Path, cfg: ModelConfig):
        self.index: dict[str, tuple[np.memmap, dict]] = {}
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ModelFileError(f"{folder} holds no .safetensors files")
        for file in files:
            require_regular(file)                  # a FIFO would block the open for ever
            with open(file, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(size))
            check_safetensors_size(file, 8 + size, {k: v for k, v in header.items()
                                                    if k != "__metadata__"})
            data = np.memmap(file, dtype=np.uint8, mode="r", offset=8 + size)
            for name, info in header.items():
                if name != "__metadata__":
                    self.index[cfg.family.hf_name(name)] = (data, info)

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.index:
            raise ModelFileError(f"checkpoint lacks tensor {name}")
        return tuple(self.index[name][1]["shape"])

    def get(self, name: str, device: Device, dtype=np.float32):
        if name not in self.index:
            raise ModelFileError(f"checkpoint lacks tensor {name}")
        data, info = self.index[name]
        if info["dtype"] not in self.DTYPES:
            raise ModelFileError(f"tensor {name}: unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        check_finite(name, data[start:end], info["dtype"])
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
        check_finite(name, data[start:end], info["dtype"])
        bits = np.array(data[start:end].view(np.uint16).reshape(shape))
        return QMatrix("bf16" if info["dtype"] == "BF16" else "f16", *shape, bits,
                       source=info["dtype"])


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


def rope_inv_freq(rope: Rope, factors: np.ndarray | None = None) -> np.ndarray:
    """Rotary inverse frequencies [rope.dim / 2], float32, scaling applied.

    `factors` is a GGUF `rope_freqs` tensor (llama.cpp divides each frequency
    by it); otherwise the spec's scaling rule is computed here.
    """
    dim = rope.dim
    inv = 1.0 / (rope.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    s = rope.scaling
    if factors is not None:
        if factors.shape != inv.shape:
            raise ModelFileError(f"tensor rope_freqs.weight has {factors.shape[0]} factors; "
                                 f"rotary dimension {dim} needs {inv.shape[0]}")
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
    return SafetensorsSource(path, cfg) if path.is_dir() else GGUFSource(path, cfg, reader)


class Loader:
    """What a layer reads its tensors through: shapes checked against the config, norms
    and biases fp32 on the die, projections held as `quantize` asks."""

    def __init__(self, src, cfg: ModelConfig, device: Device, quantize: str):
        self.src, self.cfg, self.device, self.quantize = src, cfg, device, quantize
        self.norm_offset = cfg.family.norm_offset.get(cfg.fmt, 0.0)

    def check(self, name: str, want: tuple[int, ...]) -> None:
        got = self.src.shape(name)
        if tuple(got) != tuple(want):
            raise ModelFileError(f"tensor {name} has shape {list(got)}, but the config "
                                 f"({self.cfg.arch}: d_model {self.cfg.d_model}, heads "
                                 f"{self.cfg.n_heads}/{self.cfg.n_kv_heads} x "
                                 f"{self.cfg.head_dim}, d_ff {self.cfg.d_ff}, vocab "
                                 f"{self.cfg.vocab_size}) implies {list(want)}")

    def norm(self, name: str, dim: int, family_norm: bool = True):
        """A norm weight [dim] fp32; a family's (1 + w) norm stored as w gets its 1 here
        (family_norm False: a norm that is plain w in every format)."""
        self.check(name, (dim,))
        w = self.src.get(name, self.device, np.float32)
        if family_norm and self.norm_offset:
            w = w + np.float32(self.norm_offset)
        return w

    def array(self, name: str, shape: tuple[int, ...]):
        """Any other tensor (a convolution kernel, a decay vector) as it is stored, fp32
        on the die: a family's transforms apply to it after."""
        self.check(name, shape)
        return self.src.get(name, self.device, np.float32)

    def vector(self, names: list[str], dims: list[int]):
        """1-D tensors (biases) [sum(dims)] fp32, concatenated."""
        for name, dim in zip(names, dims):
            self.check(name, (dim,))
        return transposed(self.device.xp, self.src, names, self.device, np.float32)

    def proj(self, names: list[str], shapes: list[tuple[int, int]]):
        """One projection from the [out, in] tensors `names` (row-stacked outputs)."""
        for name, shape in zip(names, shapes):
            self.check(name, shape)
        xp = self.device.xp
        if self.quantize != "none":
            # parts that will be row-stacked are copied once, by the stack
            parts = [self.src.qmatrix(n, self.quantize, copy=len(names) == 1)
                     if isinstance(self.src, GGUFSource) else self.src.qmatrix(n, self.quantize)
                     for n in names]
            if all(p is not None for p in parts):
                parts = [qm.stack(parts)] if qm.stackable(parts) else [qm.owned(p) for p in parts]
                if isinstance(self.src, GGUFSource) and len(names) > 1:
                    for n in names:         # the copies read the file's pages back in
                        self.src.release(self.src.tensors[n])
                parts = [qm.to_die(p, xp) if xp is not np else p for p in parts]
                return parts[0] if len(parts) == 1 else parts
        return transposed(xp, self.src, names, self.device, self.device.weight_dtype)


def load_weights(path: str | Path, cfg: ModelConfig, device: Device, progress=None,
                 quantize: str = "auto", reader=None,
                 layers: tuple[int, int] | None = None) -> Weights:
    """Read and place every tensor, layer by layer as the config's stack says;
    `progress(done, total)` per layer.

    quantize: "auto" (GGUF blocks as stored, floats as stored), "q8_0" / "q4" (floats
    quantized at load), "none" (everything dequantized to dense fp32: the reference).
    layers: (lo, hi) to hold only those blocks (a stage of a replica split across dies);
    the embedding and the head are held where the layers start at 0 (the first stage,
    which samples), the output norm everywhere."""
    from .layers import MIXERS, load_mlp
    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_MODES)}, "
                         f"not {quantize!r}")
    xp, d = device.xp, cfg.d_model
    src = open_source(Path(path), cfg, reader)
    ld = Loader(src, cfg, device, quantize)
    blocks = []
    lo, hi = layers or (0, cfg.n_layers)
    for i, spec in enumerate(cfg.blocks):
        if not lo <= i < hi:
            continue
        p = f"blk.{i}."
        if spec.mixer.kind not in MIXERS:
            raise ModelFileError(f"layer {i}: no implementation of mixer {spec.mixer.kind!r}")
        blocks.append(BlockWeights(
            mixer_norm=ld.norm(p + "attn_norm.weight", d),
            mixer=MIXERS[spec.mixer.kind].load(ld, p, spec.mixer, d),
            mlp_norm=ld.norm(p + f"{spec.mlp_norm}.weight", d),
            mlp=load_mlp(ld, p, spec.mlp, d),
            post_mixer_norm=ld.norm(p + "post_attention_norm.weight", d) if spec.sandwich else None,
            post_mlp_norm=ld.norm(p + "post_ffw_norm.weight", d) if spec.sandwich else None))
        if progress:
            progress(i + 1 - lo, hi - lo)
    tied = cfg.tied_embeddings or "output.weight" not in src
    vd = (cfg.vocab_size, d)
    head = embed = None                           # a later stage holds neither
    if lo == 0:
        head = ld.proj(["token_embd.weight" if tied else "output.weight"], [vd])  # one: no list
    if lo == 0 and not tied and quantize != "none":
        embed = ld.proj(["token_embd.weight"], [vd])
        if not isinstance(embed, QMatrix):                         # dense: rows are tokens
            embed = xp.ascontiguousarray(embed.T)
    elif lo == 0 and not tied:
        ld.check("token_embd.weight", vd)
        embed = src.get("token_embd.weight", device, device.weight_dtype)
    factors = None
    if "rope_freqs.weight" in src:
        factors = device.to_host(src.get("rope_freqs.weight", device, np.float32))
    return Weights(embed=embed, blocks=blocks, out_norm=ld.norm("output_norm.weight", d),
                   head=head, rope_factors=factors)
