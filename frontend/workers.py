"""The frontend's ZeroMQ link to its workers.

One ROUTER socket, bound on loopback unless the operator says otherwise;
workers connect to it. This module knows which workers are alive, routes
every worker message to whoever waits for it (a request's token stream, a
load), and fails a dead worker's requests at once instead of leaving them
to hang.

Who may join: a worker this frontend spawned proves itself with the secret it was
handed at spawn (its hello carries it back, bound to its die and pid); any other
worker only when the link is CURVE (ZAP has already judged its key) or `--insecure`
opened it. A hello for a die whose worker is alive never displaces it: it is refused,
unless that worker's connection has dropped (a probe says so), as a restarted one's
has. Identities are 128-bit random, so nobody takes over a worker's connection.

A worker is *ready*, *slow* or *lost*. Busy is not dead: a worker whose step
runs long (its heartbeat thread says so) or that falls silent past
`slow_after_s` is slow: it keeps its requests and gets no new ones while
another replica can serve. Silence is probed: a ping to its heartbeat socket is
answered at once by a live process. A worker is lost when its connection drops (a
probe fails to reach it), when a spawned one's process exits, or after `lost_after_s`
of silence with every probe unanswered (hung, or SIGSTOPped); a spawned one hung like
that is killed, and its supervisor starts it again. A full send queue is never a
loss: a send to a busy worker waits its turn.

Every request gets an answer: a worker acknowledges each Generate it takes
(Accepted) or refuses it with an Error naming it; one that is still
unanswered after `answer_deadline_s` during which its worker was not slow (so
its loop read the message) fails with an error instead of waiting for ever.
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

from ..common import limits
from ..common import protocol as p
from ..common import settings
from ..common.keys import KeyPair, curve_server

log = logging.getLogger("pantheon.frontend.workers")


class WorkerLost(Exception):
    """The worker running a request or a load went away."""


class LoadError(Exception):
    """A worker could not load a model; the message says why, `code` what kind of failure
    (protocol.BAD_MODEL_FILE: the file's own; OUT_OF_MEMORY: its die's memory ran out)."""

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
    probed_at: float = 0.0         # the last probe of a silent worker
    # sends to one worker go one at a time, in order (a Generate before its Abort)
    sending: asyncio.Lock = field(default_factory=asyncio.Lock)

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
        self.waited = 0.0          # seconds without an answer while its worker was not slow

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
    PROBE_AFTER_S = 2 * p.HEARTBEAT_S    # silence after which a worker is probed
    PROBE_EVERY_S = 2 * p.HEARTBEAT_S    # and again this often while it stays silent

    ANSWER_DEADLINE_S = 30.0     # a Generate unanswered this long (worker not slow): failed

    def __init__(self, address: str, slow_after_s: float = 5.0, lost_after_s: float = 60.0,
                 curve: KeyPair | None = None,
                 stream_buffer_tokens: int = settings.STREAM_BUFFER_TOKENS,
                 answer_deadline_s: float = ANSWER_DEADLINE_S,
                 external: bool | None = None):
        self.address, self.slow_after_s, self.lost_after_s = address, slow_after_s, lost_after_s
        self.stream_buffer_tokens = stream_buffer_tokens
        self.losses: dict[str, int] = {}       # die → workers lost there (each restarted)
        self.answer_deadline_s = answer_deadline_s
        self.unanswered: dict[str, RequestStream] = {}   # sent, no word from the worker yet
        # workers without a spawn proof may join: CURVE judged their key, or --insecure
        self.external = curve is not None if external is None else external
        self.keyed = curve is not None      # the fleet uses keys: tcp stage links are CURVE
        if self.external and curve is None:
            log.warning("--insecure: the worker link takes workers without keys: any "
                        "process on this host can join as a worker for a die that has none")
        self.ctx = zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.MAXMSGSIZE, limits.FROM_WORKER.max_bytes)   # larger: dropped
        if curve is not None:        # only workers whose key ZAP allows get through
            curve_server(self.sock, curve, "workers")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # sending to a gone peer raises
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)    # a reconnecting worker takes over
        self.sock.bind(address)
        # proof → (die, pid) of each worker process the supervisor spawned and runs
        self.spawn_proofs: dict[str, tuple[str, int]] = {}
        self.strangers: set[bytes] = set()              # unknown peers already logged
        self.refused: set[bytes] = set()                # refused hellos already logged
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
        self.on_hung: list[Callable[[WorkerInfo], None]] = []   # a spawned one to kill
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
        """Send `msg` to `worker`, in order with its other messages. A full queue (the
        worker is inside a long step, its high-water mark reached) is not a loss: the
        send waits its turn for as long as the worker lives. Only a connection that is
        gone (EHOSTUNREACH) loses the worker here."""
        frames, delay = [worker.ident, p.encode(msg)], 0.005
        async with worker.sending:
            while True:
                if not worker.alive:
                    raise WorkerLost(f"the worker for die {worker.die} went away "
                                     f"({worker.lost_reason})")
                try:
                    await self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
                    return
                except zmq.Again:
                    await asyncio.sleep(delay)          # busy, not lost
                    delay = min(delay * 2, 0.1)
                except zmq.ZMQError as exc:   # EHOSTUNREACH: the peer disconnected
                    self.lose(worker, f"send failed: {exc}")
                    raise WorkerLost(f"worker for die {worker.die} is unreachable") from exc

    async def generate(self, worker: WorkerInfo, msg: p.Generate) -> RequestStream:
        stream = RequestStream(msg.request_id, worker)
        self.streams[msg.request_id] = stream
        self.unanswered[msg.request_id] = stream
        worker.requests.add(msg.request_id)
        try:
            await self.send(worker, msg)
        except (WorkerLost, p.ProtocolError):    # lost, or a message the wire refuses
            self.release(msg.request_id)
            raise
        return stream

    def release(self, request_id: str) -> None:
        """Forget a request's stream (finished, failed or abandoned)."""
        stream = self.streams.pop(request_id, None)
        self.unanswered.pop(request_id, None)
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
                msg = p.decode(data, limits.FROM_WORKER)
            except p.ProtocolError as exc:
                log.warning("refused a message from %r: %s", ident[:64], exc)
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
        elif isinstance(msg, p.Accepted):
            self.unanswered.pop(msg.request_id, None)
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
        spawned = self.spawn_proofs.get(msg.proof) == (msg.die, msg.pid) if msg.proof else False
        if not spawned and not self.external:
            self.refuse(ident, msg, "it is not a worker this frontend spawned, and external "
                        "workers need CURVE keys (serve --keys DIR, worker --keys DIR) or "
                        "serve --insecure" if not msg.proof else "its spawn proof is wrong")
            return
        old = self.workers.get(ident)
        if old is not None and old.alive and old.hello.pid == msg.pid and old.die == msg.die:
            old.hello, old.last_seen = msg, now    # the same process, introducing itself
            return                                  # again (after queued heartbeats)
        holder = next((w for w in self.workers.values()
                       if w.alive and (w is old or w.die == msg.die)), None)
        if holder is not None:        # never displaced by a hello: unless it is gone
            self.own(asyncio.ensure_future(self.contest(ident, msg, holder)))
            return
        self.join(ident, msg, now, spawned)

    async def contest(self, ident: bytes, msg: p.Hello, holder: WorkerInfo) -> None:
        """A hello for a die whose worker is alive: let the newcomer in only if the
        holder's connection has dropped (a restarted worker's has); refuse it otherwise."""
        if holder.alive and await self.reachable(holder):
            self.refuse(ident, msg, f"die {holder.die} has a live worker (pid "
                        f"{holder.hello.pid})")
            return
        self.lose(holder, "its connection dropped")
        self.hello(ident, msg, time.monotonic())

    def refuse(self, ident: bytes, msg: p.Hello, why: str) -> None:
        """Refuse a hello: logged once per peer, and said to the peer every time."""
        if ident not in self.refused and len(self.refused) < 1024:
            self.refused.add(ident)
            log.warning("refused a hello for die %s (pid %d) from peer %r: %s", msg.die,
                        msg.pid, ident[:64], why)
        self.spawn_send(ident, p.Error(f"hello refused: {why}", code="refused"))

    def join(self, ident: bytes, msg: p.Hello, now: float, spawned: bool) -> None:
        info = WorkerInfo(ident, msg, now, spawned=spawned)
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
        """Send without waiting: a gone peer or a full queue drops the message. (Every
        send here is non-blocking: one blocked send would hold up all that follow it, to
        every worker.)"""
        task = asyncio.ensure_future(self.sock.send_multipart([ident, p.encode(msg)],
                                                              flags=zmq.NOBLOCK))
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
        self.unanswered.pop(request_id, None)
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
            self.check_answers(0.25)
            now = time.monotonic()
            for worker in [w for w in self.workers.values() if w.alive]:
                silent = worker.silent_s(now)
                if silent > self.lost_after_s:   # every probe since went unanswered
                    self.lose(worker, f"no heartbeat for {silent:.1f} s and no answer to "
                              "a probe" + (": killed, to be restarted" if worker.spawned
                                           else ""))
                    if worker.spawned:
                        for callback in self.on_hung:
                            callback(worker)
                    continue
                if silent > self.PROBE_AFTER_S and now - worker.probed_at >= self.PROBE_EVERY_S:
                    worker.probed_at = now
                    if not await self.reachable(worker):
                        self.lose(worker, "connection dropped")
                        continue
                    self.ping_heartbeats(worker)
                self.check_slow(worker, now)

    def check_answers(self, elapsed: float) -> None:
        """Fail the requests a worker has not answered within the deadline, counting only
        time while it was not slow: a worker between steps reads what was sent, and answers
        it at once, so silence then means the message was lost or never understood."""
        for request_id, stream in list(self.unanswered.items()):
            if not stream.worker.alive or stream.worker.slow:
                continue
            stream.waited += elapsed
            if stream.waited < self.answer_deadline_s:
                continue
            del self.unanswered[request_id]
            log.warning("request %s: no answer from the worker for die %s in %g s",
                        request_id, stream.worker.die, self.answer_deadline_s)
            stream.put(p.Error(f"the worker for die {stream.worker.die} did not answer the "
                               f"request within {self.answer_deadline_s:g} s",
                               code="no_answer", request_id=request_id))
            self.abort_soon(request_id)

    async def reachable(self, worker: WorkerInfo) -> bool:
        """False when the worker's connection is gone: a dropped connection (its process
        died, its host went away) fails the send at once (ROUTER_MANDATORY). A full queue
        is a live worker that is not reading: reachable."""
        try:
            await self.sock.send_multipart([worker.ident, p.encode(p.Ping())],
                                           flags=zmq.NOBLOCK)
        except zmq.Again:
            return True
        except zmq.ZMQError:
            return False
        return True

    def ping_heartbeats(self, worker: WorkerInfo) -> None:
        """Ask the worker's heartbeat thread for a beat now: a live process answers
        whatever its loop is doing; a hung or stopped one stays silent."""
        self.spawn_send(worker.ident + p.HEARTBEAT_SUFFIX, p.Ping())

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

    def expect(self, proof: str, die: str, pid: int) -> None:
        """The supervisor spawned `pid` for `die` and handed it `proof`."""
        self.spawn_proofs[proof] = (die, pid)

    def process_exited(self, pid: int, code: int | None) -> None:
        """A spawned worker process ended: lose it now rather than at its timeout (its
        successor then joins in its place)."""
        for worker in list(self.workers.values()):
            if worker.alive and worker.spawned and worker.hello.pid == pid:
                self.lose(worker, f"process exited with code {code}")

    def lose(self, worker: WorkerInfo, reason: str) -> None:
        if not worker.alive:
            return
        worker.alive, worker.slow, worker.lost_reason = False, False, reason
        self.losses[worker.die] = self.losses.get(worker.die, 0) + 1
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
