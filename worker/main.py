"""`pantheon worker`: one process per die, driven by the frontend over ZeroMQ.

The loop: receive messages → admit waiting requests → one scheduler step per
resident model → send the new tokens → heartbeat. Model loads run in a
thread, so the loop keeps serving (and heartbeating) during an upload; the
engine is handed back to the loop only when it is loaded and warm.

A malformed or unknown message is logged and answered with an Error; nothing
a peer sends can end this loop except Shutdown.
"""
from __future__ import annotations

import logging
import os
import queue
import secrets
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import psutil
import zmq
from zmq.utils.monitor import recv_monitor_message

from ..common import protocol as p
from .device import Device, open_device
from .engine import Engine, load_engine
from .sampler import SamplingParams
from .scheduler import Request

log = logging.getLogger("pantheon.worker")

HEARTBEAT_S = 0.5
IDLE_POLL_MS = 50


@dataclass
class Replica:
    """A resident model and the requests waiting for one of its slots."""

    model_id: str
    name: str
    path: str
    engine: Engine
    waiting: deque = field(default_factory=deque)
    constraints: object = None       # ConstraintFactory, built on the first grammar request

    def constraint(self, grammar: str):
        if self.constraints is None:  # needs the tokenizer: read it only when asked
            from ..common.tokenizer import open_tokenizer
            from .constraint import ConstraintFactory
            self.constraints = ConstraintFactory(open_tokenizer(self.path))
        return self.constraints.make(grammar)


class Worker:
    def __init__(self, device: Device, frontend: str, die: str, slots: int = 8,
                 prefix_cache_bytes: int = 0, parent_pid: int = 0, budget: int = 0):
        self.device, self.die, self.slots = device, die, slots
        self.parent_pid = parent_pid     # spawned by a frontend: live and die with it
        self.budget = budget
        self.prefix_cache_bytes = prefix_cache_bytes
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"{die}-{os.getpid()}-{secrets.token_hex(4)}".encode())
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED)
        self.sock.connect(frontend)
        self.replicas: dict[str, Replica] = {}
        self.owner: dict[str, Replica] = {}          # request id → replica
        self.loads: queue.Queue = queue.Queue()      # (model_id, name, engine | exception)
        self.loading: set[str] = set()
        self.running = True
        self.next_heartbeat = 0.0

    # -- edges ----------------------------------------------------------------------
    def send(self, msg) -> None:
        self.sock.send(p.encode(msg), copy=False)

    def hello(self) -> p.Hello:
        total, free = self.device.memory()
        return p.Hello(self.die, self.device.kind, self.device.name, total, free, self.slots,
                       os.getpid(), list(self.replicas), self.budget or total)

    def heartbeat(self) -> None:
        total, free = self.device.memory()
        host = psutil.virtual_memory()
        level = max(p.pressure_level(free, total),
                    p.pressure_level(host.available, host.total))
        active = sum(r.engine.scheduler.active() for r in self.replicas.values())
        waiting = sum(len(r.waiting) for r in self.replicas.values())
        self.send(p.Heartbeat(self.die, active, waiting, total, free, host.available, level))
        self.next_heartbeat = time.monotonic() + HEARTBEAT_S

    # -- the loop ---------------------------------------------------------------------
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while self.running:
            busy = any(r.engine.scheduler.active() or r.waiting for r in self.replicas.values())
            events = dict(poller.poll(0 if busy else IDLE_POLL_MS))
            if self.monitor in events:
                recv_monitor_message(self.monitor)
                self.send(self.hello())          # (re)connected: introduce ourselves
            while self.sock.poll(0, zmq.POLLIN):
                self.receive(self.sock.recv())
            self.finish_loads()
            for replica in list(self.replicas.values()):
                self.admit(replica)
                self.step(replica)
            if time.monotonic() >= self.next_heartbeat:
                self.heartbeat()
                if self.parent_pid and os.getppid() != self.parent_pid:
                    log.warning("the frontend that spawned this worker is gone; exiting")
                    self.running = False
        self.send(p.Stopping(self.die))
        self.sock.close()

    def receive(self, data: bytes) -> None:
        try:
            msg = p.decode(data)
        except p.ProtocolError as exc:
            log.warning("refused a message: %s", exc)
            self.send(p.Error(str(exc)))
            return
        handler = self.HANDLERS.get(type(msg))
        if handler is None:
            self.send(p.Error(f"a worker does not take {type(msg).__name__} messages",
                              code="unexpected"))
            return
        try:
            handler(self, msg)
        except Exception as exc:  # a bad message must never end the loop
            log.exception("handling %s failed", type(msg).__name__)
            self.send(p.Error(f"{type(msg).__name__} failed: {exc}", code="internal",
                              request_id=getattr(msg, "request_id", None)))

    # -- handlers ---------------------------------------------------------------------
    def on_generate(self, msg: p.Generate) -> None:
        replica = self.replicas.get(msg.model_id)
        if replica is None:
            self.send(p.Error(f"model {msg.model_id!r} is not loaded on die {self.die}",
                              code="unknown_model", request_id=msg.request_id))
            return
        if msg.request_id in self.owner:
            self.send(p.Error(f"request {msg.request_id} is already running",
                              code="duplicate", request_id=msg.request_id))
            return
        sched = replica.engine.scheduler
        try:
            params = SamplingParams(**{f: getattr(msg.sampling, f) for f in
                                       msg.sampling.__slots__}).check(replica.engine.cfg.vocab_size)
            if not msg.prompt or len(msg.prompt) >= sched.ctx:
                raise ValueError(f"prompt of {len(msg.prompt)} tokens does not fit the "
                                 f"context of {sched.ctx}")
            if msg.max_tokens < 1 or any(not 0 <= t < replica.engine.cfg.vocab_size
                                         for t in msg.prompt):
                raise ValueError("max_tokens must be >= 1 and token ids within the vocabulary")
        except (TypeError, ValueError) as exc:
            self.send(p.Error(str(exc), code="bad_request", request_id=msg.request_id))
            return
        try:
            constraint = replica.constraint(msg.grammar) if msg.grammar else None
        except (TypeError, ValueError) as exc:
            self.send(p.Error(f"invalid grammar: {exc}", code="bad_request",
                              request_id=msg.request_id))
            return
        replica.waiting.append(Request(msg.request_id, msg.prompt, params, msg.max_tokens,
                                       frozenset(msg.stop_ids), msg.session_id, constraint,
                                       min(msg.logprobs, 20)))
        self.owner[msg.request_id] = replica

    def on_abort(self, msg: p.Abort) -> None:
        replica = self.owner.pop(msg.request_id, None)
        if replica is None:
            return                                  # already finished: nothing to do
        out = replica.engine.scheduler.abort(msg.request_id)
        if out is None:                             # still waiting for a slot
            replica.waiting = deque(r for r in replica.waiting if r.id != msg.request_id)
        self.send(p.Tokens(msg.request_id, [], "abort",
                           out.prompt_tokens if out else 0, out.completion_tokens if out else 0))

    def on_load(self, msg: p.Load) -> None:
        if msg.model_id in self.replicas or msg.model_id in self.loading:
            self.send(self.loaded_message(self.replicas[msg.model_id])
                      if msg.model_id in self.replicas else p.Error("load already running",
                                                                    code="duplicate"))
            return
        self.loading.add(msg.model_id)
        threading.Thread(target=self.load_thread, args=(msg,), daemon=True,
                         name=f"load-{msg.model_id}").start()

    def on_unload(self, msg: p.Unload) -> None:
        replica = self.replicas.pop(msg.model_id, None)
        if replica is not None:
            for req_id in [r for r, rep in self.owner.items() if rep is replica]:
                self.owner.pop(req_id)
                self.send(p.Tokens(req_id, [], "abort"))
        self.send(p.Unloaded(msg.model_id))

    def on_shutdown(self, msg: p.Shutdown) -> None:
        self.running = False

    def on_error(self, msg: p.Error) -> None:
        if msg.code == "unknown_worker":     # the frontend lost track of us: rejoin
            self.send(self.hello())
        else:
            log.warning("frontend reports: %s (%s)", msg.message, msg.code)

    HANDLERS = {p.Generate: on_generate, p.Abort: on_abort, p.Load: on_load,
                p.Unload: on_unload, p.Shutdown: on_shutdown, p.Error: on_error}

    # -- loads --------------------------------------------------------------------------
    def load_thread(self, msg: p.Load) -> None:
        try:
            if self.device.kind == "cuda":
                self.device.xp.cuda.Device(self.device.index).use()
            def progress(done, total):
                self.loads.put((msg, p.LoadProgress(msg.model_id, done, total)))
            engine = load_engine(msg.path, self.device, n_slots=msg.slots or self.slots,
                                 ctx=msg.ctx or None, prefill_chunk=msg.prefill_chunk,
                                 prefix_cache_bytes=self.prefix_cache_bytes, progress=progress)
            engine.warm_up()              # ready means warm: the first request pays nothing
            self.loads.put((msg, engine))
        except Exception as exc:
            log.exception("loading %s failed", msg.path)
            self.loads.put((msg, exc))

    def finish_loads(self) -> None:
        while not self.loads.empty():
            msg, result = self.loads.get()
            if isinstance(result, p.LoadProgress):
                self.send(result)
                continue
            self.loading.discard(msg.model_id)
            if isinstance(result, Exception):
                self.send(p.LoadFailed(msg.model_id, f"{type(result).__name__}: {result}"))
                continue
            replica = Replica(msg.model_id, msg.name, msg.path, result)
            self.replicas[msg.model_id] = replica
            self.send(self.loaded_message(replica))

    @staticmethod
    def loaded_message(replica: Replica) -> p.Loaded:
        e = replica.engine
        return p.Loaded(replica.model_id, replica.name, len(e.scheduler.slots), e.model.ctx,
                        e.cfg.vocab_size, e.model.w.nbytes(), e.model.kv.nbytes, e.load_seconds)

    # -- generation ---------------------------------------------------------------------
    def admit(self, replica: Replica) -> None:
        sched = replica.engine.scheduler
        while replica.waiting and sched.free_slots():
            sched.add(replica.waiting.popleft())

    def step(self, replica: Replica) -> None:
        if not replica.engine.scheduler.active():
            return
        try:
            outputs = replica.engine.scheduler.step()
        except Exception as exc:  # a failed step fails its requests, not the worker
            log.exception("step failed on %s", replica.model_id)
            sched = replica.engine.scheduler
            for req_id in list(sched.by_id):
                sched.abort(req_id)
                self.owner.pop(req_id, None)
                self.send(p.Error(f"generation failed: {exc}", code="internal",
                                  request_id=req_id))
            return
        for out in outputs:
            if out.finish:
                self.owner.pop(out.request_id, None)
            self.send(p.Tokens(out.request_id, out.tokens, out.finish, out.prompt_tokens,
                               out.completion_tokens, out.cached_tokens, out.logprobs))


def pin_cores(cores: list[int] | None) -> None:
    if cores:
        psutil.Process().cpu_affinity(cores)


def main(args) -> int:
    pin_cores(args.cores)
    device = open_device(args.die.split(":")[0])
    worker = Worker(device, args.frontend, args.die, slots=args.slots,
                    prefix_cache_bytes=int(args.prefix_cache_mb * (1 << 20)),
                    parent_pid=args.parent_pid or 0,
                    budget=int((args.budget_mb or 0) * (1 << 20)))
    signal.signal(signal.SIGTERM, lambda *_: setattr(worker, "running", False))
    log.info("worker for die %s (%s) connecting to %s", args.die, device.name, args.frontend)
    worker.run()
    return 0
