"""KV cache element types: what `--kv-cache`, `--kv-cache-k` / `--kv-cache-v`, the admin
load body's `kv_cache` and the Load message name, and the bytes each takes.

A quantized type holds a row of `head_dim` elements as blocks of 32 along the head
dimension, each an fp16 scale then the values, exactly llama.cpp's block layout:
- q8_0: 34 bytes per 32 (scale d, 32 int8: x = d * q);
- q4_0: 18 bytes per 32 (scale d, 16 bytes: element j in the low nibble of byte j,
  element j + 16 in its high nibble; x = d * (nibble - 8)).
Keys and values are quantized once, when written; the attention kernels read the blocks
where they are stored. The frontend counts a replica's KV with the same functions the
worker sizes its caches with, so the two always agree.
"""
from __future__ import annotations

from dataclasses import dataclass

from .model_file import ModelFileError

# type: (bytes per block, elements per block)
KV_TYPES = {"f32": (4, 1), "f16": (2, 1), "q8_0": (34, 32), "q4_0": (18, 32)}
KV_TYPE_NAMES = tuple(KV_TYPES)
QUANTIZED = ("q8_0", "q4_0")
BLOCK = 32


class KVUnreadable(ModelFileError):
    """A model whose heads a die cannot hold or read in the asked KV type (a q8_0 / q4_0
    head without whole blocks, a head longer than the GPU attention reads): a load
    error the admin API answers 400 (bad_model_file), never a crashed worker."""


def element_bytes(kind: str) -> float:
    """Bytes per cached element (a dyadic fraction: products with head_dim stay exact)."""
    nbytes, elements = KV_TYPES[kind]
    return nbytes / elements


def row_bytes(kind: str, head_dim: int) -> int:
    """Bytes of one head's key or value row of `head_dim` elements."""
    nbytes, elements = KV_TYPES[kind]
    return head_dim // elements * nbytes


def check_type(value, what: str = "kv_cache") -> str:
    """A type name as given (any case) → its canonical name; ValueError with the choices."""
    name = value.strip().lower() if isinstance(value, str) else value
    if name not in KV_TYPES:
        raise ValueError(f"{what} must be one of {', '.join(KV_TYPE_NAMES)}, not {value!r}")
    return name


@dataclass(frozen=True, slots=True)
class KVCacheTypes:
    """The types asked for keys and values; "" leaves the die's default (fp32 on a CPU,
    fp16 on a GPU, fp32 in the exact mode `--quantize none`)."""
    k: str = ""
    v: str = ""

    @classmethod
    def of(cls, both: str | None = None, k: str | None = None, v: str | None = None,
           what: str = "kv_cache") -> "KVCacheTypes":
        """`both` for keys and values, `k` / `v` overriding it for one of them."""
        both = check_type(both, what) if both else ""
        return cls(k=check_type(k, what + "_k") if k else both,
                   v=check_type(v, what + "_v") if v else both)

    def over(self, default: "KVCacheTypes") -> "KVCacheTypes":
        """These types, `default`'s where one is not set (a load's own over the server's)."""
        return KVCacheTypes(k=self.k or default.k, v=self.v or default.v)

    def __str__(self) -> str:
        if self.k == self.v:
            return self.k or "default"
        return f"k {self.k or 'default'}, v {self.v or 'default'}"

    def held(self, die_kind: str, exact: bool, f16_readable: bool) -> tuple[str, str]:
        """(k, v) types a die holds for this request: a quantized type as asked on every
        die; otherwise the exact mode fp32, a GPU fp16, a CPU fp32 unless f16 is asked
        and `f16_readable` (weights held in a block or 16-bit format)."""
        return self._held(self.k, die_kind, exact, f16_readable), \
            self._held(self.v, die_kind, exact, f16_readable)

    @staticmethod
    def _held(kind: str, die_kind: str, exact: bool, f16_readable: bool) -> str:
        if kind in QUANTIZED:
            return kind
        if exact:
            return "f32"
        if die_kind != "cpu":
            return "f16"
        return "f16" if kind == "f16" and f16_readable else "f32"


def pair_bytes(k: str, v: str) -> float:
    """Mean bytes per element of a key and a value (a layer's KV per position is
    2 * n_kv_heads * head_dim times this)."""
    return (element_bytes(k) + element_bytes(v)) / 2
