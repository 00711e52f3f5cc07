"""What a model file's weights cost on a die, from its tensor list alone (the frontend
admits a replica on a die before any upload); the cost of each stored type is its
record in common/formats.py.
"""
from __future__ import annotations

import json
from pathlib import Path

from .formats import FORMATS, QUANTIZED_AT_LOAD, kind_bytes
from .kv_cache import KVCacheTypes, pair_bytes
from .regular_file import require_regular

QUANTIZE_MODES = ("auto", "none", "q8_0", "q4")   # `auto`: as stored (the default)


def held_as(type_name: str, shape: tuple[int, ...], quantize: str,
            dense_itemsize: int = 4) -> int:
    """Bytes a tensor of `type_name` and `shape` takes on the die under `quantize`
    (`dense_itemsize` 2: a GPU die, whose dense weights are fp16)."""
    elements = 1
    for n in shape:
        elements *= int(n)
    if len(shape) != 2 or quantize == "none" or shape[-1] % 32:
        return elements * (4 if len(shape) != 2 else dense_itemsize)
    if type_name in ("F32", "F16", "BF16") and quantize in QUANTIZED_AT_LOAD:
        return kind_bytes(QUANTIZED_AT_LOAD[quantize], elements)
    if type_name == "F32":
        return elements * 4
    if type_name not in FORMATS:
        return elements * 4           # the load will refuse it; never under-count
    return FORMATS[type_name].held_bytes(elements, gpu=dense_itemsize != 4)


def tensor_list(path: str | Path) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, type, shape as rows-major) of every tensor of a GGUF file or HF folder."""
    path = Path(path)
    if path.is_dir():
        out = []
        for file in sorted(path.glob("*.safetensors")):
            require_regular(file)
            with open(file, "rb") as fh:
                head = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(head))
            tensors = {k: v for k, v in header.items() if k != "__metadata__"}
            check_safetensors_size(file, 8 + head, tensors)
            out += [(name, info["dtype"], tuple(info["shape"])) for name, info in tensors.items()]
        return out
    from .gguf_file import open_gguf_cached
    reader = open_gguf_cached(path)
    return [(t.name, t.tensor_type.name, tuple(int(n) for n in reversed(t.shape)))
            for t in reader.tensors]


def check_safetensors_size(file: Path, data_start: int, tensors: dict) -> None:
    """Refuse a `.safetensors` file cut short, naming the first tensor it lacks bytes of."""
    from .model_file import ModelFileError
    size = file.stat().st_size
    end = data_start + max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
    if end > size:
        name, info = next((k, v) for k, v in tensors.items()
                          if data_start + int(v["data_offsets"][1]) > size)
        start, stop = (data_start + int(x) for x in info["data_offsets"])
        raise ModelFileError(f"{file}: the file is truncated: it has {size:,} bytes and its "
                             f"tensors need {end:,}; tensor {name} needs {stop - start:,} bytes "
                             f"at offset {start:,}, of which the file holds {max(0, size - start):,}")


def weight_bytes(path: str | Path, quantize: str = "auto", dense_itemsize: int = 4) -> int:
    """What the weights of the model at `path` will take on a die, before loading it."""
    return sum(held_as(kind, shape, quantize, dense_itemsize)
               for _, kind, shape in tensor_list(path))


def kv_types(path: str | Path, die_kind: str, quantize: str = "auto",
             kv: KVCacheTypes = KVCacheTypes()) -> tuple[str, str]:
    """(k, v) element types the KV cache of the model at `path` is held in on a die of
    `die_kind` (common/kv_cache.KVCacheTypes.held): q8_0 / q4_0 as asked on every die;
    else the exact mode (`quantize` none) fp32, a GPU fp16 (whatever its weights: a K80's
    are fp32), a CPU fp32 unless f16 is asked and the weights are held in a block or
    16-bit format (a file of F32 matrices held as they are keeps fp32)."""
    def f16_readable() -> bool:
        if quantize in QUANTIZED_AT_LOAD:
            return True
        held = [kind for _, kind, shape in tensor_list(path)
                if len(shape) == 2 and shape[-1] % 32 == 0]
        return any(kind != "F32" for kind in held)
    wants_f16 = die_kind == "cpu" and quantize != "none" and "f16" in (kv.k, kv.v)
    return kv.held(die_kind, quantize == "none", wants_f16 and f16_readable())


def kv_itemsize(path: str | Path, die_kind: str, quantize: str = "auto",
                kv: KVCacheTypes = KVCacheTypes()) -> float:
    """Mean bytes per cached key or value element (common/kv_cache.pair_bytes): what
    ModelConfig.kv_bytes_per_token is given on both sides of the wire."""
    return pair_bytes(*kv_types(path, die_kind, quantize, kv))


READABLE = frozenset(FORMATS)


def unreadable(path: str | Path) -> tuple[str, str] | None:
    """(tensor, type) of the first tensor no loader here can hold, or None."""
    for name, kind, _ in tensor_list(path):
        if kind not in READABLE:
            return name, kind
    return None
