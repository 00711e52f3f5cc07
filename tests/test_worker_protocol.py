"""A real `pantheon worker` process driven over ZeroMQ by the test itself."""
import subprocess
import sys
import time

import msgpack
import pytest
import zmq

import tiny_models as tm
from cluster import free_port
from pantheon.common import protocol as p


class FakeFrontend:
    def __init__(self):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = free_port()
        self.sock.bind(f"tcp://127.0.0.1:{self.port}")
        self.ident = None

    def recv(self, kind=None, timeout=30.0):
        """The next message (of `kind`, skipping heartbeats), decoded."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.sock.poll(200):
                continue
            ident, data = self.sock.recv_multipart()
            self.ident = ident
            msg = p.decode(data)
            if kind is None and isinstance(msg, p.Heartbeat):
                continue
            if kind is None or isinstance(msg, kind):
                return msg
        raise TimeoutError(f"no {kind.__name__ if kind else 'message'} in {timeout} s")

    def send(self, msg):
        self.sock.send_multipart([self.ident, msg if isinstance(msg, bytes) else p.encode(msg)])


@pytest.fixture
def worker(tmp_path):
    fe = FakeFrontend()
    proc = subprocess.Popen([sys.executable, "-m", "pantheon.cli", "worker", "--die", "cpu",
                             "--frontend", f"tcp://127.0.0.1:{fe.port}", "--slots", "2"])
    hello = fe.recv(p.Hello)
    assert hello.die == "cpu" and hello.kind == "cpu" and hello.slots == 2 and hello.models == []
    assert hello.mem_total > 0
    yield fe, proc, tm.write_gguf("llama", tmp_path / "tiny.gguf")
    proc.kill()
    proc.wait()


def test_bad_messages_get_errors_and_the_worker_lives_on(worker):
    fe, proc, model = worker
    bad = [b"\xc1garbage", msgpack.packb([1, 2]), msgpack.packb({"v": 99, "k": "abort"}),
           msgpack.packb({"v": p.PROTOCOL, "k": "nuke"}),
           msgpack.packb({"v": p.PROTOCOL, "k": "abort", "request_id": 7}),
           p.encode(p.Hello("x", "cpu", "x", 1, 1, 1))]       # a frontend-bound message
    for data in bad:
        fe.send(data)
        assert isinstance(fe.recv(), p.Error)
    fe.send(p.Generate("r0", "nope", [1, 2], p.Sampling(), 4))
    err = fe.recv(p.Error)
    assert err.request_id == "r0" and err.code == "unknown_model"
    fe.send(p.Load("tiny", str(model.parent / "missing.gguf"), "tiny"))
    assert "not found" in fe.recv(p.LoadFailed).message
    assert proc.poll() is None
    fe.recv(p.Heartbeat)                                        # still beating


def test_load_generate_abort_unload_shutdown(worker):
    fe, proc, model = worker
    fe.send(p.Load("tiny", str(model), "tiny", slots=2, ctx=64))
    loaded = fe.recv(p.Loaded)
    assert (loaded.model_id, loaded.slots, loaded.ctx, loaded.vocab_size) == ("tiny", 2, 64, 320)
    greedy = p.Sampling(temperature=0)
    fe.send(p.Generate("r1", "tiny", tm.GOLDEN_TOKENS[0], greedy, 5))
    tokens, finish = [], None
    while finish is None:
        msg = fe.recv(p.Tokens)
        tokens += msg.tokens
        finish = msg.finish
    assert finish == "length" and len(tokens) == 5 and msg.completion_tokens == 5
    assert tokens[0] == int(tm.load_golden("llama")[0][-1].argmax())
    # bad requests are refused per request
    fe.send(p.Generate("r2", "tiny", [1, 999], greedy, 5))
    assert fe.recv(p.Error).code == "bad_request"
    fe.send(p.Generate("r3", "tiny", list(range(64)), greedy, 5))
    assert "context" in fe.recv(p.Error).message
    # abort a long one: it ends with finish "abort"
    fe.send(p.Generate("r4", "tiny", [1, 2, 3], greedy, 50))
    fe.recv(p.Tokens)
    fe.send(p.Abort("r4"))
    while (msg := fe.recv(p.Tokens)).finish is None:
        pass
    assert msg.finish == "abort"
    fe.send(p.Unload("tiny"))
    assert fe.recv(p.Unloaded).model_id == "tiny"
    fe.send(p.Generate("r5", "tiny", [1], greedy, 1))
    assert fe.recv(p.Error).code == "unknown_model"
    fe.send(p.Shutdown())
    assert fe.recv(p.Stopping).die == "cpu"
    assert proc.wait(10) == 0
