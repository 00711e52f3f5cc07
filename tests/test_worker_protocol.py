"""A real `pantheon worker` process driven over ZeroMQ by the test itself."""
import os
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
        self.pending = []          # Tokens of an Outputs message not yet returned
        self.kinds = set()         # message types seen

    def recv(self, kind=None, timeout=30.0):
        """The next message (of `kind`, skipping heartbeats), decoded; a step's Outputs
        come out as its Tokens, one by one."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.pending:
                msg = self.pending.pop(0)
            else:
                if not self.sock.poll(200):
                    continue
                ident, data = self.sock.recv_multipart()
                if not ident.endswith(p.HEARTBEAT_SUFFIX):   # heartbeats have their own socket
                    self.ident = ident
                msg = p.decode(data)
                self.kinds.add(type(msg))
                if isinstance(msg, p.Outputs):
                    self.pending += msg.outputs
                    continue
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
                             "--frontend", f"tcp://127.0.0.1:{fe.port}", "--slots", "2",
                             "--insecure"])
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
    assert p.Outputs in fe.kinds                  # a step's tokens travel in one message
    assert p.Accepted in fe.kinds                 # taken at once: the frontend's deadline stops
    assert tokens[0] == int(tm.load_golden("llama")[0][-1].argmax())
    # bad requests are refused per request
    fe.send(p.Generate("r2", "tiny", [1, 999], greedy, 5))
    assert fe.recv(p.Error).code == "bad_request"
    fe.send(p.Generate("r3", "tiny", list(range(64)), greedy, 5))
    assert "context" in fe.recv(p.Error).message
    # one the decoder refuses (past a field's limit, or msgpack's) still names its request
    for session in ("s" * 257, "s" * (5 << 20)):
        fe.send(msgpack.packb({"v": p.PROTOCOL, "k": "generate", "request_id": "r3b",
                               "model_id": "tiny", "prompt": [1], "sampling": {},
                               "max_tokens": 2, "session_id": session}))
        err = fe.recv(p.Error)
        assert err.request_id == "r3b" and err.code == "bad_request", err
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


def test_heartbeats_go_on_through_a_stalled_step(tmp_path):
    """A step that takes 4 s (the test hook sleeps inside it) still lets heartbeats out,
    from their own socket, each saying how long the step has run; the hello after it
    lists the replica and the request it still runs."""
    fe = FakeFrontend()
    env = {**os.environ, "PANTHEON_TEST_STALL": "2:4"}
    proc = subprocess.Popen([sys.executable, "-m", "pantheon.cli", "worker", "--die", "cpu",
                             "--frontend", f"tcp://127.0.0.1:{fe.port}", "--slots", "2",
                             "--insecure"],
                            env=env)
    try:
        fe.recv(p.Hello)
        model = tm.write_gguf("llama", tmp_path / "tiny.gguf")
        fe.send(p.Load("tiny", str(model), "tiny", slots=2, ctx=64))
        fe.recv(p.Loaded)
        fe.send(p.Generate("r1", "tiny", [1, 2, 3], p.Sampling(temperature=0), 6))
        assert fe.recv(p.Tokens).tokens                      # step 1; step 2 stalls
        steps, idents = [], set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if not fe.sock.poll(200):
                continue
            ident, data = fe.sock.recv_multipart()
            msg = p.decode(data)
            if isinstance(msg, p.Heartbeat):
                steps.append(msg.step_s)
                idents.add(ident)
                assert msg.pid == proc.pid
            elif isinstance(msg, (p.Tokens, p.Outputs)):
                break
        assert max(steps) > 3.0                # beats kept coming while the step slept
        assert len([s for s in steps if s > 1.0]) >= 4
        assert all(i.endswith(p.HEARTBEAT_SUFFIX) for i in idents)
        # asked to introduce itself again (as after the frontend lost it), it lists what
        # it holds, so the frontend can keep it instead of reloading
        fe.send(p.Error("unknown worker: send hello", code="unknown_worker"))
        hello = fe.recv(p.Hello)
        assert hello.models == ["tiny"] and hello.replicas[0].path == str(model)
        assert (hello.replicas[0].slots, hello.replicas[0].ctx) == (2, 64)
        assert hello.replicas[0].weight_bytes > 0 and hello.replicas[0].kv_bytes > 0
        assert hello.running in (["r1"], [])
    finally:
        proc.kill()
        proc.wait()


def test_a_bad_grammar_fails_its_request_only(worker):
    """Grammars are prepared off the loop: a broken one is that request's error, and a
    plain request beside it runs."""
    fe, proc, model = worker
    fe.send(p.Load("tiny", str(model), "tiny", slots=2, ctx=64))
    fe.recv(p.Loaded)
    greedy = p.Sampling(temperature=0)
    fe.send(p.Generate("g1", "tiny", [1, 2, 3], greedy, 4, grammar="{not a grammar"))
    fe.send(p.Generate("r1", "tiny", [1, 2, 3], greedy, 4))
    errors, finished = [], []
    deadline = time.monotonic() + 30
    while len(errors) + len(finished) < 2 and time.monotonic() < deadline:
        msg = fe.recv()
        if isinstance(msg, p.Error):
            errors.append(msg)
        elif isinstance(msg, p.Tokens) and msg.finish:
            finished.append(msg.request_id)
    assert [e.request_id for e in errors] == ["g1"] and errors[0].code == "bad_request"
    assert finished == ["r1"]
    assert proc.poll() is None
