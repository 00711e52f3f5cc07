"""The ctypes declarations of worker/kernels_cpu.py against kernels.c's own signatures.

ctypes converts arguments by the declared argtypes, and without them passes a Python int
as a C int: an int64_t parameter left undeclared is silently cut to 32 bits. So every
exported `pn_*` function the Python side calls must be declared, exactly as kernels.c
defines it (every definition of a name, in each build branch, must agree), and a
function returning something other than int or void must say so."""
import ctypes
import re
from pathlib import Path

import pytest

from pantheon.worker import kernels_cpu as kc

ROOT = Path(kc.__file__).resolve().parent
SOURCE = "".join(p.read_text() for p in kc.SOURCES)
DEFINITION = re.compile(r"^(?!static)([A-Za-z_][\w \t\*]*?)\b(pn_\w+)\(([^)]*)\)\s*\{",
                        re.MULTILINE)
SCALARS = {"int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64,
           "float": ctypes.c_float, "double": ctypes.c_double}


def ctype(decl: str):
    """A C parameter or return declaration → its ctypes type (None: void)."""
    words = decl.replace("const", " ").replace("restrict", " ").replace("struct", " ")
    if "*" in words:
        return ctypes.c_void_p
    base = words.split()[0] if words.split() else "void"
    if base == "void":
        return None
    if base not in SCALARS:
        raise AssertionError(f"a C type this test does not know: {decl!r}")
    return SCALARS[base]


def signatures() -> dict:
    """name → (return type, [parameter types]) of every non-static pn_* definition."""
    out = {}
    for ret, name, params in DEFINITION.findall(SOURCE):
        params = " ".join(params.split())
        args = [] if params in ("", "void") else [ctype(p) for p in params.split(",")]
        sig = (ctype(ret), args)
        assert out.setdefault(name, sig) == sig, f"{name} is defined two different ways"
    return out


SIGS = signatures()
CALLED = sorted({m for f in list(ROOT.glob("*.py")) + list(ROOT.glob("layers/*.py"))
                 for m in re.findall(r"\blib\.(pn_\w+)", f.read_text())})


def test_the_parser_sees_the_exported_functions():
    assert len(SIGS) >= 30 and "pn_matmul_int" in SIGS and "pn_decode_layer" in SIGS
    assert SIGS["pn_gemv_k"] == (None, [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p])
    assert set(CALLED) >= {"pn_matmul_int", "pn_gemv_k", "pn_dequant_rows"}


@pytest.mark.parametrize("name", CALLED)
def test_every_function_python_calls_is_declared_as_kernels_c_defines_it(name):
    assert name in SIGS, f"{name} is called but not exported by kernels.c"
    ret, args = SIGS[name]
    fn = getattr(kc.library(), name)
    if args:
        assert fn.argtypes is not None, f"{name} takes arguments but has no argtypes"
        assert list(fn.argtypes) == args, f"{name}: declared {fn.argtypes}, defined {args}"
    if ret not in (None, ctypes.c_int):
        assert fn.restype == ret, f"{name} returns {ret} but restype is {fn.restype}"
