"""frontend/workers.py in-process, with a pyzmq peer standing in for a worker."""
import asyncio

import zmq
import zmq.asyncio

from cluster import free_port
from pantheon.common import protocol as p
from pantheon.frontend.workers import WorkerPool


def test_a_request_its_worker_never_answers_fails_at_the_deadline():
    """A worker takes each Generate (Accepted) or refuses it (an Error naming it); one that
    says neither, say because it could not read the message, fails at the deadline."""
    async def main():
        addr = f"tcp://127.0.0.1:{free_port()}"
        pool = WorkerPool(addr, answer_deadline_s=0.5)
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
