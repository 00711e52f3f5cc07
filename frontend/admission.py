"""Admission: a slot now, a place in a FIFO queue, or a clear refusal.

Per served model, as the spec's D1/D3 describe. Fast path: no one is
queued, a ready replica has a free slot, and memory pressure is below
critical. Otherwise the request waits, in order, up to `timeout_s`:
  queue full            → 429 with Retry-After: 5 (503 when pressure is critical)
  waited too long       → 429 with Retry-After: 2
  shutting down         → 503
A model in single-user mode (every replica has one slot) never queues: a
second concurrent request gets an immediate 429, as in the spec.
Every decision happens before any SSE header is sent.
"""
from __future__ import annotations

import asyncio
from collections import defaultdict, deque

import psutil

from ..common.protocol import CRITICAL, pressure_level
from .openai_api import APIError
from .registry import Replica, ServedModel


def host_pressure() -> int:
    """This host's memory pressure, read now (workers' figures may be 0.5 s old)."""
    vm = psutil.virtual_memory()
    return pressure_level(vm.available, vm.total)


class Admission:
    def __init__(self, depth: int = 32, timeout_s: float = 30.0, pressure=host_pressure):
        self.depth, self.timeout_s, self.host_pressure = depth, timeout_s, pressure
        self.queues: dict[str, deque[asyncio.Future]] = defaultdict(deque)
        self.models: dict[str, ServedModel] = {}
        self.closed = False

    def pressure(self, model: ServedModel) -> int:
        workers = [r.worker.pressure for r in model.ready() if r.worker is not None]
        return max([self.host_pressure()] + workers)

    @staticmethod
    def free_replica(model: ServedModel) -> Replica | None:
        free = [r for r in model.ready() if r.inflight < max(r.slots, 1)]
        return min(free, key=lambda r: r.inflight) if free else None

    def queued(self, model: ServedModel) -> int:
        return len(self.queues[model.name])

    async def acquire(self, model: ServedModel) -> Replica:
        """A replica with a slot reserved for this request (release() gives it back)."""
        if self.closed:
            raise shutting_down()
        self.models[model.name] = model
        queue = self.queues[model.name]
        replica, pressure = self.free_replica(model), self.pressure(model)
        if replica is not None and not queue and pressure < CRITICAL:
            replica.inflight += 1
            return replica
        if all(r.slots == 1 for r in model.ready()) and pressure < CRITICAL:
            raise APIError(429, "a generation is already in progress on this model "
                           "(single-user mode); retry shortly", type="rate_limit_error",
                           code="server_busy", headers={"Retry-After": "1"})
        if len(queue) >= self.depth:
            if pressure >= CRITICAL:
                raise APIError(503, "memory pressure is critical and the queue is full; "
                               "retry later", type="service_unavailable",
                               code="memory_pressure", headers={"Retry-After": "5"})
            raise APIError(429, f"all slots are busy and {len(queue)} requests are already "
                           "waiting; retry shortly", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": "5"})
        fut = asyncio.get_running_loop().create_future()
        queue.append(fut)
        try:
            return await asyncio.wait_for(fut, self.timeout_s)
        except asyncio.TimeoutError:
            raise APIError(429, f"no slot became free within {self.timeout_s:g} s; retry "
                           "shortly", type="rate_limit_error", code="queue_timeout",
                           headers={"Retry-After": "2"}) from None
        finally:
            if fut in queue:
                queue.remove(fut)

    def release(self, model: ServedModel, replica: Replica) -> None:
        replica.inflight -= 1
        self.wake(model)

    def wake(self, model: ServedModel) -> None:
        """Hand free slots to the longest-waiting requests, in order."""
        queue = self.queues[model.name]
        while queue:
            if queue[0].done():                   # timed out or cancelled
                queue.popleft()
                continue
            replica = self.free_replica(model)
            if replica is None or self.pressure(model) >= CRITICAL:
                return
            replica.inflight += 1
            queue.popleft().set_result(replica)

    def wake_all(self) -> None:
        """Something changed (a replica became ready, pressure dropped): recheck."""
        for model in self.models.values():
            self.wake(model)

    def close(self) -> None:
        self.closed = True
        for queue in self.queues.values():
            while queue:
                fut = queue.popleft()
                if not fut.done():
                    fut.set_exception(shutting_down())


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", type="service_unavailable",
                    code="shutting_down")
