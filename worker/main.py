"""`pantheon worker`: one process per die, driven by the frontend over ZeroMQ.

The loop: receive messages → admit waiting requests → one scheduler step per
resident model → send the new tokens (one Outputs message per step). Nothing heavy but the step runs on it:
model loads run in a thread (the engine is handed back to the loop only when
it is loaded and warm), and so does the preparation of a constrained request
(the grammar's tokenizer is built right after its model loads, each request's
matcher in a thread; the request joins the batch when it is ready). Threads
hand results back through queues and wake the loop through a pipe.

Heartbeats come from a thread of their own, on a socket of their own, so a
step of any length (a long prefill, a GC pause, a contended host) never
silences the worker: each says whether the loop is busy and for how long.

A malformed or unknown message is logged and answered with an Error (carrying
its request id when one can be read from it, so that request ends at once);
nothing a peer sends can end this loop except Shutdown. A Generate taken is
acknowledged at once (Accepted), so the frontend knows it arrived. A
request's grammar or sampling failure ends that request alone.
"""
from __future__ import annotations

import bisect
import logging
import os
import queue
import secrets
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import psutil
import zmq
from zmq.utils.monitor import recv_monitor_message

from ..common import protocol as p
from ..common import settings
from ..common.formats import FormatError
from ..common.gguf_file import forget_cached
from ..common.host_identity import host_identity
from ..common.keys import KeyPair, curve_client, is_local_address, server_public, worker_pair
from ..common.kv_cache import KVCacheTypes
from ..common.model_file import ModelFileError
from .device import Device, open_device
from .constraint import summary
from .engine import Engine, load_engine
from .scheduler import Request
from .spec import SpecConfig
from . import stage_link
from .stage_socket import StageBind, StageLinkError, StageNet

log = logging.getLogger("pantheon.worker")

IDLE_POLL_MS = 250           # threads wake the loop at once; this is only a backstop
HANDSHAKE_WAIT_S = 5.0      # connected this long with no handshake: reported as refused
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def constraint_factory(path: str):
    """The llguidance tokenizer of a model (~0.35 s for a 49k vocabulary; more on a
    contended host): built in the preparation thread, never on the loop."""
    from ..common.tokenizer import open_tokenizer
    from .constraint import ConstraintFactory
    return ConstraintFactory(open_tokenizer(path))


@dataclass
class Replica:
    """A resident model and the requests waiting for one of its slots."""

    model_id: str
    name: str
    path: str
    engine: Engine
    waiting: deque = field(default_factory=deque)
    constraints: Future | None = None    # ConstraintFactory, built after the load

    def constraint(self, grammar: str):
        """A matcher for `grammar`, its first mask computed (runs in the preparation
        thread, which llguidance lets run beside the loop: a grammar whose lexer blows up,
        as `^(a{1000}){1000}$` does for seconds, does it here and not in a batch's step)."""
        matcher = self.constraints.result().make(grammar)
        matcher.bitmask()
        return matcher


class Heartbeats(threading.Thread):
    """Sends the worker's heartbeat every HEARTBEAT_S from its own socket, whatever the
    loop is doing, and passes on the frontend's "send hello" answer to it."""

    def __init__(self, worker: "Worker", frontend: str, ident: bytes):
        super().__init__(name="heartbeats", daemon=True)
        self.worker, self.frontend, self.identity = worker, frontend, ident
        self.keys = worker.keys
        self.stopped = threading.Event()

    def run(self) -> None:
        sock = self.worker.ctx.socket(zmq.DEALER)   # a socket belongs to one thread
        sock.setsockopt(zmq.IDENTITY, self.identity + p.HEARTBEAT_SUFFIX)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_MESSAGE_BYTES)
        if self.keys:
            curve_client(sock, *self.keys)
        sock.connect(self.frontend)
        try:
            while not self.stopped.is_set():
                sock.send(p.encode(self.worker.beat()), copy=False)
                deadline = time.monotonic() + p.HEARTBEAT_S
                while (left := deadline - time.monotonic()) > 0 and not self.stopped.is_set():
                    if sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                        self.answer(sock, sock.recv())
                self.worker.check_parent()
        finally:
            sock.close()

    def answer(self, sock: zmq.Socket, data: bytes) -> None:
        try:
            msg = p.decode(data)
        except p.ProtocolError:
            return
        if isinstance(msg, p.Ping):             # the frontend's probe: alive, say so now
            sock.send(p.encode(self.worker.beat()), copy=False)
        elif isinstance(msg, p.Error) and msg.code == "unknown_worker":
            self.worker.rehello = True          # the loop introduces us again
            self.worker.wake()


class Worker:
    def __init__(self, device: Device, frontend: str, die: str, slots: int = settings.SLOTS,
                 prefix_cache_bytes: int = 0, parent_pid: int = 0, budget: int = 0,
                 keys: tuple[bytes, KeyPair] | None = None, proof: str = "",
                 kv_cache: KVCacheTypes = KVCacheTypes(), stage_bind: StageBind = StageBind()):
        self.device, self.die, self.slots = device, die, slots
        self.kv_cache = kv_cache         # for loads whose message names no KV type
        self.keys = keys                 # (server public key, own pair): CURVE
        self.proof = proof               # from the frontend that spawned us: our hello's
        # a split replica's stage link: this worker's own pair, where a tcp one binds
        self.stage_net = StageNet(keys[1] if keys else None, stage_bind, frontend)
        self.host = host_identity()
        self.refused_at = -60.0          # the last refused hello logged
        self.parent_pid = parent_pid     # spawned by a frontend: live and die with it
        self.budget = budget
        self.prefix_cache_bytes = prefix_cache_bytes
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        # unguessable: a peer that knew it could take our connection over (handover)
        ident = f"{die}-{os.getpid()}-{secrets.token_hex(16)}".encode()
        self.sock.setsockopt(zmq.IDENTITY, ident)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_MESSAGE_BYTES)   # a larger frame: dropped
        if keys:
            curve_client(self.sock, *keys)
        self.monitor = self.sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
            | HANDSHAKE_FAILED)
        self.warned_at = -60.0                       # the last handshake failure logged
        self.link_up = False                         # the current connection's handshake done
        # since when the link waits for a handshake: from the connect itself, so that a
        # refusal libzmq reports with no event at all is still said (check_handshake)
        self.unacknowledged_since = time.monotonic()
        self.connected_once = False                  # a TCP connection was ever made
        self.sock.connect(frontend)
        self.replicas: dict[str, Replica] = {}
        self.stages: dict = {}                       # replica id → a split replica's tail
        self.owner: dict[str, Replica] = {}          # request id → replica
        self.loads: queue.Queue = queue.Queue()      # (model_id, name, engine | exception)
        self.loading: set[str] = set()
        self.prep = ThreadPoolExecutor(1, thread_name_prefix="prepare")
        self.preparing: dict[str, tuple[Request, Future]] = {}   # request id → its matcher
        self.releasing: list[Future] = []    # tokenizers of unloaded replicas still building
        self.running = True
        self.rehello = False
        self.waker_r, self.waker_w = os.pipe()       # any thread → the loop's poll
        os.set_blocking(self.waker_r, False)
        os.set_blocking(self.waker_w, False)
        # what the heartbeat thread reports: replaced whole by the loop, read as is
        self.busy_since: float | None = None
        self.load_figures = (0, 0, *device.memory(), [])  # active, waiting, total, free,
        self.next_figures = 0.0                              # [ReplicaLoad]
        self.steps = 0
        self.step_counts = [0] * (len(p.STEP_BUCKETS) + 1)   # step times, per bucket
        self.step_sum = 0.0
        self.bs_stats = settings.bs_stats()                  # QWEN35_BS_STATS=1: a line each
        self.traces: dict[str, str] = {}                     # request id → client's id
        self.stall = settings.test_stall(die)
        self.step_floor = settings.test_step_floor()
        self.heartbeats = Heartbeats(self, frontend, ident)
        self.process = psutil.Process()                      # its RSS goes in each heartbeat

    # -- edges ----------------------------------------------------------------------
    def send(self, msg) -> None:
        self.sock.send(p.encode(msg), copy=False)

    def hello(self) -> p.Hello:
        total, free = self.device.memory()
        resident = [p.Resident(r.model_id, r.path, len(r.engine.scheduler.slots),
                               r.engine.model.ctx, r.engine.weight_bytes,
                               r.engine.state_bytes) for r in self.replicas.values()]
        return p.Hello(self.die, self.device.kind, self.device.name, total, free, self.slots,
                       os.getpid(), list(self.replicas), self.budget or total, resident,
                       list(self.owner), self.proof, host=self.host,
                       public_key=self.keys[1].public.decode() if self.keys else "")

    def beat(self) -> p.Heartbeat:
        """This moment's heartbeat (called by the heartbeat thread)."""
        active, waiting, total, free, replicas = self.load_figures
        host = psutil.virtual_memory()
        level = max(p.pressure_level(free, total),
                    p.pressure_level(host.available, host.total))
        since = self.busy_since
        step_s = time.monotonic() - since if since is not None else 0.0
        return p.Heartbeat(self.die, active, waiting, total, free, host.available, level,
                           os.getpid(), step_s, replicas, list(self.step_counts),
                           self.step_sum, self.process.memory_info().rss)

    def refresh_figures(self) -> None:
        if time.monotonic() < self.next_figures:
            return
        active = sum(r.engine.scheduler.active() for r in self.replicas.values())
        waiting = sum(len(r.waiting) for r in self.replicas.values()) + len(self.preparing)
        loads = [replica_load(r) for r in self.replicas.values()]
        self.load_figures = (active, waiting, *self.device.memory(), loads)
        self.next_figures = time.monotonic() + p.HEARTBEAT_S / 2

    def request_log(self, level: int, request_id: str, fmt: str, *args) -> None:
        """A log line about one request, carrying the client's id (X-Request-Id)."""
        log.log(level, "request %s: " + fmt, request_id, *args,
                extra={"request_id": self.traces.get(request_id) or request_id})

    def wake(self) -> None:
        """Make the loop's poll return now (from any thread)."""
        try:
            os.write(self.waker_w, b"!")
        except BlockingIOError:
            pass                                 # already a wake-up pending

    def check_parent(self) -> None:
        if self.parent_pid and os.getppid() != self.parent_pid and self.running:
            log.warning("the frontend that spawned this worker is gone; exiting")
            self.stop()

    def stop(self) -> None:
        self.running = False
        self.wake()

    # -- the loop ---------------------------------------------------------------------
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        poller.register(self.waker_r, zmq.POLLIN)
        self.heartbeats.start()
        while self.running:
            busy = any(r.engine.scheduler.active() or r.waiting for r in self.replicas.values())
            self.busy_since = None
            events = dict(poller.poll(0 if busy else IDLE_POLL_MS))
            self.busy_since = time.monotonic()
            if self.waker_r in events:
                while True:
                    try:
                        if not os.read(self.waker_r, 4096):
                            break
                    except BlockingIOError:
                        break
            if self.monitor in events:
                while self.monitor.poll(0, zmq.POLLIN):      # every event since the last turn
                    self.link_event(recv_monitor_message(self.monitor)["event"])
            self.check_handshake()
            if self.rehello:
                self.rehello = False
                self.send(self.hello())
            while self.sock.poll(0, zmq.POLLIN):
                self.receive(self.sock.recv())
            self.finish_loads()
            self.finish_preparations()
            self.finish_releases()
            self.step_all()
            self.refresh_figures()
        self.heartbeats.stopped.set()
        self.prep.shutdown(wait=False, cancel_futures=True)
        try:                 # a frontend that refused our keys has no pipe to queue on
            self.sock.send(p.encode(p.Stopping(self.die)), zmq.NOBLOCK)
        except zmq.Again:
            pass
        self.sock.close()

    def step_all(self) -> None:
        """Admit and step each resident model. A method of its own so that no frame of
        the loop keeps a replica bound after it is unloaded (its memory goes at once)."""
        for replica in list(self.replicas.values()):
            self.admit(replica)
            self.step(replica)

    def link_event(self, event: int) -> None:
        """The link's monitor: introduce ourselves on each connection; a refused handshake
        is reported whether libzmq says so or only drops the connection before the
        handshake completed (the frontend's refusal can race its ERROR frame)."""
        if event == zmq.EVENT_CONNECTED:
            self.rehello = True              # (re)connected: introduce ourselves
            self.link_up = False
            self.connected_once = True
            if self.unacknowledged_since is None:
                self.unacknowledged_since = time.monotonic()
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.link_up = True
            self.unacknowledged_since = None
        elif event == zmq.EVENT_DISCONNECTED:
            if not self.link_up:
                self.handshake_failed()
            self.link_up = False
        else:
            self.handshake_failed()

    def check_handshake(self) -> None:
        """Connected for HANDSHAKE_WAIT_S without a completed handshake: a refusal too,
        whichever events libzmq gave (or did not give) for it."""
        since = self.unacknowledged_since
        if since is not None and time.monotonic() - since >= HANDSHAKE_WAIT_S:
            self.unacknowledged_since = None
            self.handshake_failed(seen=self.connected_once)

    def handshake_failed(self, seen: bool = True) -> None:
        """The frontend refused the link (keys, or their absence): say so, once a minute.
        `seen`: libzmq reported the connection; without that the frontend may not be up."""
        if time.monotonic() - self.warned_at >= 60:
            self.warned_at = time.monotonic()
            why = ("is this worker's key in its authorized/ folder, and server.key its "
                   "server's?" if self.keys else "it uses CURVE: pass --keys DIR")
            if seen:
                log.warning("the frontend refused the link's handshake: %s", why)
            else:
                log.warning("no handshake with the frontend after %g s: it is not up yet, "
                            "or it refuses the link (%s)", HANDSHAKE_WAIT_S, why)

    def receive(self, data: bytes) -> None:
        try:
            msg = p.decode(data)
        except p.ProtocolError as exc:
            # the request it names (if any) ends now, instead of waiting for an answer
            request_id = p.peek_request_id(data)
            log.warning("refused a message%s: %s",
                        f" for request {request_id}" if request_id else "", exc)
            self.send(p.Error(str(exc), code="bad_request" if request_id else "bad_message",
                              request_id=request_id))
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
            params = msg.sampling.check(replica.engine.cfg.vocab_size)
            if not msg.prompt or len(msg.prompt) >= sched.ctx:
                raise ValueError(f"prompt of {len(msg.prompt)} tokens does not fit the "
                                 f"context of {sched.ctx}")
            if msg.max_tokens < 1 or any(not 0 <= t < replica.engine.cfg.vocab_size
                                         for t in msg.prompt):
                raise ValueError("max_tokens must be >= 1 and token ids within the vocabulary")
            if msg.pooling not in ("", "mean", "last") or (msg.pooling and msg.grammar):
                raise ValueError(f"pooling must be mean or last (and without a grammar), "
                                 f"got {msg.pooling!r}")
        except (TypeError, ValueError) as exc:
            self.traces[msg.request_id] = msg.trace
            self.request_log(logging.INFO, msg.request_id, "refused: %s", exc)
            self.traces.pop(msg.request_id, None)
            self.send(p.Error(str(exc), code="bad_request", request_id=msg.request_id))
            return
        self.traces[msg.request_id] = msg.trace
        if log.isEnabledFor(logging.DEBUG):
            self.request_log(logging.DEBUG, msg.request_id, "queued on %s: prompt %d, "
                             "max_tokens %d", msg.model_id, len(msg.prompt), msg.max_tokens)
        request = Request(msg.request_id, msg.prompt, params, msg.max_tokens,
                          frozenset(msg.stop_ids), msg.session_id, None, min(msg.logprobs, 20),
                          msg.cache_salt, msg.pooling, msg.prediction or None)
        self.owner[msg.request_id] = replica
        self.send(p.Accepted(msg.request_id))         # taken: the frontend's first answer
        if msg.grammar:         # its matcher is made in the preparation thread
            future = self.prep.submit(replica.constraint, msg.grammar)
            future.add_done_callback(lambda _: self.wake())
            self.preparing[msg.request_id] = (request, future)
        else:
            replica.waiting.append(request)

    def finish_preparations(self) -> None:
        """Constrained requests whose matcher is ready join their replica's queue."""
        for req_id, (request, future) in list(self.preparing.items()):
            if not future.done():
                continue
            del self.preparing[req_id]
            replica = self.owner.get(req_id)
            if replica is None or self.replicas.get(replica.model_id) is not replica:
                continue                          # aborted or unloaded meanwhile
            try:
                request.constraint = future.result()
            except Exception as exc:
                self.owner.pop(req_id, None)
                why = summary(str(exc))
                self.request_log(logging.INFO, req_id, "grammar refused: %s", why)
                self.traces.pop(req_id, None)
                self.send(p.Error(why if why.startswith("invalid grammar")
                                  else f"invalid grammar: {why}", code="bad_request",
                                  request_id=req_id))
                continue
            replica.waiting.append(request)

    def on_abort(self, msg: p.Abort) -> None:
        replica = self.owner.pop(msg.request_id, None)
        if replica is None:
            return                                  # already finished: nothing to do
        out = replica.engine.scheduler.abort(msg.request_id)
        if log.isEnabledFor(logging.DEBUG):
            self.request_log(logging.DEBUG, msg.request_id, "aborted after %d token(s)",
                             out.completion_tokens if out else 0)
        self.traces.pop(msg.request_id, None)
        if out is None:                             # still waiting for a slot or its grammar
            replica.waiting = deque(r for r in replica.waiting if r.id != msg.request_id)
            self.preparing.pop(msg.request_id, None)
        self.send(p.Tokens(msg.request_id, [], "abort",
                           out.prompt_tokens if out else 0, out.completion_tokens if out else 0))

    def on_load(self, msg: p.Load) -> None:
        if msg.model_id in self.stages:             # a split replica's tail, held already
            self.send(stage_link.loaded_message(msg.model_id, msg.name, self.stages[msg.model_id]))
            return
        if msg.model_id in self.replicas or msg.model_id in self.loading:
            self.send(self.loaded_message(self.replicas[msg.model_id])
                      if msg.model_id in self.replicas else p.Error("load already running",
                                                                    code="duplicate"))
            return
        self.loading.add(msg.model_id)
        threading.Thread(target=self.load_thread, args=(msg,), daemon=True,
                         name=f"load-{msg.model_id}").start()

    def on_unload(self, msg: p.Unload) -> None:
        if (tail := self.stages.pop(msg.model_id, None)) is not None:
            tail.stop()
            tail.join(timeout=5)
            tail = None
            self.release(None)
        replica = self.replicas.pop(msg.model_id, None)
        if replica is not None:
            if getattr(replica.engine, "link", None) is not None:
                replica.engine.link.close()         # a split replica's head
            for req_id in [r for r, rep in self.owner.items() if rep is replica]:
                self.owner.pop(req_id)
                self.preparing.pop(req_id, None)
                self.traces.pop(req_id, None)
                self.send(p.Tokens(req_id, [], "abort"))
            building, replica = replica.constraints, None   # the last reference goes
            try:
                self.release(building)
            except Exception:       # the replica is gone either way: say so
                log.exception("releasing the memory of %s failed", msg.model_id)
        self.send(p.Unloaded(msg.model_id))

    def release(self, building: Future | None) -> None:
        """Give an unloaded replica's memory back to the host, now (the caller dropped its
        last reference). Its constraints' tokenizer may still be in the making on the
        preparation thread: cancelled if not started, else released again once built."""
        if building is not None and not building.cancel() and not building.done():
            self.releasing.append(building)
            building.add_done_callback(lambda _: self.wake())
        forget_cached()                  # parsed metadata, for that tokenizer
        self.device.release()

    def finish_releases(self) -> None:
        if self.releasing and all(f.done() for f in self.releasing):
            self.releasing.clear()
            self.release(None)

    def on_shutdown(self, msg: p.Shutdown) -> None:
        self.stop()

    def on_ping(self, msg: p.Ping) -> None:
        pass                                     # a probe of the link: nothing to answer

    def on_error(self, msg: p.Error) -> None:
        if msg.code == "unknown_worker":     # the frontend lost track of us: rejoin
            self.send(self.hello())
        elif msg.code == "refused":          # asked again at each heartbeat: said once a minute
            if time.monotonic() - self.refused_at >= 60:
                self.refused_at = time.monotonic()
                log.warning("the frontend refused our hello (trying again while it runs): "
                            "%s", msg.message)
        else:
            log.warning("frontend reports: %s (%s)", msg.message, msg.code)

    HANDLERS = {p.Generate: on_generate, p.Abort: on_abort, p.Load: on_load,
                p.Unload: on_unload, p.Shutdown: on_shutdown, p.Error: on_error,
                p.Ping: on_ping}

    # -- loads --------------------------------------------------------------------------
    def load_thread(self, msg: p.Load) -> None:
        try:
            if stall := settings.test_load_stall():
                log.warning("test hook: stalling the load of %s for %.1f s", msg.model_id, stall)
                time.sleep(stall)
            if self.device.kind == "cuda":
                self.device.xp.cuda.Device(self.device.index).use()
            def progress(done, total):
                self.loads.put((msg, p.LoadProgress(msg.model_id, done, total)))
                self.wake()
            kv = KVCacheTypes.of(None, msg.kv_cache_k or self.kv_cache.k,
                                 msg.kv_cache_v or self.kv_cache.v)   # ValueError: refused
            if msg.stage is not None:       # a stage of a replica split across two dies
                result = stage_link.load_stage(msg, self.device, self.slots,
                                               self.prefix_cache_bytes, progress,
                                               spec=spec_config(msg.spec), kv_cache=kv,
                                               net=self.stage_net)
                self.loads.put((msg, result))
                self.wake()
                return
            engine = load_engine(msg.path, self.device, n_slots=msg.slots or self.slots,
                                 ctx=msg.ctx or None, prefill_chunk=msg.prefill_chunk,
                                 prefix_cache_bytes=self.prefix_cache_bytes, progress=progress,
                                 quantize=msg.quantize, spec=spec_config(msg.spec),
                                 activations=msg.activations, kv_cache=kv)
            engine.warm_up()              # ready means warm: the first request pays nothing
            self.loads.put((msg, engine))
        except (ModelFileError, FormatError, stage_link.StageError) as exc:   # one line
            log.error("loading %s failed: %s", msg.path, exc)
            self.loads.put((msg, exc))
        except Exception as exc:
            log.exception("loading %s failed", msg.path)
            if self.device.kind == "cuda":       # what the failed load held goes back
                self.device.xp.get_default_memory_pool().free_all_blocks()
            self.loads.put((msg, exc))
        self.wake()

    def finish_loads(self) -> None:
        while not self.loads.empty():
            msg, result = self.loads.get()
            if isinstance(result, p.LoadProgress):
                self.send(result)
                continue
            self.loading.discard(msg.model_id)
            if isinstance(result, Exception):
                if isinstance(result, (ModelFileError, FormatError)):   # the file's fault
                    self.send(p.LoadFailed(msg.model_id, str(result), p.BAD_MODEL_FILE))
                elif isinstance(result, StageLinkError):     # a port in use, keys missing
                    self.send(p.LoadFailed(msg.model_id, str(result), p.STAGE_LINK))
                else:   # MemoryError: CuPy's OutOfMemoryError (the emulated die's too) or the host's
                    code = p.OUT_OF_MEMORY if isinstance(result, MemoryError) else ""
                    self.send(p.LoadFailed(msg.model_id, f"{type(result).__name__}: {result}", code))
                continue
            if isinstance(result, stage_link.TailStage):
                self.stages[msg.model_id] = result
                self.send(stage_link.loaded_message(msg.model_id, msg.name, result))
                continue
            replica = Replica(msg.model_id, msg.name, msg.path, result)
            # ready for its first constrained request before it comes (failures surface
            # then, as that request's error)
            replica.constraints = self.prep.submit(constraint_factory, msg.path)
            self.replicas[msg.model_id] = replica
            self.send(self.loaded_message(replica))

    @staticmethod
    def loaded_message(replica: Replica) -> p.Loaded:
        e = replica.engine
        return p.Loaded(replica.model_id, replica.name, len(e.scheduler.slots), e.model.ctx,
                        e.cfg.vocab_size, e.weight_bytes, e.state_bytes, e.load_seconds,
                        e.scheduler.spec.kind if e.scheduler.spec else "",
                        activations=e.activations if e.device.kind == "cpu" else "")

    # -- generation ---------------------------------------------------------------------
    def admit(self, replica: Replica) -> None:
        sched = replica.engine.scheduler
        while replica.waiting and sched.free_slots():
            sched.add(replica.waiting.popleft())

    def step(self, replica: Replica) -> None:
        if not replica.engine.scheduler.active():
            return
        self.steps += 1
        if self.stall and self.steps == self.stall[0]:
            log.warning("test hook: stalling step %d for %.1f s", *self.stall)
            time.sleep(self.stall[1])
        sched = replica.engine.scheduler
        started = time.perf_counter()
        try:
            outputs = sched.step()
            if self.step_floor:
                time.sleep(max(0.0, self.step_floor - (time.perf_counter() - started)))
        except Exception as exc:  # a failed step fails its requests, not the worker
            # (a request's own grammar or sampling failure never gets here: it ends that
            # request alone, below). The reply names no request's data: the detail, which
            # may quote any of them, goes to the log only.
            log.exception("step failed on %s", replica.model_id)
            for req_id in list(sched.by_id):
                sched.abort(req_id)
                self.owner.pop(req_id, None)
                self.request_log(logging.WARNING, req_id, "failed: %s", type(exc).__name__)
                self.traces.pop(req_id, None)
                self.send(p.Error(f"generation failed on this replica "
                                  f"({type(exc).__name__}); the server's log has the detail",
                                  code="internal", request_id=req_id))
            return
        seconds = time.perf_counter() - started
        self.step_counts[bisect.bisect_left(p.STEP_BUCKETS, seconds)] += 1
        self.step_sum += seconds
        if self.bs_stats:
            n_decode, n_prompt = sched.last_step
            print(f"[bs_stats] die={self.die} model={replica.model_id} step={self.steps} "
                  f"batch={n_decode + (n_prompt > 0)} decode={n_decode} prefill={n_prompt} "
                  f"active={sched.active()} ms={seconds * 1e3:.2f}", file=sys.stderr, flush=True)
        failed = [o for o in outputs if o.finish == "error"]
        for out in failed:                       # its grammar failed: it ends alone
            self.request_log(logging.INFO, out.request_id, "failed: %s", out.error)
            self.send(p.Error(f"the request's output constraint failed: {out.error}",
                              code="bad_request", request_id=out.request_id))
        outputs = [o for o in outputs if o.finish != "error"]
        for out in failed + outputs:
            if out.finish:
                self.owner.pop(out.request_id, None)
                if log.isEnabledFor(logging.DEBUG):
                    self.request_log(logging.DEBUG, out.request_id, "finished (%s): prompt %d, "
                                     "completion %d, cached %d", out.finish, out.prompt_tokens,
                                     out.completion_tokens, out.cached_tokens)
                self.traces.pop(out.request_id, None)
        if outputs:             # one message per step, whatever the batch size
            self.send(p.Outputs([p.Tokens(o.request_id, o.tokens, o.finish, o.prompt_tokens,
                                          o.completion_tokens, o.cached_tokens, o.logprobs,
                                          o.embedding, o.proposed, o.accepted)
                                 for o in outputs]))


def spec_config(spec: p.Speculation | None) -> SpecConfig | None:
    """A Load's speculation, checked (a ValueError fails the load with its message)."""
    if spec is None or not spec.kind:
        return None
    return SpecConfig(spec.kind, spec.n, spec.k, spec.draft)


def replica_load(replica: Replica) -> p.ReplicaLoad:
    sched = replica.engine.scheduler
    busy = [s for s in sched.slots if s.request is not None]
    return p.ReplicaLoad(replica.model_id, len(busy), len(sched.slots),
                         sum(s.cached for s in busy), len(sched.slots) * sched.ctx)


def pin_cores(cores: list[int] | None) -> None:
    if cores:
        psutil.Process().cpu_affinity(cores)


@dataclass(kw_only=True)
class WorkerConfig:
    """What `pantheon worker` runs with (its flags: common/options.py). What a model's
    replica runs with (slots, context, quantization, KV types) comes in each Load."""

    die: str = "cpu"
    frontend: str = settings.WORKER_ADDR
    slots: int = settings.SLOTS            # a Load's slots when it names none
    cores: list[int] | None = None         # CPU affinity
    prefix_cache_bytes: int = 0
    budget_bytes: int = 0                  # 0: all of the die
    parent_pid: int = 0                    # exit when it is gone (a spawning frontend)
    keys: str | None = None                # CURVE: a worker folder of `pantheon keys`
    insecure: bool = False                 # join without keys where none are proven
    kv_cache: KVCacheTypes = field(default_factory=KVCacheTypes)  # a Load naming none
    stage_bind: StageBind | None = None    # where a tcp stage link binds (None: the default)


def link_keys(cfg: WorkerConfig, spawned: bool) -> tuple[bytes, KeyPair] | None:
    """The CURVE keys of `--keys DIR`. Without them only a worker spawned by its frontend
    (it holds the spawn proof, and its frontend bound the address before starting it)
    connects; any other would obey whatever process bound the address first, on this
    host too: refused unless --insecure."""
    if cfg.keys:
        return server_public(cfg.keys), worker_pair(cfg.keys)
    if spawned and is_local_address(cfg.frontend):
        return None
    if not cfg.insecure:
        where = "off this host, in clear" if not is_local_address(cfg.frontend) else \
            "on this host"
        raise RuntimeError(f"refusing to start: the link to --frontend {cfg.frontend} "
                           f"({where}) would be unauthenticated: this worker would obey "
                           "whatever process bound that address first; pass --keys DIR (a "
                           "worker folder from `pantheon keys generate`, or the frontend's "
                           "own folder on its host), or --insecure")
    log.warning("--insecure: the link to %s is unauthenticated%s: this worker obeys "
                "whatever process bound that address", cfg.frontend,
                "" if is_local_address(cfg.frontend) else " and in clear")
    return None


def main(args) -> int:
    from ..common import options
    return run(options.config(WorkerConfig, args, options.WORKER,
                              kv_cache=getattr(args, "kv", None) or KVCacheTypes()))


def run(cfg: WorkerConfig) -> int:
    if refused := settings.refused_knobs():
        raise RuntimeError("; ".join(refused))
    proof = settings.spawn_proof() or ""
    device = open_device(cfg.die)            # a bad die name stops here, with the forms
    keys = link_keys(cfg, spawned=bool(proof))
    pin_cores(cfg.cores)
    worker = Worker(device, cfg.frontend, cfg.die, slots=cfg.slots,
                    prefix_cache_bytes=cfg.prefix_cache_bytes, parent_pid=cfg.parent_pid,
                    budget=cfg.budget_bytes, keys=keys, proof=proof, kv_cache=cfg.kv_cache,
                    stage_bind=cfg.stage_bind or StageBind())
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())    # after this step
    if cfg.parent_pid:
        # a Ctrl-C reaches the whole process group: the frontend drains, then stops us
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    log.info("worker for die %s (%s) connecting to %s%s", cfg.die, device.name, cfg.frontend,
             " (CURVE)" if keys else "")
    if device.emulated:
        log.warning("die %s is emulated (NumPy standing in for CuPy, kernels through the host "
                    "shim): for tests and development, not for serving", cfg.die)
    worker.run()
    return 0
