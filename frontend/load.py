"""An instance's live load, as the routers in front of several instances read it.

Counted from the frontend's own books (replicas' in-flight choices, the admission
queues), never by asking a worker: a router polls this every second or so, per
instance, and the answer must stay cheap while every slot is busy.

`load` counts waiting requests too, so backpressure shows before it sheds: a full
instance reads `capacity + queued`, rising with each request that has to wait, while
its queue still has room (a 429 only comes once `--queue-depth` are waiting). A
least-loaded router (vllm-router's power_of_two, SMG's) steers new sessions away then,
not after the first refusals have opened its circuit breaker.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from .admission import Admission
from .registry import Registry


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    running: int          # choices holding a slot now, all models
    waiting: int          # requests queued for a slot, all models
    capacity: int         # slots of the ready replicas, all models

    @property
    def load(self) -> int:
        return self.running + self.waiting

    def get_load(self) -> dict:
        """`GET /get_load`, the shape vllm-router's load poller reads (`load`)."""
        return {"load": self.load, "running": self.running, "waiting": self.waiting,
                "capacity": self.capacity}

    def v1_loads(self) -> dict:
        """`GET /v1/loads`, SGLang's shape: one entry per data-parallel rank (one here;
        the instance's replicas are routed inside it). `token_usage` is the share of
        slots in use, the closest figure to SGLang's KV-token share."""
        usage = self.running / self.capacity if self.capacity else 0.0
        return {"timestamp": time.time(), "loads": [{
            "dp_rank": 0, "num_running_reqs": self.running,
            "num_waiting_reqs": self.waiting, "num_total_reqs": self.load,
            "max_running_requests": self.capacity, "token_usage": round(usage, 4)}]}


def measure(registry: Registry, admission: Admission) -> InstanceLoad:
    running = capacity = 0
    # requests waiting for their model's load on request wait as in a queue (autoload.py)
    autoload = getattr(registry, "autoload", None)
    waiting = sum(autoload.waiting.values()) if autoload is not None else 0
    for model in registry.models.values():
        waiting += admission.queued(model)
        for replica in model.replicas:
            running += replica.inflight
        capacity += sum(max(r.slots, 1) for r in model.ready())
    return InstanceLoad(running, waiting, capacity)
