"""The ctypes declarations of the CPU kernels, read from their C header (worker/kernels/pantheon.h).

ctypes converts arguments by the declared argtypes and, without them, passes a Python int
as a C int: an int64_t parameter left undeclared is silently cut to 32 bits. So the
declarations are not written by hand but read from the header the C side compiles
against (every definition there must match its prototype, or the unity build fails):
each `pn_*` prototype gives a function's argument and return types, each
`typedef struct Name { ... } Name;` a ctypes Structure with the same fields.

The header keeps to what this small reader knows: the scalar types of SCALARS, pointers
(any `T *`, passed as addresses), fixed arrays (`T *name[3]`) and structs declared
earlier in the file (a field of struct type is nested, as in C).
"""
from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass, field

SCALARS = {"int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64,
           "uint8_t": ctypes.c_uint8, "uint16_t": ctypes.c_uint16, "int16_t": ctypes.c_int16,
           "float": ctypes.c_float, "double": ctypes.c_double}
_STRUCT = re.compile(r"typedef\s+struct\s+(\w+)\s*\{(.*?)\}\s*(\w+)\s*;", re.S)
_PROTOTYPE = re.compile(r"\s*([A-Za-z_][\w\s\*]*?)\b(pn_\w+)\s*\(([^)]*)\)\s*", re.S)
_DECLARATOR = re.compile(r"^(\**)\s*(\w+)\s*(?:\[(\d+)\])?$")


class HeaderError(ValueError):
    """The header holds a declaration this reader does not know how to turn into ctypes."""


@dataclass
class Header:
    """name → (restype, [argtypes]) of every pn_* prototype, and name → Structure."""
    functions: dict = field(default_factory=dict)
    structs: dict = field(default_factory=dict)


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return re.sub(r"^\s*#[^\n]*", " ", text, flags=re.M)     # preprocessor lines


def _base(words: str, structs: dict):
    """A declaration's type without its declarator: a ctypes type, None for void."""
    names = [w for w in words.split() if w not in ("const", "struct", "restrict", "volatile")]
    if len(names) != 1:
        raise HeaderError(f"a type this reader does not know: {words!r}")
    name = names[0]
    if name == "void":
        return None
    if name in SCALARS:
        return SCALARS[name]
    if name in structs:
        return structs[name]
    raise HeaderError(f"a type this reader does not know: {words!r}")


def _param(decl: str, structs: dict):
    decl = decl.strip()
    if "*" in decl:
        return ctypes.c_void_p
    parts = decl.split()
    # a parameter is "type name": drop the name (a lone type, as in prototypes without names, stays)
    base = " ".join(parts[:-1]) if len(parts) > 1 and parts[-1] not in SCALARS else decl
    kind = _base(base, structs)
    if kind is None:
        raise HeaderError(f"a void parameter: {decl!r}")
    return kind


def _fields(body: str, structs: dict) -> list:
    out = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        head = re.match(r"^((?:const\s+|struct\s+|unsigned\s+)*\w+)\s*(.*)$", decl, re.S)
        if not head:
            raise HeaderError(f"a field this reader does not know: {decl!r}")
        base_words, rest = head.groups()
        for part in rest.split(","):
            m = _DECLARATOR.match(part.strip())
            if not m:
                raise HeaderError(f"a field this reader does not know: {decl!r}")
            stars, name, count = m.groups()
            kind = ctypes.c_void_p if stars else _base(base_words, structs)
            if kind is None:
                raise HeaderError(f"a void field: {decl!r}")
            out.append((name, kind * int(count) if count else kind))
    return out


def read(text: str) -> Header:
    """The header's structs (as ctypes Structures, in order) and pn_* prototypes."""
    text = _strip_comments(text)
    header = Header()
    for tag, body, name in _STRUCT.findall(text):
        cls = type(name, (ctypes.Structure,), {"_fields_": _fields(body, header.structs)})
        header.structs[name] = cls
        if tag != name:
            header.structs[tag] = cls
    for piece in _STRUCT.sub(";", text).split(";"):
        m = _PROTOTYPE.fullmatch(piece)
        if not m:
            if "pn_" in piece:
                raise HeaderError(f"a declaration this reader does not know: {piece.strip()!r}")
            continue
        ret, name, params = m.groups()
        params = " ".join(params.split())
        args = [] if params in ("", "void") else [_param(p, header.structs)
                                                   for p in params.split(",")]
        restype = ctypes.c_void_p if "*" in ret else _base(ret, header.structs)
        if name in header.functions:
            raise HeaderError(f"{name} is declared twice")
        header.functions[name] = (restype, args)
    return header


def declare(lib, header: Header) -> None:
    """Set argtypes and restype of every function of the header on a loaded library."""
    for name, (restype, args) in header.functions.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = restype
