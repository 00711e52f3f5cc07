"""What a user installs and what the tree holds: `make serve` without the test extras,
serving imports nothing only they provide, no path of one machine in any tracked file."""
from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the entry points of every serving command: frontend, worker, admin client, benchmarks
SERVING = ["pantheon.cli", "pantheon.frontend.serve", "pantheon.worker.main",
           "pantheon.frontend.admin_cli", "pantheon.frontend.admin_top",
           "pantheon.common.model_catalog", "pantheon.worker.run", "pantheon.bench.serve"]


def modules_of_test_extras() -> list[str]:
    """Top-level modules of the distributions only pyproject's [test] extras bring."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = lambda req: re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower().replace("_", "-")
    extras = {name(r) for r in project["optional-dependencies"]["test"]}
    only = extras - {name(r) for r in project["dependencies"]}
    modules = importlib.metadata.packages_distributions()
    return sorted(m for m, dists in modules.items()
                  if any(d.lower().replace("_", "-") in only for d in dists))


def make_dry_run(target: str, tmp_path: Path) -> str:
    if shutil.which("make") is None:
        pytest.skip("no make")
    venv = tmp_path / "venv"                        # a fresh clone: nothing installed yet
    return subprocess.run(["make", "-n", "-C", str(ROOT), f"VENV={venv}", target],
                          capture_output=True, text=True, check=True).stdout


def test_make_serve_installs_no_test_extras(tmp_path):
    serve = make_dry_run("serve", tmp_path)
    assert "pip install -q -e ." in serve and "[test]" not in serve
    test = make_dry_run("test", tmp_path)          # from scratch too, as CI runs it
    assert "pip install -q -e ." in test and "'.[test]'" in test and "pytest" in test


def test_serving_imports_nothing_from_the_test_extras():
    blocked = modules_of_test_extras()
    assert "pytest" in blocked
    code = f"""
import importlib, importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {blocked}:
            raise ImportError('test extra imported while serving: ' + name)
sys.meta_path.insert(0, Refuse())
for m in {SERVING!r}:
    importlib.import_module(m)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


# a home folder or this kind of machine's work folders, spelt out in a tracked file
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:root|home/[\w.-]+|Users/[\w.-]+|" + "wo" + r"rk)/")


def test_no_tracked_file_holds_a_path_of_one_machine():
    try:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                               check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    found = []
    for name in filter(None, files):
        path = ROOT / name
        if not path.is_file() or path.suffix in (".npz", ".gguf", ".png"):
            continue
        text = path.read_bytes()[:1 << 20].decode("utf-8", "replace")
        for number, line in enumerate(text.splitlines(), 1):
            if MACHINE_PATH.search(line):
                found.append(f"{name}:{number}: {line.strip()[:120]}")
    assert not found, "paths of one machine:\n" + "\n".join(found)


def test_the_package_data_ships_every_file_of_the_c_kernels():
    """The CPU kernels compile on the user's host from worker/kernels/ (one translation
    unit: pantheon.c includes the rest), so pyproject's package-data must match every file
    there, and kernels_cpu's cache key covers the same files."""
    tomllib = pytest.importorskip("tomllib")
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    worker = ROOT / "worker"
    shipped = {p for pattern in setup["package-data"]["pantheon.worker"]
               for p in worker.glob(pattern)}
    sources = {p for p in (worker / "kernels").iterdir() if p.name != "__pycache__"}
    assert sources and sources <= shipped, sorted(p.name for p in sources - shipped)
    from pantheon.worker import kernels_cpu
    keyed = kernels_cpu.sources()
    assert all(p.name.encode() + b"\0" in keyed for p in sources)
