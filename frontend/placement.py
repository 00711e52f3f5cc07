"""Putting replicas on dies and keeping them there.

The registry holds the desired placement (replica → die). This module acts
on it: when a worker for a die joins (first start, restart, reconnect) the
replicas meant for that die are loaded there; when it is lost, they wait
for it to come back. A worker that rejoins still holding a replica (it was
only cut off) keeps it: its hello lists what it holds, and what matches the
registry is adopted as is; what does not, it is told to unload. At most one weight upload runs at a time across the
whole fleet, startup loads included (the spec's upload_lock), so two large
transients never stack on one host.
"""
from __future__ import annotations

import asyncio
import logging

from ..common import protocol as p
from ..common import settings, speculation
from . import split_placement
from ..common.kv_cache import KVCacheTypes
from .dies import DieTable, PlacementError
from .registry import Registry, Replica, ReplicaState, ServedModel, same_model
from .workers import LoadError, WorkerInfo, WorkerLost, WorkerPool

log = logging.getLogger("pantheon.frontend.placement")


class Placer:
    def __init__(self, registry: Registry, pool: WorkerPool, dies: DieTable, slots: int = 0,
                 ctx: int = 0, prefill_chunk: int = settings.PREFILL_CHUNK, expected_dies: list[str] | None = None,
                 grace_s: float = 60.0, quantize: str = "auto", metrics=None,
                 kv_cache: KVCacheTypes = KVCacheTypes(),
                 spec: p.Speculation | None = None, activations: str = "auto"):
        self.registry, self.pool, self.dies = registry, pool, dies
        self.metrics = metrics                # metrics.Metrics: loads by outcome, seconds
        self.slots, self.ctx, self.prefill_chunk = slots, ctx, prefill_chunk
        self.quantize = quantize
        self.activations = activations
        self.kv_cache = kv_cache       # --kv-cache: what a load that names none holds
        self.spec = spec                      # serve --spec: every replica's unless its load says
        # auto-placement waits (up to grace_s) for every die we spawned, to spread models
        self.expected = set(expected_dies or [])
        self.grace = asyncio.get_running_loop().call_later(grace_s, self.stop_waiting)
        self.upload_lock = asyncio.Lock()
        self.tasks: set[asyncio.Task] = set()
        self.change = asyncio.Event()         # set when a replica becomes ready or fails
        pool.on_join.append(self.joined)
        pool.on_lost.append(self.lost)
        self.split_watch = split_placement.SplitWatch(self)

    def joined(self, worker: WorkerInfo) -> None:
        held = {r.model_id: r for r in worker.hello.replicas}
        for model_id in worker.hello.models:
            if not self.adopt(worker, held.get(model_id)):   # not ours: start clean
                log.warning("worker for die %s holds %s, which is not placed there; "
                            "telling it to unload it", worker.die, model_id)
                self.spawn(self.pool.send(worker, p.Unload(model_id)))
        self.expected.discard(worker.die)
        self.place_pending()
        for model, replica in self.registry.replicas():
            if replica.die == worker.die and replica.state in (ReplicaState.PLACED,
                                                               ReplicaState.FAILED):
                self.start_load(model, replica, worker)

    def adopt(self, worker: WorkerInfo, held: p.Resident | None) -> bool:
        """Take a replica the worker already holds as ready, if it is the one the registry
        places on its die (same replica id, same model file): no reload."""
        if held is None:
            return False
        for model, replica in self.registry.replicas():
            if replica.model_id != held.model_id:
                continue
            if (replica.die not in (None, worker.die)
                    or replica.state not in (ReplicaState.PLACED, ReplicaState.FAILED)
                    or same_model(replica.path or model.path, held.path) is not None
                    or replica.want_slots not in (0, held.slots)
                    or replica.want_ctx not in (0, held.ctx)):
                return False
            if replica.die is None:
                replica.reserved = held.weight_bytes + held.kv_bytes
                replica.weight_bytes = held.weight_bytes
            replica.die, replica.worker, replica.state = worker.die, worker, ReplicaState.READY
            replica.slots, replica.ctx, replica.error = held.slots, held.ctx, ""
            log.info("%s is still resident on die %s: kept, not reloaded", held.model_id,
                     worker.die)
            self.pool.changed()
            self.changed()
            return True
        return False

    def changed(self) -> None:
        """A replica became ready or failed: wake the placement waiter and the registry's
        (the autoloader's load waiters)."""
        self.change.set()
        self.registry.change.fire()

    def stop_waiting(self) -> None:
        if self.expected:
            log.warning("dies %s did not join in time; placing without them",
                        ", ".join(sorted(self.expected)))
            self.expected.clear()
            self.place_pending()

    def lost(self, worker: WorkerInfo) -> None:
        """Its replicas wait for their die to come back (or are reloaded at once when
        another worker for that die is already here)."""
        live = {w.die: w for w in self.pool.live()}
        for model, replica in self.registry.replicas():
            if replica.worker is worker:
                replica.state, replica.worker = ReplicaState.PLACED, None
                if replica.die in live:
                    self.start_load(model, replica, live[replica.die])

    def place_pending(self) -> None:
        """Give every unplaced replica a die: the one with the most free budget that fits."""
        live = {w.die: w for w in self.pool.live()}
        if not live or self.expected:
            return
        for model, replica in list(self.registry.replicas()):
            if replica.die is not None or replica.state != ReplicaState.PLACED:
                continue
            try:
                if replica.want_dies:                # serve --model-dies: two stages
                    split_placement.place(self, model, replica, replica.want_dies)
                else:
                    replica.die, replica.reserved = self.dies.choose(
                        model.path, model.config, None, replica.want_slots or self.slots,
                        replica.want_ctx or self.ctx, replica.want_quantize or self.quantize,
                        self.draft_of(model, replica),
                        kv=replica.want_kv.over(self.kv_cache))
            except (PlacementError, ValueError) as exc:     # ValueError: its draft
                if split_placement.fallback(self, model, replica, exc):   # two dies fit
                    self.start_load(model, replica, live[replica.die])
                    continue
                replica.state, replica.error = ReplicaState.FAILED, str(exc)
                log.error("cannot place %s: %s", model.name, exc)
                self.changed()
                continue
            self.start_load(model, replica, live[replica.die])

    def draft_of(self, model: ServedModel, replica: Replica):
        """(path, config) of the draft model the replica's speculation loads, or None."""
        spec = speculation.effective(replica.want_spec, self.spec)
        if spec is None or spec.kind != "draft":
            return None
        return spec.draft, speculation.check_draft(model.config, spec.draft, 0, 0)

    def start_load(self, model: ServedModel, replica: Replica, worker: WorkerInfo) -> None:
        replica.state = ReplicaState.LOADING      # now, so nobody starts the same load twice
        self.spawn(self.load(model, replica, worker))

    async def load(self, model: ServedModel, replica: Replica, worker: WorkerInfo) -> None:
        if replica.stages:                        # across two dies (split_placement.py)
            return await split_placement.load(self, model, replica, worker)
        try:
            async with self.upload_lock:
                if not worker.alive:
                    raise WorkerLost("worker gone before its turn to load")
                log.info("loading %s (%s) on die %s (reason: %s)", model.name,
                         replica.model_id, worker.die, replica.reason)
                loaded = await self.pool.load(worker, p.Load(
                    replica.model_id, replica.path or model.path, model.name,
                    replica.want_slots or self.slots,
                    replica.want_ctx or self.ctx, self.prefill_chunk,
                    replica.want_quantize or self.quantize,
                    replica.want_spec if replica.want_spec is not None else self.spec,
                    activations=replica.want_activations or self.activations,
                    kv_cache_k=replica.want_kv.over(self.kv_cache).k,
                    kv_cache_v=replica.want_kv.over(self.kv_cache).v))
        except LoadError as exc:
            replica.state, replica.error = ReplicaState.FAILED, str(exc)
            replica.error_code = exc.code
            log.error("loading %s on die %s failed: %s", model.name, worker.die, exc)
            self.count(model.name, "failed", reason=replica.reason)
            return
        except (WorkerLost, asyncio.TimeoutError) as exc:
            replica.state, replica.error = ReplicaState.PLACED, str(exc)
            log.warning("loading %s on die %s interrupted: %s", model.name, worker.die, exc)
            self.count(model.name, "interrupted", reason=replica.reason)
            return
        finally:
            replica.progress = self.pool.progress.pop(replica.model_id, replica.progress)
            self.changed()
        replica.state, replica.worker = ReplicaState.READY, worker
        replica.loads += 1
        replica.reserved = loaded.weight_bytes + loaded.kv_bytes     # the real figure now
        replica.weight_bytes = loaded.weight_bytes
        replica.slots, replica.ctx, replica.error = loaded.slots, loaded.ctx, ""
        replica.spec = loaded.spec
        replica.activations = loaded.activations
        self.pool.changed()                       # queued requests may start now
        self.changed()
        log.info("%s ready on die %s: %d slots x %d ctx, loaded in %.1f s", model.name,
                 worker.die, loaded.slots, loaded.ctx, loaded.load_s)
        self.count(model.name, "loaded", loaded.load_s, replica.reason)

    def count(self, name: str, outcome: str, seconds: float | None = None,
              reason: str = "start") -> None:
        if self.metrics is not None:
            self.metrics.loads.labels(name, outcome, reason).inc()
            if seconds is not None:
                self.metrics.load_seconds.labels(name).observe(seconds)

    def spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def settled(self) -> bool:
        """Every replica is ready or has failed (startup is over)."""
        return all(r.state in (ReplicaState.READY, ReplicaState.FAILED)
                   for _, r in self.registry.replicas())

    async def wait_settled(self) -> None:
        """Return once settled(): woken by each load's end, not by polling."""
        while not self.settled():
            self.change.clear()
            await self.change.wait()

    async def close(self) -> None:
        """Cancel the loads in flight and the placement timer (shutdown)."""
        self.grace.cancel()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
