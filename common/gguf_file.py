"""Opening GGUF files quickly.

`gguf.GGUFReader` slices a NumPy memmap twice per array element while it
parses metadata, which costs ~3 s for SmolLM2's 49k tokens + 49k merges (and
~4x that for a 128k-token vocabulary). `GGUFFile` parses array fields in one
pass instead, ~10x faster, with the same fields (same parts, data indices and
types), so every user of the package's reader API keeps working. The parts of a
string array (a vocabulary, its merges) are made when first read: a worker, which
never reads the tokenizer's fields, skips them (Qwen2.5's 151k tokens + 151k merges:
606k array views, ~2.5 s of a 4.4 s load on a Zen 3).
"""
from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField

from .regular_file import require_regular


class TruncatedFile(ValueError):
    """A tensor's bytes run past the end of the file (a download or copy cut short)."""


def open_gguf(path: str | Path) -> "GGUFFile":
    """A read-only, memory-mapped GGUF file; a FIFO or a device is refused unopened."""
    require_regular(path)
    return GGUFFile(path, "r")


def open_gguf_cached(path: str | Path) -> "GGUFFile":
    """open_gguf, parsed once per process while the file is unchanged: opening a model
    reads its metadata for the config, the tokenizer and the tensor list (~0.5 s each for
    SmolLM2's vocabulary). Callers only read what it returns."""
    st = require_regular(path)
    return _cached(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


def forget_cached() -> None:
    """Drop the parsed files of open_gguf_cached (a worker, after an unload: a large
    vocabulary's fields hold tens of MB)."""
    _cached.cache_clear()


@functools.lru_cache(maxsize=8)
def _cached(path: str, size: int, mtime_ns: int) -> "GGUFFile":
    return open_gguf(path)


class GGUFFile(GGUFReader):
    """A GGUFReader whose array fields are plain `frombuffer` views.

    Overrides a private method of the package; other byte orders and nested
    arrays fall back to the stock code (a test compares both readers' fields).
    """

    def _get_field_parts(self, orig_offs, raw_type):
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        buf = memoryview(self.data)
        itype, count = struct.unpack_from("<IQ", buf, orig_offs)
        parts = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
        offs = orig_offs + 12
        if itype == GGUFValueType.STRING:
            starts, lengths = np.empty(count, np.int64), np.empty(count, np.int64)
            for i in range(count):                  # each string: u64 length, bytes
                (n,) = struct.unpack_from("<Q", buf, offs)
                starts[i], lengths[i] = offs, n
                offs += 8 + n
            types = [GGUFValueType.ARRAY, GGUFValueType.STRING]
            return (offs - orig_offs, StringParts(parts, buf, starts, lengths),
                    list(range(3, 2 + 2 * count, 2)), types)
        dtype = self.gguf_scalar_to_np.get(GGUFValueType(itype))
        if dtype is None:
            return super()._get_field_parts(orig_offs, raw_type)
        items = np.frombuffer(buf, dtype, count, offs).reshape(-1, 1)  # [count, 1] views
        types = [GGUFValueType.ARRAY, GGUFValueType(itype)]
        return 12 + items.nbytes, parts + list(items), list(range(2, 2 + count)), types

    def _build_tensors(self, start_offs: int, fields: list[ReaderField]) -> None:
        """The package's tensors, after checking that each one's bytes lie in the file
        (the package would fail on a cut file with "cannot reshape array ...")."""
        spans = []                                # (name, offset, bytes) of each tensor
        for field in fields:
            _, name, _, dims, raw_type, offset = field.parts
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
            except (ValueError, KeyError):
                continue                          # the package names an unknown type
            spans.append((bytes(name).decode(errors="replace"), start_offs + int(offset[0]),
                          int(np.prod(dims, dtype=np.int64)) * type_size // block))
        size, end = len(self.data), max((o + n for _, o, n in spans), default=0)
        if end > size:
            name, start, n = next(t for t in spans if t[1] + t[2] > size)
            raise TruncatedFile(f"the file is truncated: it has {size:,} bytes and its "
                                f"tensors need {end:,}; tensor {name} needs {n:,} bytes at "
                                f"offset {start:,}, of which the file holds {max(0, size - start):,}")
        super()._build_tensors(start_offs, fields)

    def _build_fields(self, offs: int, count: int) -> int:
        """The package's loop, keeping a string array's parts lazy (`StringParts`)."""
        for _ in range(count):
            orig_offs = offs
            kv_klen, kv_kdata = self._get_str(offs)
            offs += int(kv_klen.nbytes + kv_kdata.nbytes)
            raw_kv_type = self._get(offs, np.uint32)
            offs += int(raw_kv_type.nbytes)
            head = [kv_klen, kv_kdata, raw_kv_type]
            size, parts, idxs, types = self._get_field_parts(offs, raw_kv_type[0])
            if isinstance(parts, StringParts):
                parts.head[:0] = head
            else:
                parts = head + parts
            self._push_field(ReaderField(orig_offs, str(bytes(kv_kdata), encoding="utf-8"),
                                         parts, [i + len(head) for i in idxs], types),
                             skip_sum=True)
            offs += size
        return offs


class StringParts(Sequence):
    """A string array field's parts as the package lays them out (its head: key length,
    key, type, item type, count; then each string's u64 length and bytes), each made
    from the file's buffer when it is read."""

    def __init__(self, head: list, buf, starts: np.ndarray, lengths: np.ndarray):
        self.head, self.buf, self.starts, self.lengths = head, buf, starts, lengths

    def __len__(self) -> int:
        return len(self.head) + 2 * len(self.starts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        if i < len(self.head):
            return self.head[i]
        k, text = divmod(i - len(self.head), 2)
        start = int(self.starts[k])
        if text:
            return np.frombuffer(self.buf, np.uint8, int(self.lengths[k]), start + 8)
        return np.frombuffer(self.buf, np.uint64, 1, start)
