"""The ctypes declarations of the CPU kernels against their C header and definitions.

ctypes converts arguments by the declared argtypes, and without them passes a Python int
as a C int: an int64_t parameter left undeclared is silently cut to 32 bits. The
declarations are read from worker/kernels/pantheon.h (worker/kernels_header.py), which
the unity build compiles against, so the one build the compiler sees cannot disagree with
it. What the compiler does not see is checked here: every definition of an exported
function in every ISA branch of worker/kernels/*.c (the stubs of the paths a build
lacks) has the header's signature, every function the Python side calls is in the
header, and the ctypes structs have C's sizes and field offsets."""
import ctypes
import re
import shutil
import subprocess

import pytest

from pantheon.worker import kernels_cpu as kc
from pantheon.worker import kernels_header as kh

ROOT = kc.KERNELS.parent
DEFINITION = re.compile(r"^(?!static)([A-Za-z_][\w \t\*]*?)\b(pn_\w+)\(([^)]*)\)\s*\{",
                        re.MULTILINE)
DECLS = kc.DECLS


def definitions() -> dict:
    """name → [(return type, [parameter types]), ...] of every non-static pn_* definition,
    one entry per definition (a name is defined once per build branch)."""
    out: dict = {}
    for path in sorted(kc.KERNELS.glob("*.c")):
        for ret, name, params in DEFINITION.findall(path.read_text()):
            params = " ".join(params.split())
            args = [] if params in ("", "void") else [kh._param(p, DECLS.structs)
                                                       for p in params.split(",")]
            restype = ctypes.c_void_p if "*" in ret else kh._base(ret, DECLS.structs)
            out.setdefault(name, []).append((restype, args))
    return out


DEFS = definitions()
CALLED = sorted({m for f in list(ROOT.glob("*.py")) + list(ROOT.glob("layers/*.py"))
                 + list(ROOT.parent.joinpath("bench").glob("*.py"))
                 for m in re.findall(r"\blib\.(pn_\w+)", f.read_text())})


def test_the_header_declares_the_exported_functions_and_structs():
    assert len(DECLS.functions) >= 30 and "pn_matmul_int" in DECLS.functions
    assert DECLS.functions["pn_gemv_k"] == (None, [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p])
    assert DECLS.functions["pn_init"] == (ctypes.c_int, [ctypes.c_void_p])
    assert {"PnOptions", "PnMat", "PnScratch", "PnLayer", "PnStep"} <= set(DECLS.structs)
    assert set(CALLED) >= {"pn_matmul_int", "pn_gemv_k", "pn_dequant_rows", "pn_decode_layer"}


def test_every_exported_definition_in_every_build_branch_has_the_headers_signature():
    assert set(DEFS) == set(DECLS.functions), \
        f"defined, not declared: {sorted(set(DEFS) - set(DECLS.functions))}; " \
        f"declared, never defined: {sorted(set(DECLS.functions) - set(DEFS))}"
    for name, sigs in DEFS.items():
        for sig in sigs:
            assert sig == DECLS.functions[name], f"{name} is defined as {sig}, declared " \
                                                 f"{DECLS.functions[name]}"


@pytest.mark.parametrize("name", CALLED)
def test_every_function_python_calls_is_declared_as_the_header_says(name):
    assert name in DECLS.functions, f"{name} is called but not in worker/kernels/pantheon.h"
    restype, args = DECLS.functions[name]
    fn = getattr(kc.library(), name)
    assert list(fn.argtypes) == args and fn.restype == restype


def test_the_ctypes_structs_have_cs_sizes_and_offsets(tmp_path):
    """A C probe compiled against the header prints each struct's size and its fields'
    offsets; the structs read from the header must agree."""
    cc = shutil.which(kc.settings.c_compiler())
    if cc is None:
        pytest.skip("no C compiler")
    names = ("PnOptions", "PnMat", "PnScratch", "PnLayer", "PnStep")
    lines = [f'#include "{kc.HEADER}"', "#include <stdio.h>", "#include <stddef.h>",
             "int main(void) {"]
    for name in names:
        lines.append(f'printf("{name} %zu\\n", sizeof({name}));')
        for field, _ in DECLS.structs[name]._fields_:
            lines.append(f'printf("{name}.{field} %zu\\n", offsetof({name}, {field}));')
    lines += ["return 0;", "}"]
    (tmp_path / "probe.c").write_text("\n".join(lines))
    subprocess.run([cc, "-std=c11", "-o", str(tmp_path / "probe"), str(tmp_path / "probe.c")],
                   check=True, capture_output=True)
    got = dict(line.split() for line in subprocess.run(
        [str(tmp_path / "probe")], check=True, capture_output=True, text=True).stdout.splitlines())
    for name in names:
        cls = DECLS.structs[name]
        assert int(got[name]) == ctypes.sizeof(cls), name
        for field, _ in cls._fields_:
            assert int(got[f"{name}.{field}"]) == getattr(cls, field).offset, f"{name}.{field}"


def test_the_reader_turns_declarations_into_ctypes_and_refuses_what_it_does_not_know():
    h = kh.read("""
        /* a comment; with a semicolon */
        typedef struct A { int64_t n; const float *w[2]; float eps; } A;
        typedef struct B { int32_t k, j; A a; } B;
        int pn_f(const B *b, int64_t n,
                 float eps);                       // a trailing comment
        void pn_g(void);
    """)
    assert [n for n, _ in h.structs["B"]._fields_] == ["k", "j", "a"]
    assert h.structs["B"]._fields_[2][1] is h.structs["A"]
    assert ctypes.sizeof(h.structs["A"]) == 8 + 16 + 8
    assert h.functions == {"pn_f": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int64,
                                                   ctypes.c_float]),
                           "pn_g": (None, [])}
    with pytest.raises(kh.HeaderError, match="long double"):
        kh.read("void pn_h(long double x);")
    with pytest.raises(kh.HeaderError, match="size_t"):
        kh.read("typedef struct C { size_t n; } C;")
