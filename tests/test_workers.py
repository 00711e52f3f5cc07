"""frontend/workers.py's WorkerPool on a real ROUTER socket, its peers real DEALERs in
the same event loop: who may join, a hello never displaces a live worker, a full send
queue is not a loss, a hung spawned worker is lost (and handed over to be killed) while
one that answers its probes is kept; a request its worker never answers fails at the
deadline."""
import asyncio
import time

import zmq
import zmq.asyncio

from cluster import free_port
from pantheon.common import protocol as p
from pantheon.frontend.workers import WorkerLost, WorkerPool


def hello(die="cpu", pid=4242, proof=""):
    return p.Hello(die, "cpu", "test", 1 << 30, 1 << 30, 2, pid=pid, proof=proof)


def beat(die="cpu", pid=4242):
    return p.Heartbeat(die, 0, 0, 1, 1, 1, 0, pid=pid)


class Peer:
    """A DEALER in the test's loop, with a given identity."""

    def __init__(self, pool: WorkerPool, ident: bytes, rcvhwm: int = 1000):
        self.sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, ident)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sock.connect(pool.address)

    async def send(self, msg):
        await self.sock.send(p.encode(msg))

    async def messages(self, seconds: float, count: int = 0) -> list:
        """What arrives within `seconds` (or the first `count` messages)."""
        out, deadline = [], time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0 and not 0 < count <= len(out):
            if await self.sock.poll(int(left * 1000) + 1):
                out.append(p.decode(await self.sock.recv()))
        return out

    def close(self):
        self.sock.close(0)


async def until(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def run(make_pool, body):
    async def go():
        pool = make_pool(f"tcp://127.0.0.1:{free_port()}")
        pool.start()
        peers = []
        try:
            await body(pool, lambda *a, **kw: peers.append(Peer(pool, *a, **kw)) or peers[-1])
        finally:
            for peer in peers:
                peer.close()
            await pool.close()
    asyncio.run(go())


def test_only_a_spawned_worker_with_its_proof_joins_a_keyless_link():
    async def body(pool, peer):
        pool.expect("s3cret", "cpu", 101)
        rogue = peer(b"rogue")
        for msg in [hello(pid=101), hello(pid=101, proof="guess"),
                    hello(die="0", pid=101, proof="s3cret"),      # the proof is for die cpu
                    hello(pid=102, proof="s3cret")]:              # and for pid 101
            await rogue.send(msg)
            (answer,) = await rogue.messages(5, count=1)
            assert answer.code == "refused", answer
        assert pool.live() == []
        real = peer(b"real")
        await real.send(hello(pid=101, proof="s3cret"))
        await until(lambda: pool.live())
        (worker,) = pool.live()
        assert worker.spawned and worker.hello.pid == 101
    run(lambda addr: WorkerPool(addr), body)


def test_a_hello_for_a_live_die_is_refused_and_the_worker_keeps_its_request():
    async def body(pool, peer):
        real = peer(b"real")
        await real.send(hello())
        await until(lambda: pool.live())
        (worker,) = pool.live()
        stream = await pool.generate(worker, p.Generate("r1", "m", [1, 2], p.Sampling(), 4))
        assert [m.request_id for m in await real.messages(5, count=1)] == ["r1"]
        rogue = peer(b"rogue")
        await rogue.send(hello(pid=666))              # for the live worker's die
        (answer,) = await rogue.messages(5, count=1)
        assert answer.code == "refused" and "live worker" in answer.message
        assert pool.live() == [worker] and worker.requests == {"r1"}
        assert stream.queue.empty()                    # no WorkerLost for its request
        await real.send(p.Tokens("r1", [7], "length"))
        assert (await asyncio.wait_for(stream.next(), 5)).tokens == [7]
        # a restarted worker gets in once the old one's connection is gone
        real.close()
        newcomer = peer(b"newcomer")
        deadline = time.monotonic() + 20
        while pool.live() == [worker]:                 # its heartbeats would ask again
            assert time.monotonic() < deadline
            await newcomer.send(hello(pid=777))
            await asyncio.sleep(0.2)
        (joined,) = pool.live()
        assert joined.hello.pid == 777 and worker.lost_reason == "its connection dropped"
    run(lambda addr: WorkerPool(addr, external=True), body)


def test_a_burst_of_sends_to_a_worker_that_is_not_reading_is_not_a_loss():
    """Thousands of sends while the worker reads nothing fill its queue (high-water
    marks on both sides; the socket stays writable through the worker's heartbeat
    pipe, so each send is tried and refused): they wait, in order, and none declares
    the worker lost."""
    async def body(pool, peer):
        busy = peer(b"busy", rcvhwm=10)
        await busy.send(hello())
        await until(lambda: pool.live())
        beats = peer(b"busy" + p.HEARTBEAT_SUFFIX)   # its heartbeat socket: a pipe with room
        await beats.send(beat())
        (worker,) = pool.live()
        n, prompt = 3000, [70_000] * 2_500   # 37 MB: past the kernel's buffers and both HWMs
        sends = asyncio.gather(*(pool.send(worker, p.Generate(f"r{i}", "m", prompt, p.Sampling(), 1))
                                 for i in range(n)), return_exceptions=True)
        await asyncio.sleep(0.5)                       # the queue is full by now
        assert worker.alive, worker.lost_reason
        got, end = [], time.monotonic() + 60
        while len(got) < n and time.monotonic() < end:   # the worker reads again
            got += [m.request_id for m in await busy.messages(0.2)
                    if isinstance(m, p.Generate)]        # (and the probes of its silence)
        assert got == [f"r{i}" for i in range(n)]
        assert await sends == [None] * n
        assert worker.alive
    run(lambda addr: WorkerPool(addr, external=True), body)


def test_a_hung_spawned_worker_is_lost_and_handed_over_while_one_answering_probes_lives():
    async def body(pool, peer):
        hung = []
        pool.on_hung.append(hung.append)
        pool.expect("a", "cpu", 1)
        pool.expect("b", "cpu:1", 2)
        frozen, frozen_hb = peer(b"frozen"), peer(b"frozen" + p.HEARTBEAT_SUFFIX)
        awake, awake_hb = peer(b"awake"), peer(b"awake" + p.HEARTBEAT_SUFFIX)
        await frozen.send(hello("cpu", 1, "a"))
        await awake.send(hello("cpu:1", 2, "b"))
        await until(lambda: len(pool.live()) == 2)
        stuck = next(w for w in pool.live() if w.die == "cpu")
        stream = await pool.generate(stuck, p.Generate("r1", "m", [1], p.Sampling(), 4))
        await frozen_hb.send(beat("cpu", 1))
        await awake_hb.send(beat("cpu:1", 2))

        async def answer_probes():                     # what a live heartbeat thread does
            while True:
                msg = p.decode(await awake_hb.sock.recv())
                if isinstance(msg, p.Ping):
                    await awake_hb.send(beat("cpu:1", 2))
        answering = asyncio.ensure_future(answer_probes())
        try:
            await until(lambda: hung, timeout=30)
            assert hung == [stuck] and not stuck.alive and "no answer to a probe" in \
                stuck.lost_reason
            assert isinstance(stream.queue.get_nowait(), WorkerLost)   # failed at once
            (alive,) = pool.live()
            assert alive.die == "cpu:1"                # silent past lost_after, but answering
        finally:
            answering.cancel()
    run(lambda addr: WorkerPool(addr, slow_after_s=0.5, lost_after_s=1.5), body)


def test_a_request_its_worker_never_answers_fails_at_the_deadline():
    """A worker takes each Generate (Accepted) or refuses it (an Error naming it); one that
    says neither, say because it could not read the message, fails at the deadline."""
    async def main():
        addr = f"tcp://127.0.0.1:{free_port()}"
        pool = WorkerPool(addr, answer_deadline_s=0.5, external=True)
        pool.start()
        peer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        peer.setsockopt(zmq.LINGER, 0)
        peer.connect(addr)
        try:
            await peer.send(p.encode(p.Hello("cpu", "cpu", "cpu", 1, 1, 1, pid=1)))
            while not pool.live():
                await asyncio.sleep(0.05)
            worker = pool.live()[0]
            silent = await pool.generate(worker, p.Generate("r1", "m", [1], p.Sampling(), 2))
            taken = await pool.generate(worker, p.Generate("r2", "m", [1], p.Sampling(), 2))
            refused = await pool.generate(worker, p.Generate("r3", "m", [1], p.Sampling(), 2))
            await peer.recv()
            await peer.recv()
            await peer.send(p.encode(p.Accepted("r2")))
            await peer.send(p.encode(p.Error("no", code="bad_request", request_id="r3")))
            err = await asyncio.wait_for(refused.next(), 5)
            assert isinstance(err, p.Error) and err.code == "bad_request"
            late = await asyncio.wait_for(silent.next(), 10)
            assert isinstance(late, p.Error) and late.code == "no_answer"
            assert taken.queue.empty() and "r2" not in pool.unanswered
            abort = p.decode(await asyncio.wait_for(peer.recv(), 5))   # the silent one's
            while not isinstance(abort, p.Abort):
                abort = p.decode(await asyncio.wait_for(peer.recv(), 5))
            assert abort.request_id == "r1"
        finally:
            peer.close()
            await pool.close()
    asyncio.run(main())
