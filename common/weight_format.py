"""How each stored tensor type is held in memory, and what that costs: shared by the
worker (which repacks, worker/qmatrix.py) and the frontend (which admits a replica
on a die before any upload, from the file's tensor list alone).
"""
from __future__ import annotations

import json
from pathlib import Path

from . import settings
from .regular_file import require_regular

QUANTIZE_MODES = ("auto", "none", "q8_0", "q4")   # `auto`: as stored (the default)

# GGUF / safetensors type → (in-memory kind, block size, has a per-block min)
IN_MEMORY = {
    "Q8_0": ("q8", 32, False), "Q4_0": ("q4", 32, True), "Q4_1": ("q4", 32, True),
    "Q5_0": ("q8", 32, False), "Q5_1": ("q8", 32, True), "Q4_K": ("q4k", 256, False),
    "Q5_K": ("q5k", 256, False), "Q6_K": ("q6k", 256, False), "Q3_K": ("q3k", 256, False),
    "Q2_K": ("q2k", 256, False),
    "F16": ("f16", 32, False), "BF16": ("bf16", 32, False),
}
QUANTIZED_AT_LOAD = {"q8_0": ("q8", 32, False), "q4": ("q4", 32, True)}
# what a GPU holds instead of the CPU's file-layout kinds (worker/qmatrix.py QMatrix.to)
ON_GPU = {"Q4_K": ("q4", 32, True), "Q5_K": ("q8", 32, True), "Q6_K": ("q8", 16, False),
          "Q3_K": ("q8", 16, False), "Q2_K": ("q8", 16, True)}
# a super-block of 256 as the file has it
K_BYTES = {"q2k": 84, "q3k": 110, "q4k": 144, "q5k": 176, "q6k": 210}


def kind_bytes(kind: str, bs: int, has_min: bool, elements: int) -> int:
    """Bytes of a matrix of `elements` weights held as `kind` (fp16 scales, mins)."""
    if kind in K_BYTES:
        return elements // 256 * K_BYTES[kind]
    per = {"q4": 0.5, "q8": 1.0, "f16": 2.0, "bf16": 2.0, "f32": 4.0}[kind]
    scales = 0 if kind in ("f16", "bf16", "f32") else (2 + 2 * has_min) * elements // bs
    return int(elements * per) + scales


def held_as(type_name: str, shape: tuple[int, ...], quantize: str,
            dense_itemsize: int = 4) -> int:
    """Bytes a tensor of `type_name` and `shape` takes on the die under `quantize`."""
    elements = 1
    for n in shape:
        elements *= int(n)
    if len(shape) != 2 or quantize == "none" or shape[-1] % 32:
        return elements * (4 if len(shape) != 2 else dense_itemsize)
    if type_name in ("F32", "F16", "BF16") and quantize in QUANTIZED_AT_LOAD:
        return kind_bytes(*QUANTIZED_AT_LOAD[quantize], elements)
    if type_name == "F32":
        return elements * 4
    if type_name not in IN_MEMORY:
        return elements * 4           # the load will refuse it; never under-count
    if dense_itemsize != 4 and type_name in ON_GPU:  # a GPU die (dense weights in fp16)
        return kind_bytes(*ON_GPU[type_name], elements)
    return kind_bytes(*IN_MEMORY[type_name], elements)


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


READABLE = frozenset(IN_MEMORY) | {"F32"}


def unreadable(path: str | Path) -> tuple[str, str] | None:
    """(tensor, type) of the first tensor no loader here can hold, or None."""
    for name, kind, _ in tensor_list(path):
        if kind not in READABLE:
            return name, kind
    return None
