"""One replica across two dies: its two stages and the link between their workers.

A replica too large for one die is split into two contiguous layer ranges, each a
*stage* in the worker that owns its die (frontend/split_placement.py places them):

- stage 0 (the *head*) holds the embedding, layers [0, k) and the head matrix; it owns
  the scheduler (slots, batching, chunked prefill, sampling, the prefix cache) and is the
  replica the frontend routes requests to;
- stage 1 (the *tail*) holds layers [k, L) and the output norm; it serves the link from
  a thread of its own and owns nothing else.

Each step the head embeds the batch, runs its layers and sends the hidden states
[n, D] to the tail as raw float32 bytes in one binary ZeroMQ frame, behind a small
msgpack header (op, sequence number, spans, dtype and shape: decoded within
HEADER_LIMITS, the payload's size checked against its shape; no pickle). The tail runs
its layers and the output norm and answers with the final hidden state of the rows the
step samples [n_sampled, D]; the head multiplies them by the head matrix and samples, so
sampling, grammars and penalties stay on the head, unchanged. Returning the logits
instead ([n_sampled, V], 196 KB a row for a 49k vocabulary against 2.3 KB) kept the head
matrix, a fifth of SmolLM2's multiply-adds, on the tail and a tied embedding on both
dies: measured with two one-core dies at batch 8, 0.72x of one die with both cores then,
0.86-0.91x now (docs/gpus.md).

Both dies busy: a step of two or more sequences is cut into two micro-batches (a lone
prefill chunk into two halves of itself); the head sends the first, computes the
second while the tail works on the first, then collects both answers in order. The
tail handles its messages one at a time, in order, so a sequence's chunks reach its
state in order on both dies.

Sequence state lives per stage: each stage's layers keep their own KV (or DeltaNet)
state in the same slot numbers. The scheduler's `kv` on the head is a SplitState:
save / restore / copy_prefix act on the local share and, over the link, on the tail's
(the tail keeps its saved shares by handle until the head's prefix cache drops them).

The link is a DEALER (head) → ROUTER (tail) pair (worker/stage_socket.py): the tail
binds what the frontend's load message says (ipc in a private folder when both workers
run on one host, tcp otherwise, CURVE when the fleet has keys) and its Loaded names the
address, which the head's load then dials. Each end takes frames up to what a step of
its model can carry (MAXMSGSIZE: MAX_ROWS rows of its width), on ipc and tcp alike; the
frontend's link keeps its own, smaller limit. A tail that dies or stops answering fails
the step at once (its socket's disconnect, or LINK_TIMEOUT_S): the step's requests end
with the usual error.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time

import msgpack
import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from .model import Batch, Span
from .stage_socket import StageError, StageLinkError, StageNet, TailSocket, head_socket

log = logging.getLogger("pantheon.worker.stage")

F32 = np.float32
HEADER_BYTES = 64 << 10          # a header frame past this is refused unread
MAX_ROWS = 1 << 16               # rows of one hidden-state frame
MAX_PAYLOAD = 1 << 30            # the most any frame on this link may be (ZMQ_MAXMSGSIZE)
# a stage that dies fails the step at once (its link closes); one that only stops answering
# is slow (the head's heartbeats say its step's age) and fails the step after this long
LINK_TIMEOUT_S = 60.0
HELLO_TIMEOUT_S = 15.0           # a load's first exchange (a refused handshake fails sooner)
POLL_MS = 100
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


# -- frames ------------------------------------------------------------------------------

def pack(header: dict) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def unpack(data: bytes) -> dict:
    """A header frame, within bounds (a bomb is refused before it is built)."""
    if len(data) > HEADER_BYTES:
        raise StageError(f"a stage header of {len(data)} bytes (at most {HEADER_BYTES})")
    try:
        out = msgpack.unpackb(data, raw=False, strict_map_key=True, max_str_len=4096,
                              max_bin_len=0, max_array_len=4 * MAX_ROWS, max_map_len=64,
                              max_ext_len=0)
    except Exception as exc:
        raise StageError(f"a bad stage header: {exc}") from None
    if not isinstance(out, dict) or not isinstance(out.get("op"), str):
        raise StageError("a stage header must be a map with an op")
    return out


def meta(a: np.ndarray) -> dict:
    return {"dtype": "float32", "shape": list(a.shape)}


def array(m, buf, width: int | None = None) -> np.ndarray:
    """The float32 [rows, width] array a frame carries, checked against its header."""
    if not isinstance(m, dict) or m.get("dtype") != "float32":
        raise StageError("a stage frame must be float32")
    shape = m.get("shape")
    if (not isinstance(shape, list) or len(shape) != 2
            or not all(isinstance(x, int) and x >= 0 for x in shape) or shape[0] > MAX_ROWS
            or (width is not None and shape[1] != width)):
        raise StageError(f"a stage frame of shape {shape} (want [rows <= {MAX_ROWS}, "
                         f"{width}])")
    if len(buf) != shape[0] * shape[1] * 4:
        raise StageError(f"a stage frame of {len(buf)} bytes for shape {shape}")
    return np.frombuffer(buf, dtype=F32).reshape(shape)


def spans_out(spans: list[Span]) -> list:
    return [[s.slot, s.start, s.n, s.logits, s.pool, s.verify] for s in spans]


def spans_in(rows, n_slots: int, ctx: int) -> list[Span]:
    if not isinstance(rows, list) or not rows:
        raise StageError("a forward needs spans")
    out = []
    for r in rows:
        if (not isinstance(r, list) or len(r) != 6 or not all(isinstance(x, int) for x in
                                                               (r[0], r[1], r[2], r[5]))
                or not 0 <= r[0] < n_slots or r[1] < 0 or r[2] < 1 or r[1] + r[2] > ctx
                or r[4] not in ("", "mean", "last") or r[5] < 1):
            raise StageError(f"a bad span {r!r}")
        out.append(Span(r[0], r[1], r[2], bool(r[3]), r[4], r[5]))
    return out


def frame_limit(*widths: int) -> int:
    """The largest frame a link end takes: MAX_ROWS rows of its widest array (a frame past
    it is dropped by libzmq, its peer disconnected, before anything decodes it)."""
    return min(MAX_PAYLOAD, HEADER_BYTES + MAX_ROWS * max(widths) * 4)


# -- the tail ------------------------------------------------------------------------------

class TailStage(threading.Thread):
    """Stage 1: serves the link from its own thread (the worker loop never waits on it)."""

    def __init__(self, engine, stage, net: StageNet = StageNet(),
                 bound: TailSocket | None = None):
        super().__init__(name=f"stage-{stage.link}", daemon=True)
        self.engine, self.model = engine, engine.model
        self.stage = stage
        self.saved: dict[int, object] = {}       # handle → the tail's share of a saved state
        self.stopped = threading.Event()
        self.forwards = 0
        self.bound = bound or TailSocket(stage, frame_limit(engine.cfg.d_model), net)
        self.sock, self.address = self.bound.sock, self.bound.address

    def stop(self) -> None:
        self.stopped.set()

    def run(self) -> None:
        try:
            while not self.stopped.is_set():
                if not self.sock.poll(POLL_MS, zmq.POLLIN):
                    continue
                frames = self.sock.recv_multipart(copy=True)
                if len(frames) < 2:
                    continue
                ident, rest = frames[0], frames[1:]
                try:
                    header, reply = self.handle(rest)
                except Exception as exc:   # a bad message never ends the stage
                    if not isinstance(exc, StageError):
                        log.exception("stage link: handling a message failed")
                    header, reply = {"op": "error", "message": str(exc)}, []
                    try:
                        header["seq"] = unpack(rest[0]).get("seq")
                    except StageError:
                        pass
                self.sock.send_multipart([ident, pack(header), *reply], copy=False)
        finally:
            self.bound.close()
            self.saved.clear()

    def handle(self, frames: list[bytes]) -> tuple[dict, list]:
        h = unpack(frames[0])
        op, seq, state = h["op"], h.get("seq"), self.model.state
        for handle in h.get("forget") or []:
            self.saved.pop(handle, None)
        if op == "forward":
            if len(frames) != 2:
                raise StageError("a forward carries one hidden-state frame")
            spans = spans_in(h.get("spans"), state.n_slots, self.model.ctx)
            x_in = array(h.get("x"), frames[1], self.model.cfg.d_model)
            return self.forward(seq, spans, x_in)
        if op == "save":
            share, nbytes = state.save(int(h["slot"]), int(h["length"]))
            self.saved[int(h["handle"])] = share
            return {"op": "saved", "seq": seq, "nbytes": nbytes}, []
        if op == "restore":
            share = self.saved.get(int(h["handle"]))
            if share is None:
                raise StageError(f"no saved state {h['handle']}")
            state.restore(int(h["slot"]), share)
            return {"op": "ok", "seq": seq}, []
        if op == "copy":
            state.copy_prefix(int(h["src"]), int(h["dst"]), int(h["length"]))
            return {"op": "ok", "seq": seq}, []
        if op == "echo":                     # the link's own cost (bench/two_die.py)
            size = int(h.get("reply_bytes", 0))
            if not 0 <= size <= MAX_PAYLOAD // 4:
                raise StageError(f"an echo of {size} bytes")
            return {"op": "echo", "seq": seq}, [bytes(size)]
        if op == "stats":                    # this stage's busy time (bench/two_die.py)
            return {"op": "stats", "seq": seq, "cpu_s": time.process_time(),
                    "forwards": self.forwards}, []
        if op == "hello":
            return {"op": "hello", "seq": seq, "truncatable": state.truncatable,
                    "state_bytes": state.nbytes, "weight_bytes": self.engine.weight_bytes}, []
        raise StageError(f"unknown stage op {op!r}")

    def forward(self, seq, spans: list[Span], x_in: np.ndarray) -> tuple[dict, list]:
        m, xp = self.model, self.model.xp
        batch = Batch(spans, xp, m.row_multiple)
        if x_in.shape[0] != batch.n:
            raise StageError(f"{x_in.shape[0]} rows for spans covering {batch.n}")
        x = xp.zeros((batch.T, m.cfg.d_model), dtype=F32)
        x[:batch.n] = xp.asarray(x_in)
        final = m.final_rows(m.layers_forward(x, batch), batch)
        self.forwards += 1
        host = np.ascontiguousarray(self.engine.device.to_host(final), dtype=F32)
        pooled = [(i, self.engine.device.to_host(v)) for i, v in m.pooled]
        frames = [host.data]
        header = {"op": "final", "seq": seq, "x": meta(host),
                  "pooled": [i for i, _ in pooled]}
        if pooled:
            stacked = np.stack([v for _, v in pooled]).astype(F32)
            header["p"] = meta(stacked)
            frames.append(stacked.data)
        return header, frames


# -- the head ---------------------------------------------------------------------------

class HeadLink:
    """Stage 0's end of the link: requests go out in order, answers are matched by seq."""

    def __init__(self, stage, timeout_s: float = LINK_TIMEOUT_S,
                 context: zmq.Context | None = None, net: StageNet = StageNet(),
                 max_bytes: int = MAX_PAYLOAD):
        self.stage, self.timeout_s = stage, timeout_s
        self.sock = head_socket(stage, max_bytes, net, context)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED
                                                    | zmq.EVENT_DISCONNECTED
                                                    | zmq.EVENT_CONNECTED | HANDSHAKE_FAILED)
        self.sock.connect(stage.link)
        self.seq = itertools.count(1)
        self.early: dict[int, tuple] = {}        # answers that came before they were asked
        self.handles = itertools.count(1)
        self.forgotten: list[int] = []           # saved shares the tail may drop
        self.up = False                          # connected (a TCP / ipc connection made)
        self.shook = False                       # its ZMTP handshake (CURVE's too) done
        self.lost: str = ""
        self.bytes_out = self.bytes_in = 0
        self.sent = 0
        self.link_s = 0.0                        # time spent waiting on the tail's answers

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(0)
        self.sock.close(0)

    def events(self) -> None:
        while self.monitor.poll(0, zmq.POLLIN):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                self.up = True
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.up = self.shook = True
            elif event & HANDSHAKE_FAILED or (event == zmq.EVENT_DISCONNECTED and self.up
                                              and self.stage.server_key and not self.shook):
                # a CURVE peer that refuses our key closes the connection before the
                # handshake completes (the failure event may come after the close)
                self.lost = (f"the stage link's CURVE handshake with {self.stage.link} "
                             "failed (not the second stage's key, or ours not let in)")
            elif event == zmq.EVENT_DISCONNECTED and self.up and not self.lost:
                self.lost = "the second stage's worker is gone (its link closed)"

    def send(self, header: dict, *frames) -> int:
        self.events()
        if self.lost:
            raise StageError(self.lost)
        seq = next(self.seq)
        header["seq"] = seq
        if self.forgotten:
            header["forget"], self.forgotten = self.forgotten, []
        head = pack(header)
        self.bytes_out += len(head) + sum(memoryview(f).nbytes for f in frames)
        self.sock.send_multipart([head, *frames], copy=False)
        self.sent += 1
        return seq

    def answer(self, seq: int) -> tuple[dict, list]:
        """The answer to request `seq` (answers come in order; one asked for after a
        later one, as a pipelined step's are, waits here)."""
        if seq in self.early:
            return self.checked(*self.early.pop(seq))
        started = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                self.events()
                if self.lost:
                    raise StageError(self.lost)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StageError(f"the second stage did not answer within "
                                     f"{self.timeout_s:g} s")
                if self.sock.poll(int(min(left, POLL_MS / 1000) * 1000) + 1, zmq.POLLIN):
                    frames = self.sock.recv_multipart(copy=True)
                    header = unpack(frames[0])
                    self.bytes_in += sum(len(f) for f in frames)
                    got = header.get("seq")
                    if got != seq:
                        if isinstance(got, int) and got > seq - 64 and len(self.early) < 64:
                            self.early[got] = header, frames[1:]   # a pending step's
                        continue                 # else a stale answer of a failed step
                    return self.checked(header, frames[1:])
        finally:
            self.link_s += time.perf_counter() - started

    @staticmethod
    def checked(header: dict, frames: list) -> tuple[dict, list]:
        if header["op"] == "error":
            raise StageError(f"the second stage refused: {header.get('message')}")
        return header, frames

    def call(self, header: dict, *frames) -> tuple[dict, list]:
        return self.answer(self.send(header, *frames))


class RemoteShare:
    """The tail's share of a saved state, by handle; dropped there once this is."""

    __slots__ = ("link", "handle")

    def __init__(self, link: HeadLink, handle: int):
        self.link, self.handle = link, handle

    def __del__(self):
        self.link.forgotten.append(self.handle)


class SplitState:
    """The scheduler's `kv` on the head: the local state and, over the link, the tail's."""

    def __init__(self, local, link: HeadLink, remote: dict):
        self.local, self.link = local, link
        self.n_slots, self.ctx = local.n_slots, local.ctx
        self.truncatable = local.truncatable and bool(remote["truncatable"])
        self.remote_bytes = int(remote["state_bytes"])

    @property
    def nbytes(self) -> int:
        return self.local.nbytes + self.remote_bytes

    def save(self, slot: int, length: int):
        share, nbytes = self.local.save(slot, length)
        handle = next(self.link.handles)
        h, _ = self.link.call({"op": "save", "slot": slot, "length": length, "handle": handle})
        return (share, RemoteShare(self.link, handle)), nbytes + int(h["nbytes"])

    def restore(self, slot: int, state) -> int:
        share, remote = state
        self.link.call({"op": "restore", "slot": slot, "handle": remote.handle})
        return self.local.restore(slot, share)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        self.local.copy_prefix(src, dst, length)
        self.link.call({"op": "copy", "src": src, "dst": dst, "length": length})


def micro_batches(tokens: np.ndarray, spans: list[Span]) -> list[tuple[np.ndarray, list[Span]]]:
    """Two micro-batches of about the same token count (one when there is nothing to cut):
    whole spans when there are two or more; a lone prefill chunk cut into two halves of
    itself (the first half needs no logits)."""
    n = sum(s.n for s in spans)
    if len(spans) == 1:
        s = spans[0]
        if s.n < 16 or s.pool:
            return [(tokens, spans)]
        half = s.n // 2
        return [(tokens[:half], [Span(s.slot, s.start, half, False)]),
                (tokens[half:], [Span(s.slot, s.start + half, s.n - half, s.logits, "",
                                      min(s.verify, s.n - half))])]
    cut, acc = 1, spans[0].n
    while cut < len(spans) - 1 and acc + spans[cut].n <= n // 2:
        acc += spans[cut].n
        cut += 1
    return [(tokens[:acc], spans[:cut]), (tokens[acc:], spans[cut:])]


class SplitForward:
    """The head's forward: its layers, then the tail's over the link, two micro-batches
    in flight when the step has them."""

    def __init__(self, model, device, link: HeadLink):
        self.model, self.device, self.link = model, device, link
        self.pooled: list = []
        self.steps = 0

    def __call__(self, tokens, spans: list[Span]):
        return self.collect(self.submit(tokens, spans))

    def submit(self, tokens, spans: list[Span], cut: bool = True):
        """Run the head's layers and send the tail its work (two micro-batches when
        `cut` and the step has them); the handle `collect` takes."""
        m = self.model
        for s in spans:
            if s.n < 1 or s.start + s.n > m.ctx:
                raise ValueError(f"span {s} does not fit the context of {m.ctx}")
        tokens = np.asarray(tokens, dtype=np.int64)
        parts = micro_batches(tokens, spans) if cut else [(tokens, spans)]
        sent = []
        for toks, group in parts:
            x, batch = m.embed(toks, group)
            x = m.layers_forward(x, batch)
            host = np.ascontiguousarray(self.device.to_host(x[:batch.n]), dtype=F32)
            sent.append(self.link.send({"op": "forward", "spans": spans_out(group),
                                        "x": meta(host)}, host.data))
        return sent, parts

    def collect(self, handle):
        """The logits of a submitted step [n_sampled, V], on the die: the tail's final
        rows through this stage's head matrix."""
        m, xp = self.model, self.model.xp
        sent, parts = handle
        rows, pooled, first = [], [], 0
        for seq, (toks, group) in zip(sent, parts):
            h, frames = self.link.answer(seq)
            rows.append(array(h.get("x"), frames[0], m.cfg.d_model))
            if h.get("pooled"):
                vecs = array(h.get("p"), frames[1], m.cfg.d_model)
                pooled += [(first + i, v) for i, v in zip(h["pooled"], vecs)]
            first += len(group)
        self.pooled = pooled
        self.steps += 1
        final = rows[0] if len(rows) == 1 else np.concatenate(rows)
        return m.head_logits(xp.asarray(final))


def connect_head(engine, stage, timeout_s: float = LINK_TIMEOUT_S,
                 net: StageNet = StageNet()) -> HeadLink:
    """Make `engine` (stage 0, layers [0, k) loaded) a split replica's head: its forward
    runs the tail over the link, its scheduler's state spans both stages."""
    cfg = engine.cfg
    link = HeadLink(stage, min(timeout_s, HELLO_TIMEOUT_S), net=net,
                    max_bytes=frame_limit(cfg.d_model))
    try:
        hello, _ = link.call({"op": "hello"})
    except StageError as exc:
        link.close()
        hint = "" if link.up or not stage.link.startswith("tcp://") else \
            " (no connection: is the second stage's --stage-bind address reachable from here?)"
        raise StageLinkError(f"the stage link to {stage.link} cannot be set up: {exc}"
                             f"{hint}") from None
    link.timeout_s = timeout_s
    split = SplitForward(engine.model, engine.device, link)
    sched = engine.scheduler
    sched.forward = split
    sched.pooled = lambda: [(i, v) for i, v in split.pooled]
    sched.kv = SplitState(engine.model.state, link, hello)
    sched.exact = not sched.kv.truncatable
    if sched.exact:
        sched.spec, sched.speculator = None, None
    engine.logits = split                       # warm-up and benches go through it too
    engine.link, engine.remote = link, hello
    if len(sched.slots) >= 2:                   # both dies busy (worker/pipeline.py)
        from .pipeline import Lanes
        engine.scheduler = Lanes(sched, split)
    return link


# -- loads ----------------------------------------------------------------------------

def check_stage(stage) -> None:
    if (stage.index not in (0, 1) or not 0 <= stage.first_layer < stage.end_layer
            or (stage.index == 0 and stage.first_layer != 0) or not stage.link):
        raise StageError(f"a bad stage: index {stage.index}, layers [{stage.first_layer}, "
                         f"{stage.end_layer}), link {stage.link!r}")


def load_stage(msg, device, default_slots: int, prefix_cache_bytes: int, progress=None,
               spec=None, kv_cache=None, net: StageNet = StageNet()):
    """Load `msg`'s stage: stage 1 → a started TailStage (its link bound before its weights
    are read: a port in use or missing keys fail at once); stage 0 → an Engine whose
    forward runs through the tail (which must be up: the frontend loads it first), warm."""
    stage = msg.stage
    check_stage(stage)
    if stage.index == 0 and stage.server_key and net.pair is None:
        raise StageLinkError("keys missing: the load asks for a CURVE stage link and this "
                             "worker has no keys (pantheon worker --keys DIR)")
    bound = None
    if stage.index == 1:
        from ..common.model_file import read_config
        bound = TailSocket(stage, frame_limit(read_config(msg.path).d_model), net)
    try:
        return load_stage_engine(msg, device, default_slots, prefix_cache_bytes, progress,
                                 spec, kv_cache, net, bound)
    except BaseException:
        if bound is not None:
            bound.close()
        raise


def load_stage_engine(msg, device, default_slots, prefix_cache_bytes, progress, spec,
                      kv_cache, net, bound):
    from .engine import load_engine
    stage = msg.stage
    tail = stage.index == 1
    engine = load_engine(msg.path, device, n_slots=msg.slots or default_slots,
                         ctx=msg.ctx or None, prefill_chunk=msg.prefill_chunk,
                         prefix_cache_bytes=0 if tail else prefix_cache_bytes,
                         progress=progress, quantize=msg.quantize,
                         spec=None if tail else spec, activations=msg.activations,
                         layers=(stage.first_layer, stage.end_layer),
                         **({"kv_cache": kv_cache} if kv_cache is not None else {}))
    if stage.end_layer > engine.cfg.n_layers or (tail and stage.end_layer != engine.cfg.n_layers):
        raise StageError(f"stage {stage.index} ends at layer {stage.end_layer}; the model "
                         f"has {engine.cfg.n_layers}")
    if tail:
        warm_tail(engine.model)
        t = TailStage(engine, stage, net, bound)
        t.start()
        log.info("stage 1 of %s (layers %d-%d) serves its link at %s%s", msg.model_id,
                 stage.first_layer, stage.end_layer - 1, t.address,
                 " (CURVE)" if stage.server_key else "")
        return t
    link = connect_head(engine, stage, net=net)
    try:
        engine.warm_up()                     # down both stages: ready means warm
    except Exception:
        link.close()
        raise
    log.info("stage 0 of %s (layers 0-%d) linked to its second stage at %s%s", msg.model_id,
             stage.end_layer - 1, stage.link, " (CURVE)" if stage.server_key else "")
    return engine


def warm_tail(m) -> None:
    """A second stage's warm-up: a short prefill and a decode through its layers and the
    output norm (it has no embedding to start from; the head's warm-up then runs both
    stages and checks the logits)."""
    for n in (max(1, min(32, m.ctx - 1)), 1):
        batch = Batch([Span(0, 0, n)], m.xp, m.row_multiple)
        x = m.xp.zeros((batch.T, m.cfg.d_model), dtype=F32)
        m.final_rows(m.layers_forward(x, batch), batch)


def loaded_message(model_id: str, name: str, tail: TailStage):
    from ..common import protocol as p
    e = tail.engine
    return p.Loaded(model_id, name, len(e.scheduler.slots), e.model.ctx, e.cfg.vocab_size,
                    e.weight_bytes, e.state_bytes, e.load_seconds, link=tail.address)
