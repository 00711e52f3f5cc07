"""The table of stored types (common/formats.py): each record agrees with the GGUF
format, with what a load really holds on either die, and with its reference decoding;
and worker/ imports without cycles (the table broke the qmatrix ↔ kernels_cpu one)."""
import ast
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from pantheon.common.formats import FORMATS, FormatError, QUANTIZED, lookup
from pantheon.common.weight_format import held_as
from pantheon.worker import matrices as qm
from pantheon.worker.quants import dequantize
from test_qmatrix import random_tensor

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_record_matches_the_gguf_block_sizes(name):
    fmt = FORMATS[name]
    assert GGML_QUANT_SIZES[QT[name]] == (fmt.block, fmt.block_bytes)
    for off in fmt.fp16_fields:
        assert 0 <= off <= fmt.block_bytes - 2


@pytest.mark.parametrize("name", sorted(QUANTIZED))
@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
def test_a_load_holds_what_the_record_says_it_costs_and_decodes_the_reference(name, gpu):
    raw, shape = random_tensor(QT[name], 6, 2)
    m = qm.from_gguf(raw, QT[name], shape, gpu=gpu)
    held = FORMATS[name].gpu if gpu else FORMATS[name].cpu
    assert (m.kind, m.bs) == (held.kind, held.bs if not held.native else FORMATS[name].block)
    assert m.nbytes() == FORMATS[name].held_bytes(shape[0] * shape[1], gpu=gpu)
    assert m.nbytes() == held_as(name, shape, "auto", 2 if gpu else 4)
    ref = dequantize(raw, QT[name], shape)
    # a K-quant's (and IQ4_XS's) sub-scale times d is one fp16 on a GPU: 2^-11 relative
    np.testing.assert_allclose(qm.dequantize(m), ref, rtol=0,
                               atol=np.abs(ref).max() * 2.0 ** -11)
    if not gpu:         # and moved to a GPU, a CPU's kind becomes the GPU's
        moved = qm.to_die(m, np)
        assert (moved.kind, moved.nbytes()) == (FORMATS[name].gpu.kind,
                                                FORMATS[name].held_bytes(m.rows * m.cols, True))


def test_a_type_not_in_the_table_and_a_bad_shape_are_load_errors_naming_the_tensor():
    with pytest.raises(FormatError, match="tensor blk.0.x: type IQ2_XXS cannot be held.*IQ4_NL"):
        lookup("IQ2_XXS", "blk.0.x")
    raw, shape = random_tensor(QT.IQ4_XS, 4, 1)
    with pytest.raises(FormatError, match="tensor w: row of 128 is not a whole number of "
                                          "IQ4_XS blocks of 256"):
        qm.from_gguf(raw[:4 * 68], QT.IQ4_XS, (4, 128), "w")
    with pytest.raises(FormatError, match="tensor w: 540 bytes do not hold"):
        qm.from_gguf(raw[:-4], QT.IQ4_XS, shape, "w")


def _imports(path: Path, module: str, known: set[str]) -> set[str]:
    """The worker modules `module` (at `path`) imports, at any depth of its code."""
    package = module.split(".")[:-1] if path.name != "__init__.py" else module.split(".")
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1]
                                + ([node.module] if node.module else []))
            else:
                base = (node.module or "").removeprefix("pantheon.")
            for alias in node.names:
                out |= {f"{base}.{alias.name}"} & known or {base} & known
        elif isinstance(node, ast.Import):
            out |= {a.name.removeprefix("pantheon.") for a in node.names} & known
    return out - {module}


def test_worker_modules_import_each_other_without_a_cycle():
    files = {}
    for path in (ROOT / "worker").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {m: _imports(p, m, set(files)) for m, p in files.items()}
    assert "worker.kernels_cpu" in graph["worker.matrices"]         # the walk sees imports
    state: dict[str, int] = {}

    def visit(m: str, trail: list[str]) -> None:
        state[m] = 1
        for dep in sorted(graph[m]):
            assert state.get(dep) != 1, f"import cycle: {' -> '.join(trail + [m, dep])}"
            if dep not in state:
                visit(dep, trail + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
