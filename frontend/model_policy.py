"""The lifecycle settings of `pantheon serve`: the flags as given (LifecycleConfig,
checked before anything starts) and the policy the autoloader runs by (Policy)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..common.kv_cache import KVCacheTypes
from .catalog import Catalog, CatalogError, parse_alias
from .keep_alive import FOREVER


@dataclass
class Policy:
    """The lifecycle settings `pantheon serve` takes."""

    autoload: bool = True            # --no-autoload: only --model and the admin load
    keep_alive_s: float = 300.0      # --keep-alive (-1: never unload when idle)
    pins: set[str] = field(default_factory=set)     # --pin NAME, and the --model names
    max_loaded: int = 0              # --max-loaded: resident models at most (0: no cap)
    tick_s: float = 0.25             # how often idle replicas are looked at


@dataclass(kw_only=True)
class LifecycleConfig:
    """`pantheon serve`'s lifecycle flags, checked before anything starts."""

    aliases: list[tuple[str, str]] = field(default_factory=list)   # --alias NAME=PATH
    pins: list[str] = field(default_factory=list)                  # --pin NAME
    keep_alive_s: float = 300.0
    max_loaded: int = 0
    autoload: bool = True
    preload: bool = True              # --no-preload: the --model files wait for a request
    fetched: bool = True              # the models `pantheon models fetch` cached

    def __post_init__(self):
        if self.keep_alive_s < 0 and self.keep_alive_s != FOREVER:
            raise ValueError(f"--keep-alive {self.keep_alive_s:g}: seconds >= 0, or -1 for "
                             "never")
        if self.max_loaded < 0:
            raise ValueError(f"--max-loaded {self.max_loaded}: 0 (no cap) or more")

    def catalog(self, models: list[tuple[str, str | None]],
                model_dirs: list[str] | None) -> Catalog:
        """The catalog, scanned (blocking: off the event loop); CatalogError for a bad
        --alias."""
        catalog = Catalog(model_dirs, models, self.aliases, self.fetched)
        catalog.scan()
        return catalog

    def policy(self, catalog: Catalog, model_names: list[str]) -> Policy:
        """The pins are the --model names and --pin's (an alias pins its model)."""
        pins = set(model_names)
        for name in self.pins:
            entry = catalog.lookup(name)
            if entry is None:
                raise CatalogError(f"--pin {name}: no such model; the catalog has "
                                   f"{', '.join(catalog.all_names()) or 'nothing'}")
            pins.add(entry.name)
        return Policy(self.autoload, self.keep_alive_s, pins, self.max_loaded)


@dataclass(frozen=True, kw_only=True)
class Want:
    """What a load asks of a die, for making room: the model's name and file and its
    replica's shape (0, "", None: the server's)."""

    name: str
    path: str
    dies: list[str] | None = None
    slots: int = 0
    ctx: int = 0
    quantize: str = ""
    kv: KVCacheTypes = KVCacheTypes()
