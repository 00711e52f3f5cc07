"""Admission: slots now, a place in a FIFO queue, or a clear refusal.

Per served model, as the spec's D1/D3 describe. Which replica a request
group goes to is the router's choice (router.py); admission only queues and
admits. Fast path: no one is queued, the router finds a replica with room for
the group, and memory pressure is below critical. Otherwise the request waits,
in order, up to `timeout_s`:
  queue full            → 429 with Retry-After: 5 (503 when pressure is critical)
  waited too long       → 429 with Retry-After: 2
  shutting down         → 503 with Retry-After (a drain: queued ones still run)
A model in single-user mode (every replica has one slot) never queues: a
second concurrent request gets an immediate 429, as in the spec.
Every decision happens before any SSE header is sent.
"""
from __future__ import annotations

import asyncio
import time
from collections import defaultdict, deque

import psutil

from ..common import settings
from ..common.protocol import CRITICAL, pressure_level
from .drain import shutting_down
from .errors import APIError
from .registry import Replica, ServedModel
from .router import Router


def host_pressure() -> int:
    """This host's memory pressure, read now (workers' figures may be 0.5 s old)."""
    vm = psutil.virtual_memory()
    return pressure_level(vm.available, vm.total)


class Admission:
    def __init__(self, depth: int = settings.QUEUE_DEPTH,
                 timeout_s: float = settings.QUEUE_TIMEOUT_S, pressure=host_pressure,
                 router: Router | None = None, max_request_slots: int = 0):
        self.depth, self.timeout_s, self.host_pressure = depth, timeout_s, pressure
        self.max_request_slots = max_request_slots      # 0: half a replica's slots
        self.router = router or Router()
        self.queues: dict[str, deque[asyncio.Future]] = defaultdict(deque)
        self.models: dict[str, ServedModel] = {}
        self.draining = False          # no new requests; the queued ones still get slots
        self.closed = False

    def pressure(self, model: ServedModel) -> int:
        workers = [r.worker.pressure for r in model.ready() if r.worker is not None]
        return max([self.host_pressure()] + workers)

    def take(self, replica: Replica, session: str | None, n: int) -> Replica:
        replica.inflight += n
        replica.served += n
        replica.last_used = time.monotonic()
        replica.idle.clear()
        self.router.routed(replica, session)
        return replica

    def share(self, model: ServedModel, n: int) -> int:
        """How many of a request's `n` choices may hold slots at once: at most half the
        largest replica's slots (or `max_request_slots`), at least 1. The others wait for
        one of these to end and then queue behind everyone else (`admitted=True`)."""
        slots = max((max(r.slots, 1) for r in model.ready()), default=1)
        return max(1, min(n, self.max_request_slots or slots // 2))

    def queued(self, model: ServedModel) -> int:
        return len(self.queues[model.name])

    async def acquire(self, model: ServedModel, session: str | None = None,
                      n: int = 1, admitted: bool = False,
                      prefer: Replica | None = None, need: int = 0) -> Replica:
        """One replica with `n` slots reserved for a request group whose sequences take
        `need` positions each (release() gives each back). `admitted`: a later choice of a
        request already let in (see share()): it queues like any request, but never meets
        the queue's depth or deadline; `prefer`: its first choices' replica (their prompt
        is warm there), when it fits."""
        if self.closed or (self.draining and not admitted):
            raise shutting_down()
        largest = max((r.ctx for r in model.ready()), default=0)
        if largest and need > largest:    # the replica that held it went away meanwhile
            raise APIError(400, f"This model's maximum context length is {largest} tokens, "
                           f"but the request needs {need}", code="context_length_exceeded")
        self.models[model.name] = model
        queue = self.queues[model.name]
        replica, pressure = self.router.pick(model, session, n, need), self.pressure(model)
        if prefer is not None and any(r is prefer for r in model.ready()) \
                and prefer.ctx >= need and self.router.fits(prefer, n) \
                and (prefer.worker is None or not prefer.worker.slow):
            replica = prefer
        if replica is not None and not queue and pressure < CRITICAL:
            return self.take(replica, session, n)
        if admitted:
            return await self.wait(model, queue, session, n, need, None)
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
        return await self.wait(model, queue, session, n, need, self.timeout_s)

    async def wait(self, model: ServedModel, queue: deque, session: str | None, n: int,
                   need: int, timeout_s: float | None) -> Replica:
        fut = asyncio.get_running_loop().create_future()
        fut.session, fut.n, fut.need = session, n, need
        queue.append(fut)
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            raise APIError(429, f"no slot became free within {self.timeout_s:g} s; retry "
                           "shortly", type="rate_limit_error", code="queue_timeout",
                           headers={"Retry-After": "2"}) from None
        except asyncio.CancelledError:
            # cancelled as the slots were handed over: give them back, or they leak
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                for _ in range(n):
                    self.release(model, fut.result())
            raise
        finally:
            if fut in queue:
                queue.remove(fut)

    def release(self, model: ServedModel, replica: Replica) -> None:
        """One choice of a group is over: its slot goes back."""
        replica.inflight -= 1
        replica.last_used = time.monotonic()
        if replica.inflight == 0:
            replica.idle.set()                    # an unload waiting for the drain goes on
        self.wake(model)

    def wake(self, model: ServedModel) -> None:
        """Hand free slots to the longest-waiting requests, in order."""
        queue = self.queues[model.name]
        while queue:
            if queue[0].done():                   # timed out or cancelled
                queue.popleft()
                continue
            replica = self.router.pick(model, queue[0].session, queue[0].n, queue[0].need)
            if replica is None or self.pressure(model) >= CRITICAL:
                return
            fut = queue.popleft()
            fut.set_result(self.take(replica, fut.session, fut.n))

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

    def drain(self) -> None:
        self.draining = True

    def close(self) -> None:
        """Shutting down: every queued request gets a 503 now."""
        self.closed = True
        for queue in self.queues.values():
            while queue:
                fut = queue.popleft()
                if not fut.done():
                    fut.set_exception(shutting_down())

