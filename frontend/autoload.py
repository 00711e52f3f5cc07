"""Models come and go by themselves: load on first request, idle unload, eviction.

Invariants:
- one load per model at a time: concurrent first requests for a model await the one
  task that loads it (`pending`), and wait no longer than the admission queue's timeout;
- only the loader makes room, one load at a time (`room`), so two loads never evict for
  each other;
- a model is claimed by every request that named it, from its resolve() to the end of
  the request's task (its last byte sent, or its error): the replicas of a claimed
  model, or with a request running or queued, are never unloaded, neither for
  keep-alive nor to make room; pinned models (`--pin`, `--model`, an admin load with
  `"pin": true`) never are;
- everything goes through the admin machinery (Admin.load: placement, admission of the
  die's budget, the fleet-wide upload lock; Admin.unload: the drain), with a reason:
  `request`, `idle`, `evicted`, or `admin` for what the admin API asked.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time

from ..common import settings
from ..common.model_file import read_config
from .admin import Admin, AdminError
from .admission import Admission
from .catalog import Catalog, Entry
from .dies import PlacementError, replica_bytes
from .errors import APIError
from .keep_alive import FOREVER
from .model_policy import LifecycleConfig, Policy, Want
from .registry import Change, Registry, Replica, ReplicaState, ServedModel

log = logging.getLogger("pantheon.frontend.autoload")


def looks_like_path(name: str | None) -> bool:
    """A file path rather than a model name: absolute, home- or dot-relative, with a
    `..` step, or a model file's suffix ("org/model", a Hugging Face id, is a name)."""
    if not name:
        return False
    return (name.startswith(("/", "~", "./", "../", "\\")) or "/../" in name
            or name.endswith(("/..", ".gguf", ".safetensors"))
            or re.match(r"[A-Za-z]:[\\/]", name) is not None)


class AutoLoader:
    def __init__(self, catalog: Catalog, registry: Registry, admin: Admin,
                 admission: Admission, policy: Policy, metrics=None):
        self.catalog, self.registry, self.admin = catalog, registry, admin
        self.admission, self.policy, self.metrics = admission, policy, metrics
        self.pending: dict[str, asyncio.Task] = {}   # model name → its load
        self.waiting: dict[str, int] = {}            # requests waiting for that load
        self.keep: dict[str, float] = {}             # per model: the last request's keep_alive
        self.claims: dict[str, int] = {}             # per model: requests under way
        self.released: dict[str, float] = {}         # per model: when the last one ended
        self.seen: dict[str, float] = {}             # replica id → first seen ready
        self.unloading: set[str] = set()             # replica ids an unload was started for
        self.room = asyncio.Lock()
        self.tasks: set[asyncio.Task] = set()
        self.reaper: asyncio.Task | None = None
        self.configs: dict[str, object] = {}         # path → ModelConfig (placement sizes)
        self.events: dict[str, int] = {}             # "load:request" etc. → count (admin top)
        registry.autoload = self
        admin.autoload = self

    def start(self) -> None:
        self.reaper = asyncio.ensure_future(self.reap())

    async def close(self) -> None:
        tasks = [t for t in [self.reaper, *self.tasks, *self.pending.values()] if t]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- what a request asks for ---------------------------------------------------------
    def pinned(self, name: str) -> bool:
        return name in self.policy.pins

    def status(self, name: str) -> str:
        model = self.registry.models.get(name)
        if model is not None and model.ready():
            return "loaded"
        if name in self.pending or (model is not None and model.replicas):
            return "loading"
        return "available"

    def servable(self) -> bool:
        """Something can be served on request (for /health with no model loaded yet)."""
        return self.policy.autoload and bool(self.catalog.entries)

    async def resolve(self, name: str | None, keep_alive: float | None = None) -> ServedModel:
        """The ready model `name` names, loading it first when it is in the catalog and
        not loaded (this request waits for the load, as in the admission queue)."""
        entry = self.catalog.lookup(name)
        if entry is not None and entry.name != name and name in self.registry.models:
            entry = None        # loaded under this name itself (its own settings): serve that
        if entry is None:
            model = self.unknown(name)
            self.claim(model.name)
            return model
        self.keep[entry.name] = self.policy.keep_alive_s if keep_alive is None else keep_alive
        self.claim(entry.name)
        model = self.registry.models.get(entry.name)
        if model is not None and model.ready():
            self.touch(model)
            return model
        if not self.policy.autoload:
            raise APIError(503, f"model {entry.name!r} is not loaded and this server loads "
                                "models only when an admin asks (--no-autoload)",
                           type="service_unavailable", code="model_not_loaded")
        return await self.wait_for(entry)

    def unknown(self, name: str | None) -> ServedModel:
        """A name the catalog does not know: a model loaded under it (by the admin API),
        the single-model shortcut (one model: any other name goes to it, as before there
        was a catalog), else a 400 without a name and a 404 with one, listing what can be
        served. A path is never a name: always a 404, whatever is loaded."""
        available = ", ".join(self.catalog.all_names()) or "none"
        if name in self.registry.models or (len(self.registry.models) == 1
                                            and not looks_like_path(name)):
            return self.registry.resolve(name)
        if name is None:
            raise APIError(400, f"model is required: this server serves several models "
                                f"({available})", param="model", code="model_required")
        raise APIError(404, f"model {name!r} does not exist; available: {available}",
                       param="model", code="model_not_found")

    def claim(self, name: str) -> None:
        """Hold `name` until the calling request's task ends (its response is over)."""
        self.claims[name] = self.claims.get(name, 0) + 1
        task = asyncio.current_task()
        if task is not None:
            task.add_done_callback(lambda _t: self.unclaim(name))
        else:                                             # not in a task: nothing holds it
            self.unclaim(name)

    def unclaim(self, name: str) -> None:
        self.claims[name] -= 1
        if not self.claims[name]:
            del self.claims[name]
        self.released[name] = time.monotonic()
        self.registry.change.fire()        # a load waiting for this model to go idle looks

    def busy(self, model: ServedModel) -> bool:
        return bool(self.claims.get(model.name) or self.admission.queued(model)
                    or self.waiting.get(model.name))

    def touch(self, model: ServedModel) -> None:
        now = time.monotonic()
        for r in model.replicas:
            r.last_used = max(r.last_used, now)

    async def wait_for(self, entry: Entry) -> ServedModel:
        """Join the model's load (start it if none runs) and wait for it to be ready, up
        to the queue timeout; the load's own error (507, 400...) if it fails."""
        name = entry.name
        waiting = self.waiting.get(name, 0)
        if waiting >= self.admission.depth:
            raise APIError(429, f"{waiting} requests already wait for {name!r} to load; "
                                "retry shortly", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "5"})
        task = self.pending.get(name)
        if task is None:
            task = asyncio.ensure_future(self.load(entry, "request"))
            self.pending[name] = task
            task.add_done_callback(lambda t, n=name: self.loaded(n, t))
        self.waiting[name] = waiting + 1
        try:
            await asyncio.wait_for(asyncio.shield(task), self.admission.timeout_s)
        except asyncio.TimeoutError:
            raise APIError(429, f"{name!r} did not finish loading within "
                                f"{self.admission.timeout_s:g} s; retry shortly",
                           type="rate_limit_error", code="queue_timeout",
                           headers={"Retry-After": "2"}) from None
        except AdminError as exc:
            raise APIError(exc.status, str(exc), type="insufficient_storage"
                           if exc.status == 507 else "invalid_request_error"
                           if exc.status < 500 else "server_error",
                           code="model_load_failed") from None
        finally:
            self.waiting[name] -= 1
            if not self.waiting[name]:
                del self.waiting[name]
        model = self.registry.models.get(name)
        if model is None or not model.ready():      # unloaded again meanwhile (an admin)
            raise APIError(503, f"model {name!r} was unloaded while this request waited",
                           type="service_unavailable", code="model_unloaded",
                           headers={"Retry-After": "1"})
        self.touch(model)
        return model

    def loaded(self, name: str, task: asyncio.Task) -> None:
        self.pending.pop(name, None)
        if not task.cancelled() and task.exception() is not None \
                and not isinstance(task.exception(), AdminError):
            log.error("loading %s failed: %s", name, task.exception())

    # -- loading, and making room ---------------------------------------------------------
    async def load(self, entry: Entry, reason: str) -> None:
        deadline = time.monotonic() + self.admission.timeout_s
        async with self.room:
            if not await self.until_gone(entry.name, deadline):
                return                                     # an admin load got there first
            await self.make_room(Want(name=entry.name, path=entry.path), deadline)
            log.info("loading %s (reason: %s)", entry.name, reason)
            await self.admin.load({"path": entry.path, "name": entry.name}, trusted=True,
                                  reason=reason)
            self.count("load", reason)

    async def until_gone(self, name: str, deadline: float) -> bool:
        """True once `name` has no replica left (an idle unload under way finishes
        first); False when it is ready, or an admin's load of it has ended, or at the
        deadline (the waiters then see whether it is ready). Woken by the registry's
        changes, not by polling."""
        while True:
            change = self.registry.change.event           # before looking: none is missed
            model = self.registry.models.get(name)
            if model is None or not model.replicas:
                return True
            if model.ready() or all(r.state == ReplicaState.FAILED for r in model.replicas):
                return False
            if not await Change.wait(change, deadline - time.monotonic()):
                return False

    def config(self, path: str):
        if path not in self.configs:
            self.configs[path] = read_config(path)
        return self.configs[path]

    def fits(self, want: Want, cfg) -> None:
        """Return when a die has room for `want` now; PlacementError when none has."""
        placer = self.admin.placer
        self.admin.die_table.choose(want.path, cfg, want.dies, want.slots or placer.slots,
                                    want.ctx or placer.ctx, want.quantize or placer.quantize,
                                    kv=want.kv.over(placer.kv_cache))

    async def make_room(self, want: Want, deadline: float, cap: bool = True) -> list[dict]:
        """Unload the least recently used idle, unpinned replicas until `want` fits a die
        (and, `cap`, the resident count is under --max-loaded); wait for busy ones to go
        idle up to `deadline` (woken when a request lets go of its model or a replica
        goes); a 507 naming what holds the memory when nothing can go. The replicas it
        unloaded, as {"id", "model", "die"}."""
        cfg = await asyncio.to_thread(self.config, want.path)
        evicted: list[dict] = []
        while True:
            change = self.registry.change.event            # before looking: none is missed
            over = cap and bool(self.policy.max_loaded) \
                and self.resident() >= self.policy.max_loaded
            why = f"--max-loaded {self.policy.max_loaded} models are resident" if over else ""
            if not over:
                try:
                    self.fits(want, cfg)
                    return evicted
                except PlacementError as exc:
                    if exc.status != 507:
                        raise AdminError(exc.status, str(exc)) from None
                    why = str(exc)
            victims = self.victims(want, cfg, over, busy_too=False)
            if victims:
                lru = min(victims, key=lambda mr: mr[1].last_used)
                targets = [(lru[0], r) for r in lru[0].replicas] if over else [lru]
                evicted += [{"id": r.model_id, "model": m.name, "die": r.die}
                            for m, r in targets]
                await asyncio.gather(*(self.unload(m, r, "evicted") for m, r in targets))
                continue
            if not self.victims(want, cfg, over, busy_too=True) \
                    or time.monotonic() >= deadline:
                held = "; ".join(f"{r.model_id} on die {r.die} ({r.reserved / 2**20:.1f} MiB, "
                                 + ("pinned" if self.pinned(m.name) else
                                    f"{r.inflight} running") + ")"
                                 for m, r in self.registry.replicas() if m.name != want.name)
                raise AdminError(507, f"cannot load {want.name!r}: {why}" +
                                 (f"; held by {held}" if held else ""))
            await Change.wait(change, deadline - time.monotonic())   # a busy one goes idle

    async def could_go(self, want: Want) -> list[str]:
        """The replicas make_room would evict for `want` now (the LRU first)."""
        cfg = await asyncio.to_thread(self.config, want.path)
        return [r.model_id for _, r in sorted(self.victims(want, cfg, False, busy_too=False),
                                              key=lambda mr: mr[1].last_used)]

    def resident(self) -> int:
        return sum(1 for m in self.registry.models.values() if m.replicas)

    def evictable(self, model: ServedModel, r: Replica, want: Want, busy_too: bool) -> bool:
        """May go now; or, `busy_too`, will or may go (busy, or already unloading)."""
        if model.name == want.name or self.pinned(model.name):
            return False
        if busy_too:
            return r.state in (ReplicaState.READY, ReplicaState.UNLOADING)
        return r.state == ReplicaState.READY and r.model_id not in self.unloading \
            and not (r.inflight or self.busy(model))

    def victims(self, want: Want, cfg, whole_model: bool, busy_too: bool) -> list[tuple]:
        """What may go to make room: replicas of models whose every replica may go
        (--max-loaded), or replicas on a die where the new one fits once they are gone.
        `busy_too`: those that may go once their requests are over."""
        pairs = [(m, r) for m, r in self.registry.replicas()
                 if self.evictable(m, r, want, busy_too)]
        if whole_model:
            return [(m, r) for m, r in pairs
                    if all(self.evictable(m, x, want, busy_too) for x in m.replicas)]
        placer, useful = self.admin.placer, []
        for die in self.admin.die_table.snapshot():
            if not die.alive or (want.dies is not None and die.die not in want.dies):
                continue
            need = replica_bytes(want.path, cfg, die.kind, want.slots or placer.slots or
                                 self.admin.die_table.slots, want.ctx or placer.ctx,
                                 want.quantize or placer.quantize,
                                 want.kv.over(placer.kv_cache))
            here = [(m, r) for m, r in pairs if r.die == die.die]
            if need <= die.free_budget + sum(r.reserved for _, r in here):
                useful += here
        return useful

    async def unload(self, model: ServedModel, r: Replica, reason: str) -> None:
        if r.model_id in self.unloading:
            return
        self.unloading.add(r.model_id)
        try:
            log.info("unloading %s from die %s (reason: %s)", r.model_id, r.die, reason)
            await self.admin.unload({"id": r.model_id, "timeout_s": settings.UNLOAD_TIMEOUT_S},
                                    reason=reason)
        except AdminError as exc:        # gone meanwhile, or already unloading
            log.info("unloading %s: %s", r.model_id, exc)
        finally:
            self.unloading.discard(r.model_id)
            self.seen.pop(r.model_id, None)

    # -- idle unload -------------------------------------------------------------------
    async def reap(self) -> None:
        while True:
            await asyncio.sleep(self.policy.tick_s)
            try:
                self.reap_once(time.monotonic())
            except Exception:        # the reaper must outlive any one bad moment
                log.exception("idle check failed")

    def reap_once(self, now: float) -> None:
        for model, r in list(self.registry.replicas()):
            if r.state != ReplicaState.READY:
                continue
            since = max(r.last_used, self.seen.setdefault(r.model_id, now),
                        self.released.get(model.name, 0.0))
            keep = self.keep.get(model.name, self.policy.keep_alive_s)
            if keep == FOREVER or keep < 0 or self.pinned(model.name) or r.inflight \
                    or self.busy(model) or r.model_id in self.unloading \
                    or model.name in self.pending:
                continue
            if now - since >= keep:
                self.spawn(self.unload(model, r, "idle"))

    def spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- what the admin API did ----------------------------------------------------------
    def admin_loaded(self, name: str, path: str, pin: bool) -> None:
        self.count("load", "admin")
        if pin:
            self.policy.pins.add(name)
        self.catalog.remember(name, path)

    def admin_unloaded(self, name: str) -> None:
        """An admin unloaded every replica of `name`: a model only an admin load named
        leaves the catalog; the keep-alive it had goes."""
        if name not in self.registry.models:
            self.catalog.forget(name)
            self.keep.pop(name, None)

    def summary(self) -> dict:
        """For `pantheon admin top`: loads and unloads by reason, what is loading."""
        by = {"loads": {}, "unloads": {}}
        for key, n in sorted(self.events.items()):
            what, reason = key.split(":")
            by[what + "s"][reason] = n
        return {**by, "loading": sorted(self.pending), "waiting": dict(self.waiting),
                "catalog": len(self.catalog.names)}

    def count(self, what: str, reason: str) -> None:
        key = f"{what}:{reason}"
        self.events[key] = self.events.get(key, 0) + 1

    async def rescan(self) -> dict:
        before = set(self.catalog.names)
        await asyncio.to_thread(self.catalog.scan)
        now = set(self.catalog.names)
        log.info("catalog rescanned: %d names (%d new, %d gone)", len(now),
                 len(now - before), len(before - now))
        return {"models": self.catalog.all_names(), "added": sorted(now - before),
                "removed": sorted(before - now)}

    # -- what /v1/models shows -------------------------------------------------------------
    def listing(self) -> list[dict]:
        """Every servable name: catalog entries, their aliases, and loaded models the
        catalog does not name; loaded ones first."""
        rows = []
        names = set()
        for entry in self.catalog.entries.values():
            rows.append(self.row(entry.name, entry.source, entry.aliases, entry.created))
            names.add(entry.name)
            for alias in entry.aliases:
                rows.append(self.row(entry.name, "alias", [], entry.created, alias))
                names.add(alias)
        for model in self.registry.models.values():
            if model.name not in names:
                rows.append(self.row(model.name, "admin", [], model.created))
        order = {"loaded": 0, "loading": 1, "available": 2}
        return sorted(rows, key=lambda row: (order[row["status"]], row["id"]))

    def row(self, name: str, source: str, aliases: list[str], created: int,
            alias: str | None = None) -> dict:
        model = self.registry.models.get(name)
        out = {"id": alias or name, "status": self.status(name), "source": source,
               "pinned": self.pinned(name), "max_model_len": model.context() if model else 0,
               "created": model.created if model else created}
        if alias:
            out["alias_of"] = name
        elif aliases:
            out["aliases"] = list(aliases)
        if model is not None and model.replicas:
            out["replicas"] = [{"id": r.model_id, "die": r.die, "state": r.state,
                                "in_flight": r.inflight, "slots": r.slots, "ctx": r.ctx}
                               for r in model.replicas]
        keep = self.keep.get(name, self.policy.keep_alive_s)
        out["keep_alive_s"] = None if keep < 0 or self.pinned(name) else keep
        return out


__all__ = ["AutoLoader", "LifecycleConfig", "Policy", "Want", "looks_like_path"]
