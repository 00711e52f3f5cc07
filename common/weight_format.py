"""What a model file's weights cost on a die, from its tensor list alone (the frontend
admits a replica on a die before any upload); the cost of each stored type is its
record in common/formats.py.
"""
from __future__ import annotations

import json
from pathlib import Path

from . import settings
from .formats import FORMATS, QUANTIZED_AT_LOAD, kind_bytes
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


def kv_itemsize(path: str | Path, die_kind: str, quantize: str = "auto") -> int:
    """Bytes per cached key or value element: the exact mode (`quantize` none) keeps fp32
    on every die; otherwise fp16 on a GPU (whatever its weights: a K80's are fp32); on a
    CPU fp32 unless `--kv-cache f16` (settings.kv_cache) asks for fp16 and the weights are
    held in a block or 16-bit format (the C attention widens each row as it reads it); a
    file of F32 matrices held as they are keeps fp32."""
    if quantize == "none":
        return 4
    if die_kind != "cpu":
        return 2
    if settings.kv_cache() == "f32":
        return 4
    if quantize in QUANTIZED_AT_LOAD:
        return 2
    held = [kind for _, kind, shape in tensor_list(path) if len(shape) == 2 and shape[-1] % 32 == 0]
    return 2 if any(kind != "F32" for kind in held) else 4


READABLE = frozenset(FORMATS)


def unreadable(path: str | Path) -> tuple[str, str] | None:
    """(tensor, type) of the first tensor no loader here can hold, or None."""
    for name, kind, _ in tensor_list(path):
        if kind not in READABLE:
            return name, kind
    return None
