"""The frontend's ZeroMQ link to its workers.

One ROUTER socket, bound on loopback unless the operator says otherwise;
workers connect to it. This module knows which workers are alive, routes
every worker message to whoever waits for it (a request's token stream, a
load), and fails a dead worker's requests at once instead of leaving them
to hang.

A worker is *ready*, *slow* or *lost*. Busy is not dead: a worker whose step
runs long (its heartbeat thread says so) or that falls silent past
`slow_after_s` is slow: it keeps its requests and gets no new ones while
another replica can serve. A spawned worker is judged by its process: lost
only when it exits. An external one is lost when its connection drops (a
probe fails to reach it) or after `lost_after_s` of silence.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable

import zmq
import zmq.asyncio

from ..common import protocol as p
from ..common import settings
from ..common.keys import KeyPair, curve_server

log = logging.getLogger("pantheon.frontend.workers")


class WorkerLost(Exception):
    """The worker running a request or a load went away."""


class LoadError(Exception):
    """A worker could not load a model; the message says why, `code` what kind of failure
    ("out_of_memory": its die's memory ran out)."""

    def __init__(self, message: str, code: str = ""):
        super().__init__(message)
        self.code = code


class WorkerState:
    READY = "ready"
    SLOW = "slow"          # alive, but silent or inside a long step: no new requests
    LOST = "lost"


@dataclass
class WorkerInfo:
    ident: bytes
    hello: p.Hello
    last_seen: float
    heartbeat: p.Heartbeat | None = None
    alive: bool = True
    requests: set[str] = field(default_factory=set)
    spawned: bool = False          # a process of ours: judged by its exit, not by silence
    slow: bool = False
    beat_at: float = 0.0           # when the last heartbeat arrived
    lost_reason: str = ""

    @property
    def die(self) -> str:
        return self.hello.die

    @property
    def pressure(self) -> int:
        return self.heartbeat.pressure if self.heartbeat else 0

    @property
    def state(self) -> str:
        return WorkerState.LOST if not self.alive else \
            WorkerState.SLOW if self.slow else WorkerState.READY

    def silent_s(self, now: float) -> float:
        return now - self.last_seen

    def step_s(self, now: float) -> float:
        """Age of the step in progress (0 when the last heartbeat saw the loop idle)."""
        beat = self.heartbeat
        if beat is None or beat.step_s <= 0:
            return 0.0
        return beat.step_s + (now - self.beat_at)

    def status(self) -> dict:
        now, beat = time.monotonic(), self.heartbeat
        return {"die": self.die, "pid": self.hello.pid, "kind": self.hello.kind,
                "device": self.hello.device_name, "state": self.state,
                "spawned": self.spawned,
                "heartbeat_age_s": round(self.silent_s(now), 2),
                "step_s": round(self.step_s(now), 2),
                "active": beat.active if beat else 0, "waiting": beat.waiting if beat else 0,
                "pressure": self.pressure, "in_flight": len(self.requests),
                **({"lost_reason": self.lost_reason} if not self.alive else {})}


class RequestStream:
    """Messages for one request: Tokens, Error, or WorkerLost, in order.

    `buffered` counts the tokens delivered and not yet taken: a client that stops
    reading its stream lets it grow until the pool aborts the request (`stalled`)."""

    def __init__(self, request_id: str, worker: WorkerInfo):
        self.request_id, self.worker = request_id, worker
        self.queue: asyncio.Queue = asyncio.Queue()
        self.buffered = 0
        self.stalled = asyncio.Event()

    def put(self, msg) -> int:
        """Queue `msg`; the tokens now buffered."""
        self.queue.put_nowait(msg)
        if isinstance(msg, p.Tokens):
            self.buffered += len(msg.tokens)
        return self.buffered

    async def next(self):
        item = await self.queue.get()
        if isinstance(item, Exception):
            raise item
        if isinstance(item, p.Tokens):
            self.buffered -= len(item.tokens)
        return item


class WorkerPool:
    PROBE_AFTER_S = 2 * p.HEARTBEAT_S    # silence after which an external link is probed

    def __init__(self, address: str, slow_after_s: float = 5.0, lost_after_s: float = 60.0,
                 curve: KeyPair | None = None,
                 stream_buffer_tokens: int = settings.STREAM_BUFFER_TOKENS):
        self.address, self.slow_after_s, self.lost_after_s = address, slow_after_s, lost_after_s
        self.stream_buffer_tokens = stream_buffer_tokens
        self.ctx = zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        if curve is not None:        # only workers whose key ZAP allows get through
            curve_server(self.sock, curve, "workers")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # sending to a gone peer raises
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)    # a reconnecting worker takes over
        self.sock.bind(address)
        self.spawned_pids: set[int] = set()             # kept by the supervisor
        self.strangers: set[bytes] = set()              # unknown peers already logged
        self.workers: dict[bytes, WorkerInfo] = {}
        self.joins: dict[str, int] = {}                 # die → worker processes that joined
        self.streams: dict[str, RequestStream] = {}
        self.loads: dict[str, asyncio.Future] = {}
        self.progress: dict[str, tuple[int, int]] = {}   # model id → (done, total) layers
        self.progress_queues: dict[str, asyncio.Queue] = {}   # loads someone watches
        self.unloads: dict[str, asyncio.Future] = {}
        self.on_join: list[Callable[[WorkerInfo], None]] = []
        self.on_lost: list[Callable[[WorkerInfo], None]] = []
        self.on_change: list[Callable[[], None]] = []   # load or capacity may have changed
        self.ids = itertools.count()
        self.id_prefix = secrets.token_hex(3)   # ids stay unique across frontend restarts
        self.tasks: list[asyncio.Task] = []
        self.pending: set[asyncio.Task] = set()   # fire-and-forget sends and aborts: owned

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self.receive_loop(), name="zmq-receive"),
                      asyncio.create_task(self.liveness_loop(), name="worker-liveness")]

    async def close(self) -> None:
        tasks = self.tasks + list(self.pending)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
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
            self.own(asyncio.ensure_future(self.abort(request_id)))

    def own(self, task: asyncio.Task) -> None:
        """Keep a reference to a task nobody awaits, until it ends (cancelled on close)."""
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    def watch_progress(self, model_id: str) -> asyncio.Queue:
        """A queue of this load's (done, total) as its worker reports them."""
        return self.progress_queues.setdefault(model_id, asyncio.Queue())

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
            self.hello(ident, msg, now)
            return
        beat = isinstance(msg, p.Heartbeat)
        owner = ident[:-len(p.HEARTBEAT_SUFFIX)] if ident.endswith(p.HEARTBEAT_SUFFIX) else None
        if beat != (owner is not None):
            self.stranger(ident, f"a {type(msg).__name__} from the wrong socket")
            return
        worker = self.workers.get(owner if beat else ident)
        if worker is None or not worker.alive or (beat and msg.pid != worker.hello.pid):
            # a worker we lost (or never met) is still talking: make it introduce itself
            self.stranger(ident, f"{type(msg).__name__} before a hello")
            self.spawn_send(ident, p.Error("unknown worker: send hello", code="unknown_worker"))
            return
        worker.last_seen = now
        if beat:
            worker.heartbeat, worker.beat_at = msg, now
            self.check_slow(worker, now)
            self.changed()
        elif isinstance(msg, p.Outputs):
            for tokens in msg.outputs:
                self.deliver(tokens.request_id, tokens)
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
            if msg.model_id in self.progress_queues:
                self.progress_queues[msg.model_id].put_nowait((msg.done, msg.total))
        elif isinstance(msg, p.LoadFailed):
            fut = self.loads.get(msg.model_id)
            if fut is not None and not fut.done():
                fut.set_exception(LoadError(msg.message, msg.code))
        elif isinstance(msg, p.Unloaded):
            self.resolve(self.unloads, msg.model_id, msg)
        elif isinstance(msg, p.Stopping):
            self.lose(worker, "stopping")
        else:
            log.warning("unexpected %s from worker %s", type(msg).__name__, worker.die)

    def hello(self, ident: bytes, msg: p.Hello, now: float) -> None:
        if ident.endswith(p.HEARTBEAT_SUFFIX):
            self.stranger(ident, "a hello from a heartbeat socket")
            return
        old = self.workers.get(ident)
        if old is not None and old.alive and old.hello.pid == msg.pid:
            old.hello, old.last_seen = msg, now    # the same process, introducing itself
            return                                  # again (after queued heartbeats)
        for other in list(self.workers.values()):   # one worker per die: a newcomer
            if other.alive and (other is old or other.die == msg.die):   # replaces it
                self.lose(other, f"replaced by a new worker (pid {msg.pid})")
        info = WorkerInfo(ident, msg, now, spawned=msg.pid in self.spawned_pids)
        self.workers[ident] = info
        self.joins[msg.die] = self.joins.get(msg.die, 0) + 1
        self.strangers.discard(ident + p.HEARTBEAT_SUFFIX)
        log.info("worker joined: die %s (%s, %s), pid %d%s", msg.die, msg.kind,
                 msg.device_name, msg.pid,
                 f", holding {', '.join(msg.models)}" if msg.models else "")
        for request_id in msg.running:           # requests it runs that nobody waits for
            if request_id not in self.streams:
                self.spawn_send(ident, p.Abort(request_id))
        for callback in self.on_join:
            callback(info)

    def stranger(self, ident: bytes, what: str) -> None:
        """Log a peer we do not know, once: it may be a worker that will say hello."""
        if ident not in self.strangers and len(self.strangers) < 1024:
            self.strangers.add(ident)
            log.info("dropped %s from peer %r", what, ident[:64])

    def spawn_send(self, ident: bytes, msg) -> None:
        task = asyncio.ensure_future(self.sock.send_multipart([ident, p.encode(msg)]))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())   # a gone peer
        self.own(task)

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
        if stream is None:            # finished or abandoned; late tokens are dropped
            return
        if stream.put(msg) > self.stream_buffer_tokens and not stream.stalled.is_set():
            # its client reads nothing: abort rather than hold its tokens without end
            # (the worker's batch never waits for a client either way)
            log.warning("aborted %s: its client left %d tokens unread (limit %d)",
                        request_id, stream.buffered, self.stream_buffer_tokens)
            stream.stalled.set()
            self.abort_soon(request_id)

    # -- liveness ------------------------------------------------------------------------
    async def liveness_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            for worker in [w for w in self.workers.values() if w.alive]:
                silent = worker.silent_s(now)
                if not worker.spawned and silent > self.lost_after_s:
                    self.lose(worker, f"silent for {silent:.1f} s")
                    continue
                if not worker.spawned and silent > self.PROBE_AFTER_S:
                    await self.probe(worker)
                self.check_slow(worker, now)

    async def probe(self, worker: WorkerInfo) -> None:
        """A dropped connection (the peer's process died, its host went away) fails the
        send at once (ROUTER_MANDATORY); a live but busy worker just queues the ping."""
        try:
            await asyncio.wait_for(self.sock.send_multipart(
                [worker.ident, p.encode(p.Ping())]), 1.0)
        except zmq.ZMQError as exc:
            self.lose(worker, f"connection dropped ({exc})")
        except asyncio.TimeoutError:
            pass                                 # its queue is full: alive, not reading

    def check_slow(self, worker: WorkerInfo, now: float) -> None:
        silent, step = worker.silent_s(now), worker.step_s(now)
        slow = worker.alive and max(silent, step) > self.slow_after_s
        if slow == worker.slow:
            return
        worker.slow = slow
        if slow:
            why = (f"a step in progress for {step:.1f} s" if step > self.slow_after_s
                   else f"silent for {silent:.1f} s")
            log.warning("worker for die %s is slow (%s): it keeps its %d request(s) and "
                        "gets new ones only when no other replica can serve", worker.die, why,
                        len(worker.requests))
        else:
            log.info("worker for die %s is ready again", worker.die)
            self.changed()                       # requests may be routed to it again

    def process_exited(self, pid: int, code: int | None) -> None:
        """A spawned worker process ended: lose it now rather than at its timeout."""
        for worker in list(self.workers.values()):
            if worker.alive and worker.hello.pid == pid:
                self.lose(worker, f"process exited with code {code}")

    def lose(self, worker: WorkerInfo, reason: str) -> None:
        if not worker.alive:
            return
        worker.alive, worker.slow, worker.lost_reason = False, False, reason
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

    def latest(self) -> list[WorkerInfo]:
        """One worker per die: the live one, else the last one seen."""
        by_die: dict[str, WorkerInfo] = {}
        for w in self.workers.values():
            if w.alive or w.die not in by_die or not by_die[w.die].alive:
                by_die[w.die] = w
        return sorted(by_die.values(), key=lambda w: w.die)

    def new_request_id(self) -> str:
        return f"req-{self.id_prefix}-{next(self.ids)}"
