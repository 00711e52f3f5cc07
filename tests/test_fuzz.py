"""Property-based fuzzing of every decoder a peer can reach: `protocol.decode`, the
worker's receive loop, the frontend's worker socket and admin socket, and the HTTP
endpoints. Each answers bad input with a ProtocolError / Error / 4xx OpenAI error and
keeps running: a well-formed request right after still succeeds.

A bounded number of examples in `make test`; `pytest --run-long -m long
tests/test_fuzz.py` runs each with many more.
"""
import subprocess
import sys
import time

import httpx
import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiny_models as tm
from cluster import Server, free_port
from pantheon.common import protocol as p
from test_worker_protocol import FakeFrontend

FEW, MANY = 40, 1500


def budget(n: int):
    return settings(max_examples=n, deadline=None, derandomize=n == FEW,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


# -- strategies --------------------------------------------------------------------------
scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1)
           | st.floats(allow_nan=True) | st.text(max_size=12) | st.binary(max_size=8))
packable = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=8) | st.integers(-5, 5), inner, max_size=4), max_leaves=16)


def shaped(kinds: list[str]):
    """Maps that look like messages of `kinds`: the right tag, the class's own field
    names, values of any type."""
    def one(kind):
        names = p.field_names(p.MESSAGES[kind])
        return st.fixed_dictionaries(
            {"v": st.just(p.PROTOCOL) | packable, "k": st.just(kind)},
            optional={name: packable for name in names})
    return st.sampled_from(kinds).flatmap(one).map(lambda m: msgpack.packb(m, use_bin_type=True))


SAMPLES = [p.encode(m) for m in [
    p.Generate("r", "m", [1, 2, 3], p.Sampling(temperature=0.5, logit_bias={3: 1.0}), 4),
    p.Tokens("r", [5, 6], "stop", 3, 2, 0, [[-0.1, [[5, -0.1]]]]),
    p.Outputs([p.Tokens("r", [1])]), p.Abort("r"), p.AdminRequest("status", {"a": 1}, "t"),
    p.Heartbeat("cpu", 1, 0, 10, 5, 5, 0, 1, 0.0), p.Load("m", "/x.gguf", "m")]]


@st.composite
def mutated(draw):
    data = bytearray(draw(st.sampled_from(SAMPLES)))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(data) - 1))
        action = draw(st.sampled_from(["flip", "cut", "insert"]))
        if action == "flip":
            data[i] ^= draw(st.integers(1, 255))
        elif action == "cut":
            del data[i:]
            if not data:
                break
        else:
            data[i:i] = draw(st.binary(min_size=1, max_size=4))
    return bytes(data)


def frames(kinds: list[str]):
    return st.binary(max_size=64) | mutated() | shaped(kinds) | packable.map(
        lambda v: msgpack.packb(v, use_bin_type=True))


WORKER_BOUND = ["load", "unload", "generate", "abort", "ping", "error"]   # not shutdown
FRONTEND_BOUND = ["heartbeat", "loaded", "load_failed", "load_progress", "unloaded",
                  "tokens", "outputs", "error", "stopping"]               # not hello


# -- protocol.decode -----------------------------------------------------------------------
def decode_only_raises_protocol_errors(n):
    @budget(n)
    @given(frames(list(p.MESSAGES)))
    def run(data):
        try:
            msg = p.decode(data)
        except p.ProtocolError:
            return
        assert type(msg) in p.KIND_OF
        again = p.encode(msg)                          # what it accepts, it round-trips
        assert p.encode(p.decode(again)) == again
    run()


def test_decode_only_raises_protocol_errors():
    decode_only_raises_protocol_errors(FEW * 10)


@pytest.mark.slow
@pytest.mark.long
def test_decode_only_raises_protocol_errors_long():
    decode_only_raises_protocol_errors(MANY * 20)


# -- the worker's receive path -----------------------------------------------------------
@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    fe = FakeFrontend()
    log = tmp_path_factory.mktemp("fuzz-worker") / "worker.log"    # a line per bad frame
    proc = subprocess.Popen([sys.executable, "-m", "pantheon.cli", "worker", "--die", "cpu",
                             "--frontend", f"tcp://127.0.0.1:{fe.port}", "--slots", "1",
                             "--insecure"],
                            stdout=subprocess.DEVNULL, stderr=log.open("w"))
    fe.recv(p.Hello)
    yield fe, proc
    assert "Traceback" not in log.read_text()
    proc.kill()
    proc.wait()


def probe_worker(fe: FakeFrontend, i: int) -> None:
    """The loop still runs: a request for a model it lacks gets its Error back."""
    fe.send(p.Generate(f"probe-{i}", "none", [1], p.Sampling(), 1))
    while True:
        msg = fe.recv(p.Error, timeout=60)
        if msg.request_id == f"probe-{i}":
            assert msg.code == "unknown_model"
            return


def worker_survives(worker, n):
    fe, proc = worker
    count = iter(range(10**9))

    @budget(n)
    @given(frames(WORKER_BOUND))
    def run(data):
        fe.send(data)
        probe_worker(fe, next(count))
    run()
    assert proc.poll() is None


def test_the_worker_answers_random_frames_and_keeps_running(worker):
    worker_survives(worker, FEW)


@pytest.mark.slow
@pytest.mark.long
def test_the_worker_answers_random_frames_and_keeps_running_long(worker):
    worker_survives(worker, MANY)


# -- the frontend: its worker socket, admin socket and HTTP endpoints ----------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tm.write_gguf("llama", tmp_path_factory.mktemp("fuzz") / "tiny.gguf")
    srv = Server("--model", str(model), "--name", "tiny", "--ctx", "128", "--slots", "2",
                 "--max-request-tokens", "32", "--admin-key", "adm", "--queue-timeout", "5")
    srv.admin_addr = srv.args[srv.args.index("--admin-addr") + 1]
    with srv:
        yield srv


def well_formed(srv) -> None:
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text


def no_tracebacks(srv) -> None:
    logs = srv.logs()
    assert "Traceback" not in logs and "unhandled" not in logs, logs


def pool_survives(srv, n):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{srv.zport}")

    @budget(n)
    @given(frames(FRONTEND_BOUND))
    def run(data):
        sock.send(data)
    try:
        run()
        time.sleep(0.5)
        well_formed(srv)
        no_tracebacks(srv)
    finally:
        sock.close()


def test_the_worker_socket_drops_random_frames_and_serves_on(server):
    pool_survives(server, FEW * 5)


@pytest.mark.slow
@pytest.mark.long
def test_the_worker_socket_drops_random_frames_and_serves_on_long(server):
    pool_survives(server, MANY * 5)


def admin_request(sock, data: bytes, token: bytes = b"adm"):
    sock.send_multipart([token, data])      # the token in its own frame, then the request
    if not sock.poll(30_000):
        return None
    return p.decode(sock.recv())


def admin_survives(srv, n):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(srv.admin_addr)
    args = st.dictionaries(st.sampled_from(["path", "name", "die", "dies", "ctx", "slots",
                                            "timeout_s", "quantize"]) | st.text(max_size=5),
                           packable, max_size=4)
    requests = st.builds(lambda cmd, a, tok: msgpack.packb(
        {"v": p.PROTOCOL, "k": "admin_request", "cmd": cmd, "args": a, "token": tok}),
        st.sampled_from(["load", "unload", "status", "dies", "models"]) | st.text(max_size=6),
        args, st.sampled_from(["adm", "", "wrong"]))

    @budget(n)
    @given(requests | frames(["admin_request", "admin_reply"]), st.sampled_from([b"adm", b"x"]))
    def run(data, token):
        sock.send_multipart([token, data])     # past the token (or not): decoded, or a 401
        while sock.poll(50):            # answers to malformed frames: 4xx replies
            reply = p.decode(sock.recv())
            if isinstance(reply, p.AdminReply):
                assert 400 <= reply.status < 500 or reply.status == 200, reply
    try:
        run()
        ok = admin_request(sock, p.encode(p.AdminRequest("status", {}, "adm")))
        while isinstance(ok, p.AdminReply) and ok.body.get("service") != "pantheon":
            ok = p.decode(sock.recv()) if sock.poll(30_000) else None   # late replies
        assert isinstance(ok, p.AdminReply) and ok.status == 200
        well_formed(srv)
        no_tracebacks(srv)
    finally:
        sock.close()


def test_the_admin_socket_answers_random_requests_and_serves_on(server):
    admin_survives(server, FEW * 2)


@pytest.mark.slow
@pytest.mark.long
def test_the_admin_socket_answers_random_requests_and_serves_on_long(server):
    admin_survives(server, MANY)


CHAT_FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "n", "stop",
               "stream", "stream_options", "tools", "tool_choice", "temperature", "top_p",
               "top_k", "logit_bias", "response_format", "logprobs", "top_logprobs", "seed",
               "session_id", "return_token_ids", "presence_penalty", "user"]
COMPLETION_FIELDS = ["model", "prompt", "max_tokens", "n", "echo", "logprobs", "stop",
                     "stream", "suffix", "best_of", "temperature", "seed", "response_format"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3), max_leaves=12)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "x"]),
     "content": st.text(max_size=20) | json_values}), min_size=0, max_size=3)


def bodies(fields):
    values = {f: json_values for f in fields} | {"messages": messages | json_values,
                                                 "model": st.just("tiny") | json_values}
    return st.fixed_dictionaries({}, optional=values)


ROUTES = [("/v1/chat/completions", bodies(CHAT_FIELDS)),
          ("/v1/completions", bodies(COMPLETION_FIELDS)),
          ("/admin/models/load", st.dictionaries(st.sampled_from(
              ["path", "name", "dies", "ctx", "slots", "quantize"]), json_values)),
          ("/admin/models/unload", st.dictionaries(st.sampled_from(
              ["name", "die", "timeout_s"]), json_values))]


def http_survives(srv, n):
    client = httpx.Client(base_url=srv.url, timeout=60,
                          headers={"Authorization": "Bearer adm"})
    route = st.sampled_from(range(len(ROUTES))).flatmap(
        lambda i: st.tuples(st.just(ROUTES[i][0]), ROUTES[i][1] | json_values
                            | st.binary(max_size=30)))

    @budget(n)
    @given(route)
    def run(case):
        path, body = case
        r = client.post(path, content=body) if isinstance(body, bytes) else \
            client.post(path, json=body)
        assert r.status_code < 500, (path, body, r.text)
        if r.status_code >= 400:
            err = r.json()["error"]
            assert isinstance(err["message"], str) and isinstance(err["type"], str)
    try:
        run()
        well_formed(srv)
        no_tracebacks(srv)
    finally:
        client.close()


def test_random_json_bodies_get_4xx_openai_errors(server):
    http_survives(server, FEW * 2)


@pytest.mark.slow
@pytest.mark.long
def test_random_json_bodies_get_4xx_openai_errors_long(server):
    http_survives(server, MANY)
