"""The frontend's ZeroMQ link to its workers.

One ROUTER socket, bound on loopback unless the operator says otherwise;
workers connect to it. This module knows which workers are alive (hello,
heartbeats, process exits), routes every worker message to whoever waits
for it (a request's token stream, a load), and fails a dead worker's
requests at once instead of leaving them to hang.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import zmq
import zmq.asyncio

from ..common import protocol as p

log = logging.getLogger("pantheon.frontend.workers")


class WorkerLost(Exception):
    """The worker running a request or a load went away."""


class LoadError(Exception):
    """A worker could not load a model; the message says why."""


@dataclass
class WorkerInfo:
    ident: bytes
    hello: p.Hello
    last_seen: float
    heartbeat: p.Heartbeat | None = None
    alive: bool = True
    requests: set[str] = field(default_factory=set)

    @property
    def die(self) -> str:
        return self.hello.die

    @property
    def pressure(self) -> int:
        return self.heartbeat.pressure if self.heartbeat else 0


class RequestStream:
    """Messages for one request: Tokens, Error, or WorkerLost, in order."""

    def __init__(self, request_id: str, worker: WorkerInfo):
        self.request_id, self.worker = request_id, worker
        self.queue: asyncio.Queue = asyncio.Queue()

    async def next(self):
        item = await self.queue.get()
        if isinstance(item, Exception):
            raise item
        return item


class WorkerPool:
    def __init__(self, address: str, dead_after_s: float = 5.0):
        self.address, self.dead_after_s = address, dead_after_s
        self.ctx = zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # sending to a gone peer raises
        self.sock.bind(address)
        self.workers: dict[bytes, WorkerInfo] = {}
        self.streams: dict[str, RequestStream] = {}
        self.loads: dict[str, asyncio.Future] = {}
        self.progress: dict[str, tuple[int, int]] = {}   # model id → (done, total) layers
        self.unloads: dict[str, asyncio.Future] = {}
        self.on_join: list[Callable[[WorkerInfo], None]] = []
        self.on_lost: list[Callable[[WorkerInfo], None]] = []
        self.on_change: list[Callable[[], None]] = []   # load or capacity may have changed
        self.ids = itertools.count()
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self.receive_loop(), name="zmq-receive"),
                      asyncio.create_task(self.liveness_loop(), name="worker-liveness")]

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.sock.close(0)

    # -- sending -----------------------------------------------------------------------
    async def send(self, worker: WorkerInfo, msg) -> None:
        try:
            await self.sock.send_multipart([worker.ident, p.encode(msg)])
        except zmq.ZMQError as exc:   # EHOSTUNREACH: the peer disconnected
            self.lose(worker, f"send failed: {exc}")
            raise WorkerLost(f"worker for die {worker.die} is unreachable") from exc

    async def generate(self, worker: WorkerInfo, msg: p.Generate) -> RequestStream:
        stream = RequestStream(msg.request_id, worker)
        self.streams[msg.request_id] = stream
        worker.requests.add(msg.request_id)
        try:
            await self.send(worker, msg)
        except WorkerLost:
            self.release(msg.request_id)
            raise
        return stream

    def release(self, request_id: str) -> None:
        """Forget a request's stream (finished, failed or abandoned)."""
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            stream.worker.requests.discard(request_id)

    async def abort(self, request_id: str) -> None:
        stream = self.streams.get(request_id)
        self.release(request_id)
        if stream is not None and stream.worker.alive:
            try:
                await self.send(stream.worker, p.Abort(request_id))
            except WorkerLost:
                pass

    @staticmethod
    def waiter(worker: WorkerInfo) -> asyncio.Future:
        """A future for a worker's answer; failed if that worker is lost first."""
        fut = asyncio.get_running_loop().create_future()
        fut.worker = worker
        return fut

    def abort_soon(self, request_id: str) -> None:
        """abort() from code that cannot await (a cancelled stream's cleanup)."""
        if request_id in self.streams:
            asyncio.get_running_loop().create_task(self.abort(request_id))

    async def load(self, worker: WorkerInfo, msg: p.Load, timeout: float = 1800) -> p.Loaded:
        fut = self.waiter(worker)
        self.loads[msg.model_id] = fut
        try:
            await self.send(worker, msg)
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.loads.pop(msg.model_id, None)

    async def unload(self, worker: WorkerInfo, model_id: str, timeout: float = 30) -> None:
        fut = self.waiter(worker)
        self.unloads[model_id] = fut
        try:
            await self.send(worker, p.Unload(model_id))
            await asyncio.wait_for(fut, timeout)
        finally:
            self.unloads.pop(model_id, None)

    # -- receiving -----------------------------------------------------------------------
    async def receive_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            if len(frames) != 2:
                log.warning("dropped a message of %d frames", len(frames))
                continue
            ident, data = frames
            try:
                msg = p.decode(data)
            except p.ProtocolError as exc:
                log.warning("refused a message from %r: %s", ident, exc)
                continue
            try:
                self.dispatch(ident, msg)
            except Exception:  # one bad message must not stop the link
                log.exception("handling %s failed", type(msg).__name__)

    def dispatch(self, ident: bytes, msg) -> None:
        now = time.monotonic()
        if isinstance(msg, p.Hello):
            old = self.workers.get(ident)
            if old is not None and old.alive and old.hello.pid == msg.pid:
                old.hello, old.last_seen = msg, now    # the same process, introducing itself
                return                                  # again (after queued heartbeats)
            for other in list(self.workers.values()):   # one worker per die: a newcomer
                if other.alive and (other is old or other.die == msg.die):   # replaces it
                    self.lose(other, f"replaced by a new worker (pid {msg.pid})")
            info = WorkerInfo(ident, msg, now)
            self.workers[ident] = info
            log.info("worker joined: die %s (%s, %s), pid %d", msg.die, msg.kind,
                     msg.device_name, msg.pid)
            for callback in self.on_join:
                callback(info)
            return
        worker = self.workers.get(ident)
        if worker is None or not worker.alive:
            # a worker we lost (or never met) is still talking: make it introduce itself
            asyncio.ensure_future(self.sock.send_multipart(
                [ident, p.encode(p.Error("unknown worker: send hello", code="unknown_worker"))]))
            return
        worker.last_seen = now
        if isinstance(msg, p.Heartbeat):
            worker.heartbeat = msg
            self.changed()
        elif isinstance(msg, p.Tokens):
            self.deliver(msg.request_id, msg)
        elif isinstance(msg, p.Error):
            if msg.request_id:
                self.deliver(msg.request_id, msg)
            else:
                log.warning("worker %s reports: %s (%s)", worker.die, msg.message, msg.code)
        elif isinstance(msg, p.Loaded):
            self.resolve(self.loads, msg.model_id, msg)
        elif isinstance(msg, p.LoadProgress):
            self.progress[msg.model_id] = (msg.done, msg.total)
        elif isinstance(msg, p.LoadFailed):
            fut = self.loads.get(msg.model_id)
            if fut is not None and not fut.done():
                fut.set_exception(LoadError(msg.message))
        elif isinstance(msg, p.Unloaded):
            self.resolve(self.unloads, msg.model_id, msg)
        elif isinstance(msg, p.Stopping):
            self.lose(worker, "stopping")
        else:
            log.warning("unexpected %s from worker %s", type(msg).__name__, worker.die)

    def changed(self) -> None:
        for callback in self.on_change:
            callback()

    @staticmethod
    def resolve(futures: dict, key: str, value) -> None:
        fut = futures.get(key)
        if fut is not None and not fut.done():
            fut.set_result(value)

    def deliver(self, request_id: str, msg) -> None:
        stream = self.streams.get(request_id)
        if stream is not None:        # else: finished or abandoned; late tokens are dropped
            stream.queue.put_nowait(msg)

    # -- liveness ------------------------------------------------------------------------
    async def liveness_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            for worker in list(self.workers.values()):
                if worker.alive and now - worker.last_seen > self.dead_after_s:
                    self.lose(worker, f"silent for {now - worker.last_seen:.1f} s")

    def process_exited(self, pid: int, code: int | None) -> None:
        """A spawned worker process ended: lose it now rather than at its timeout."""
        for worker in list(self.workers.values()):
            if worker.alive and worker.hello.pid == pid:
                self.lose(worker, f"process exited with code {code}")

    def lose(self, worker: WorkerInfo, reason: str) -> None:
        if not worker.alive:
            return
        worker.alive = False
        log.warning("worker for die %s lost: %s", worker.die, reason)
        error = WorkerLost(f"the worker for die {worker.die} went away ({reason})")
        for request_id in list(worker.requests):
            stream = self.streams.get(request_id)
            if stream is not None:
                stream.queue.put_nowait(error)
        worker.requests.clear()
        for futures in (self.loads, self.unloads):
            for fut in futures.values():
                if not fut.done() and fut.worker is worker:
                    fut.set_exception(error)
        for callback in self.on_lost:
            callback(worker)

    def live(self) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.alive]

    def new_request_id(self) -> str:
        return f"req-{next(self.ids)}"
