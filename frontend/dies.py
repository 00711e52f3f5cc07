"""The die table and placement: which die has room for which replica.

Fed by worker hellos and heartbeats. Each die has a budget (the memory its
worker may give to models) and reservations: the bytes admitted for the
replicas placed on it, counted before any upload starts (weights plus KV
memory for a context guess, as the spec's VRAM admission does). The weights
are counted from the file's own tensor list, as the worker will hold them
(common/weight_format.py); once a replica is loaded, its reservation becomes
the bytes the worker reports.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..common.model_file import ModelConfig
from ..common.kv_cache import KVCacheTypes
from ..common.weight_format import kv_itemsize, weight_bytes
from .registry import Registry
from .workers import WorkerPool

ADMIT_CTX_GUESS = 8192     # the spec's MR_ADMIT_CTX_GUESS


class PlacementError(Exception):
    """No die can take the replica (status 507), or the request is malformed (400)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@lru_cache(maxsize=64)
def file_weight_bytes(path: str, quantize: str, dense_itemsize: int) -> int:
    return weight_bytes(path, quantize, dense_itemsize)


def replica_bytes(path: str, cfg: ModelConfig, kind: str, slots: int, ctx: int,
                  quantize: str = "auto", kv: KVCacheTypes = KVCacheTypes()) -> int:
    """Weights as the worker will hold them (dense ones fp32 on a CPU die, fp16 on a GPU)
    plus the sequence state of `slots` slots of the context (or the guess): KV per
    position (in the worker's dtype: common/weight_format.kv_itemsize), and any fixed
    per-slot state of recurrent layers."""
    itemsize = 4 if kind == "cpu" else 2
    guess = ctx or min(cfg.context_length, ADMIT_CTX_GUESS)
    return file_weight_bytes(str(path), quantize, itemsize) + \
        cfg.state_bytes(slots, guess, kv_itemsize(path, kind, quantize, kv))


def what_fits(path: str, cfg: ModelConfig, die: DieInfo, slots: int, ctx: int,
              quantize: str, kv: KVCacheTypes = KVCacheTypes()) -> str:
    """What would fit on `die` instead: the context at these slots, the slots at this
    context (the tail of a refusal)."""
    room = die.free_budget - file_weight_bytes(str(path), quantize, 4 if die.kind == "cpu" else 2)
    if room <= 0:
        return "; the weights alone do not fit"
    itemsize = kv_itemsize(path, die.kind, quantize, kv)
    per_token, fixed = cfg.kv_bytes_per_token(itemsize), cfg.fixed_bytes_per_slot()
    guess = ctx or min(cfg.context_length, ADMIT_CTX_GUESS)
    max_ctx = (room // slots - fixed) // per_token if per_token else 0
    max_slots = room // cfg.state_bytes(1, guess, itemsize)
    hints = [f"--ctx {max_ctx} with {slots} slots"] if max_ctx >= 2 else []
    hints += [f"--slots {max_slots} at {guess} positions"] if max_slots >= 1 else []
    return f"; what fits: {' or '.join(hints)}" if hints else ""


@dataclass
class DieInfo:
    die: str
    kind: str
    device: str
    alive: bool
    budget: int
    reserved: int
    mem_total: int
    mem_free: int
    models: list[str]
    worker: dict             # its worker's state: ready / slow / lost, heartbeat and step age
    rss: int = 0             # its worker's resident bytes (real use), beside `reserved`

    @property
    def free_budget(self) -> int:
        return self.budget - self.reserved

    def as_json(self) -> dict:
        return {"die": self.die, "kind": self.kind, "device": self.device, "alive": self.alive,
                "budget_bytes": self.budget, "used_bytes": self.reserved,
                "free_bytes": self.free_budget, "mem_total_bytes": self.mem_total,
                "mem_free_bytes": self.mem_free, "models": self.models,
                "state": self.worker["state"], "heartbeat_age_s": self.worker["heartbeat_age_s"],
                "step_s": self.worker["step_s"], "pid": self.worker["pid"],
                "rss_bytes": self.rss}


class DieTable:
    def __init__(self, registry: Registry, pool: WorkerPool, slots: int):
        self.registry, self.pool, self.slots = registry, pool, slots

    def snapshot(self) -> list[DieInfo]:
        dies: dict[str, DieInfo] = {}
        for w in self.pool.latest():
            beat = w.heartbeat
            dies[w.die] = DieInfo(w.die, w.hello.kind, w.hello.device_name, w.alive,
                                  w.hello.budget or w.hello.mem_total, 0,
                                  beat.mem_total if beat else w.hello.mem_total,
                                  beat.mem_free if beat else w.hello.mem_free, [], w.status(),
                                  beat.rss if beat else 0)
        for model, replica in self.registry.replicas():
            info = dies.get(replica.die)
            if info is not None:
                info.reserved += replica.reserved
                info.models.append(f"{model.name} ({replica.model_id}, {replica.state})")
            for stage in (replica.stages or [])[1:]:     # a split replica's second stage
                if (other := dies.get(stage.die)) is not None:
                    other.reserved += stage.reserved
                    other.models.append(f"{model.name} ({replica.model_id} layers "
                                        f"{stage.first_layer}-{stage.end_layer - 1}, "
                                        f"{replica.state})")
        return sorted(dies.values(), key=lambda d: d.die)

    def choose(self, path: str, cfg: ModelConfig, pinned: list[str] | None, slots: int,
               ctx: int, quantize: str = "auto",
               draft: tuple[str, ModelConfig] | None = None,
               kv: KVCacheTypes = KVCacheTypes()) -> tuple[str, int]:
        """(die, bytes to reserve) for a new replica; PlacementError if none fits."""
        if pinned is not None and len(pinned) != 1:
            raise PlacementError(400, "give one die here (two: frontend/split_placement.py)"
                                 f", got {pinned}")
        live = [d for d in self.snapshot() if d.alive]
        if pinned:
            live = [d for d in live if d.die == str(pinned[0])]
            if not live:
                raise PlacementError(507, f"die {pinned[0]!r} has no live worker")
        if not live:
            raise PlacementError(507, "no worker is connected")
        need = {d.die: replica_bytes(path, cfg, d.kind, slots or self.slots, ctx, quantize, kv)
                + (replica_bytes(draft[0], draft[1], d.kind, slots or self.slots,
                                 ctx or min(cfg.context_length, ADMIT_CTX_GUESS), quantize, kv)
                   if draft else 0)     # speculation's draft: its weights and its own KV
                for d in live}
        fits = [d for d in live if need[d.die] <= d.free_budget]
        if not fits:
            best = max(live, key=lambda d: d.free_budget)
            raise PlacementError(507, f"no die has room: the replica needs "
                                 f"{need[best.die] / 2**20:.0f} MiB (weights + KV for "
                                 f"{ctx or min(cfg.context_length, ADMIT_CTX_GUESS)} positions x "
                                 f"{slots or self.slots} slots); the most free is "
                                 f"{best.free_budget / 2**20:.0f} MiB on die {best.die}"
                                 + what_fits(path, cfg, best, slots or self.slots, ctx, quantize,
                                             kv))
        die = max(fits, key=lambda d: d.free_budget)
        return die.die, need[die.die]
