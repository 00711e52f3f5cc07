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
from collections import OrderedDict, defaultdict, deque

import psutil

from ..common.protocol import CRITICAL, pressure_level
from ..common import settings
from .openai_api import APIError
from .registry import Replica, ServedModel


def host_pressure() -> int:
    """This host's memory pressure, read now (workers' figures may be 0.5 s old)."""
    vm = psutil.virtual_memory()
    return pressure_level(vm.available, vm.total)


class Admission:
    AFFINITY_SESSIONS = 10000      # sessions whose replica is remembered (LRU)

    def __init__(self, depth: int = settings.QUEUE_DEPTH,
                 timeout_s: float = settings.QUEUE_TIMEOUT_S, pressure=host_pressure):
        self.depth, self.timeout_s, self.host_pressure = depth, timeout_s, pressure
        self.queues: dict[str, deque[asyncio.Future]] = defaultdict(deque)
        self.models: dict[str, ServedModel] = {}
        self.affinity: OrderedDict[str, str] = OrderedDict()    # session → replica id
        self.closed = False

    def pressure(self, model: ServedModel) -> int:
        workers = [r.worker.pressure for r in model.ready() if r.worker is not None]
        return max([self.host_pressure()] + workers)

    def free_replica(self, model: ServedModel, session: str | None = None) -> Replica | None:
        """A ready replica with a free slot: the session's own (its warm prefix lives
        there) unless that one is saturated, else the one with the fewest in flight.
        Replicas on a slow worker are left out while another replica can serve."""
        ready = model.ready()
        fast = [r for r in ready if r.worker is None or not r.worker.slow]
        free = [r for r in (fast or ready) if r.inflight < max(r.slots, 1)]
        home = self.affinity.get(session) if session else None
        for r in free:
            if r.model_id == home:
                return r
        return min(free, key=lambda r: r.inflight) if free else None

    def take(self, replica: Replica, session: str | None) -> Replica:
        replica.inflight += 1
        replica.served += 1
        if session:
            self.affinity[session] = replica.model_id
            self.affinity.move_to_end(session)
            while len(self.affinity) > self.AFFINITY_SESSIONS:
                self.affinity.popitem(last=False)
        return replica

    def queued(self, model: ServedModel) -> int:
        return len(self.queues[model.name])

    async def acquire(self, model: ServedModel, session: str | None = None) -> Replica:
        """A replica with a slot reserved for this request (release() gives it back)."""
        if self.closed:
            raise shutting_down()
        self.models[model.name] = model
        queue = self.queues[model.name]
        replica, pressure = self.free_replica(model, session), self.pressure(model)
        if replica is not None and not queue and pressure < CRITICAL:
            return self.take(replica, session)
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
        fut.session = session
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
            replica = self.free_replica(model, queue[0].session)
            if replica is None or self.pressure(model) >= CRITICAL:
                return
            fut = queue.popleft()
            fut.set_result(self.take(replica, fut.session))

    def wake_all(self) -> None:
        """Something changed (a replica became ready, pressure dropped): recheck."""
        for model in self.models.values():
            self.wake(model)

    def fail_waiters(self, model: ServedModel, message: str) -> None:
        """The model has no replica left to wait for: tell its queue now."""
        queue = self.queues[model.name]
        while queue:
            fut = queue.popleft()
            if not fut.done():
                fut.set_exception(APIError(503, message, type="service_unavailable",
                                           code="model_unloaded"))

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
