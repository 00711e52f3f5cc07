"""The catalog: every model this server may serve, loaded or not, under its names.

Its entries come from four places, in this order of precedence for a name:

- `--model` files (named by `--name`, else the file stem): loaded at start and pinned;
- `--alias NAME=PATH` (repeatable): one more name for a model file or folder, or for a
  name already in the catalog; several aliases may point to one model;
- the `--model-dir` folders: every `*.gguf` file (named by its stem) and every Hugging
  Face folder (a `config.json` beside `*.safetensors`, named by the folder) at the top
  of each folder, found at start and on a rescan (`pantheon admin rescan`);
- the models `pantheon models fetch` cached (named as the fetch names them).

One model (one resolved path) has one canonical name, the first it was given; an alias
is a second name that resolves to it. A request names a model only by one of these
names: `model` is looked up in this table and never opened as a path, so no request can
make the server read a file outside the catalog.

A file that is not a model (a truncated GGUF, a folder whose config names no supported
architecture) is skipped at scan with one warning; an alias naming a missing file or
something that is not a model is refused at start.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from ..common import model_catalog
from ..common.model_file import read_config

log = logging.getLogger("pantheon.frontend.catalog")


class CatalogError(ValueError):
    """A start-up setting names something that cannot serve (exit 1 with its line)."""


@dataclass
class Entry:
    name: str                 # the canonical name
    path: str                 # resolved file or folder
    source: str               # "model", "alias", "model-dir", "fetched", "admin"
    aliases: list[str] = field(default_factory=list)
    created: int = 0          # the file's (or folder's) modification time

    def as_json(self) -> dict:
        return {"name": self.name, "path": self.path, "source": self.source,
                "aliases": list(self.aliases)}


def parse_alias(text: str) -> tuple[str, str]:
    """`NAME=PATH` → (name, path); CatalogError when it is not that shape."""
    name, sep, target = text.partition("=")
    if not sep or not name.strip() or not target.strip():
        raise CatalogError(f"--alias {text!r}: the form is NAME=PATH (or NAME=OTHER_NAME)")
    return name.strip(), target.strip()


def is_model(path: Path) -> str | None:
    """None when `path` reads as a model (its metadata: no weights are read); else why
    not."""
    try:
        read_config(path)
    except Exception as exc:      # any file at all may sit in a model dir: never a crash
        return str(exc) or type(exc).__name__
    return None


def candidates(folder: Path) -> list[Path]:
    """What may be a model at the top of a model dir: GGUF files and HF folders."""
    try:
        items = sorted(folder.iterdir())
    except OSError as exc:
        log.warning("model dir %s cannot be read: %s", folder, exc)
        return []
    found = []
    for item in items:
        if item.name.startswith("."):
            continue
        if item.is_file() and item.suffix.lower() == ".gguf":
            found.append(item)
        elif item.is_dir() and (item / "config.json").is_file() \
                and any(item.glob("*.safetensors")):
            found.append(item)
    return found


class Catalog:
    def __init__(self, model_dirs: list[str] | None = None,
                 models: list[tuple[str, str | None]] | None = None,
                 aliases: list[tuple[str, str]] | None = None, fetched: bool = True):
        self.model_dirs = [Path(d).expanduser() for d in model_dirs or []]
        self.models = list(models or [])      # (path, name or None): --model
        self.alias_args = list(aliases or [])
        self.fetched = fetched
        self.entries: dict[str, Entry] = {}   # canonical name → entry
        self.names: dict[str, Entry] = {}     # every name (aliases too) → entry
        self.remembered: dict[str, str] = {}  # admin loads: name → path, kept once unloaded
        self.skipped: set[str] = set()        # paths already warned about

    # -- building ----------------------------------------------------------------------
    def scan(self) -> None:
        """Build the table afresh (blocking file reads: run it off the event loop), then
        swap it in whole, so a reader never sees half a table. CatalogError for a bad
        --alias; a bad file in a model dir is only skipped."""
        fresh = Catalog(None, self.models, self.alias_args, self.fetched)
        fresh.model_dirs, fresh.skipped = self.model_dirs, self.skipped
        fresh.remembered = dict(self.remembered)
        fresh.build()
        self.entries, self.names = fresh.entries, fresh.names

    def build(self) -> None:
        for path, name in self.models:
            self.add(name or Path(path).stem, path, "model")
        for name, path in self.remembered.items():
            self.add(name, path, "admin")
        for folder in self.model_dirs:
            for item in candidates(folder):
                self.add_found(item.stem if item.is_file() else item.name, item, "model-dir")
        if self.fetched:
            for row in model_catalog.listing():
                if row.status == "cached":
                    self.add_found(row.name, Path(row.path), "fetched")
        self.add_aliases()        # last: an alias of a scanned model names that entry

    def add_aliases(self) -> None:
        for name, target in self.alias_args:
            if name in self.names:
                raise CatalogError(f"--alias {name}={target}: {name!r} already names "
                                   f"{self.names[name].path} (a --model, or another alias)")
            entry = self.names.get(target)
            if entry is None:          # not a name: a path, which must be a model
                path = Path(target).expanduser()
                if not path.exists():
                    raise CatalogError(f"--alias {name}={target}: no such file or folder")
                why = is_model(path)
                if why is not None:
                    raise CatalogError(f"--alias {name}={target}: not a model ({why})")
                entry = self.entry_for(path)
            if entry is None:
                self.add(name, str(path), "alias")
            else:
                entry.aliases.append(name)
                self.names[name] = entry

    def add_found(self, name: str, path: Path, source: str) -> None:
        """A scanned model: skipped (once warned) when it is not a model; a second name
        for a model already listed is left out (the first name serves it)."""
        if self.entry_for(path) is not None or name in self.names \
                or name in {alias for alias, _ in self.alias_args}:
            return
        why = is_model(path)
        if why is not None:
            if str(path) not in self.skipped:
                self.skipped.add(str(path))
                log.warning("model dir: skipping %s, not a model: %s", path, why)
            return
        self.add(name, str(path), source)

    def add(self, name: str, path: str, source: str) -> Entry:
        entry = self.entry_for(Path(path))
        if entry is not None:              # the same model under one more name
            if name != entry.name and name not in self.names:
                entry.aliases.append(name)
                self.names[name] = entry
            return entry
        real = Path(path).expanduser().resolve()
        try:
            created = int(real.stat().st_mtime)
        except OSError:
            created = 0
        entry = Entry(name, str(real), source, created=created)
        self.entries[name] = self.names[name] = entry
        return entry

    def entry_for(self, path: Path) -> Entry | None:
        try:
            real = str(path.expanduser().resolve())
        except (OSError, RuntimeError):
            return None
        return next((e for e in self.entries.values() if e.path == real), None)

    def remember(self, name: str, path: str) -> None:
        """A model an admin loaded by path: it stays servable after an idle unload."""
        if name not in self.names:
            self.remembered[name] = path
            self.add(name, path, "admin")

    def forget(self, name: str) -> None:
        """An admin unloaded it: a model only an admin load named goes with it."""
        if self.remembered.pop(name, None) is not None:
            entry = self.entries.pop(name, None)
            if entry is not None:
                for alias in [name, *entry.aliases]:
                    self.names.pop(alias, None)

    # -- reading -----------------------------------------------------------------------
    def lookup(self, name: str | None) -> Entry | None:
        """The entry a request's `model` names: by name only, never by path."""
        return self.names.get(name) if isinstance(name, str) else None

    def all_names(self) -> list[str]:
        return sorted(self.names)
