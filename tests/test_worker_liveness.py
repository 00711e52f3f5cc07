"""A busy worker is not a dead worker: real servers, real workers, a contended host.

Slow (silent, or inside a long step) keeps a worker's requests; a worker is lost when
its process exits, its link drops, or it answers neither heartbeats nor probes for
--worker-lost-after (a spawned one is then killed and restarted); a worker that comes
back still holding its models keeps them; nobody else's hello takes its die.
"""
import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import time

import httpx
import msgpack
import openai
import psutil
import pytest
import zmq

from cluster import Server, Stream
from pantheon.common import protocol as p
from pantheon.common.default_model import cached_path

pytestmark = pytest.mark.skipif(not cached_path().exists(), reason="default model not fetched")

NO_EOS = {"2": -100, "0": -100}
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}]


def admin(srv, what):
    return httpx.get(f"{srv.url}/admin/{what}", timeout=10).json()


def replicas(srv):
    return {r["id"]: r for m in admin(srv, "models")["models"] for r in m["replicas"]}


def dies(srv):
    return {d["die"]: d for d in admin(srv, "dies")["dies"]}


def wait_for(predicate, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(what)


def hogs(n: int, seconds: float) -> list[subprocess.Popen]:
    """n CPU-bound processes that end on their own after `seconds`."""
    code = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


def stream_text(srv, content, max_tokens, **kw):
    stream = srv.client(timeout=180).chat.completions.create(
        model="m", messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
        stream=True, stream_options={"include_usage": True}, logit_bias=NO_EOS, **kw)
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
    return usage.completion_tokens


def test_a_contended_host_loses_no_request_and_reloads_nothing():
    """Six CPU hogs beside the server (the worker gets about a quarter of the host),
    a one-second silence threshold: a first constrained request, a long prefill and
    concurrent streams all finish; the worker is never lost and its model never
    reloaded."""
    with Server("--slots", "6", "--ctx", "1024", "--worker-timeout", "1") as srv:
        (worker,) = srv.workers()
        busy = hogs(6, 120)
        try:
            with cf.ThreadPoolExecutor(6) as pool:
                tool = pool.submit(lambda: srv.client(timeout=180).chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "Weather in Paris?"}],
                    max_tokens=60, temperature=0, tools=WEATHER, tool_choice={
                        "type": "function", "function": {"name": "get_weather"}}))
                long = pool.submit(stream_text, srv, "Summarize: " + "the cat sat. " * 150, 8)
                streams = [pool.submit(stream_text, srv, f"Count to {i + 5}.", 24)
                           for i in range(4)]
                reply = tool.result()
                assert reply.choices[0].message.tool_calls[0].function.name == "get_weather"
                assert long.result() == 8
                assert [s.result() for s in streams] == [24] * 4
        finally:
            for hog in busy:
                hog.kill()
        assert srv.workers()[0].pid == worker.pid
        (replica,) = replicas(srv).values()
        assert replica["loads"] == 1 and replica["state"] == "ready"
        assert "lost" not in srv.logs() and "worker_lost" not in srv.logs()


def test_a_stalled_step_is_slow_not_lost_and_its_streams_finish():
    """A step that takes 6 s (the test hook) with a 1 s threshold: the die shows slow
    with the step's age, new requests go to the other replica, and the stalled stream
    finishes whole."""
    env = {"PANTHEON_TEST_STALL": "4:6@cpu"}
    with Server("--spawn-workers", "cpu,cpu", "--slots", "2", "--ctx", "256",
                "--worker-timeout", "1", env=env) as srv:
        r = httpx.post(srv.url + "/admin/models/load", timeout=120, json={
            "path": str(cached_path()), "name": srv_name(srv), "dies": ["cpu:1"],
            "slots": 2, "ctx": 256})
        assert r.status_code == 200, r.text
        by_die = {r["die"]: r for r in replicas(srv).values()}
        assert set(by_die) == {"cpu", "cpu:1"}
        with cf.ThreadPoolExecutor(1) as pool:
            stalled = pool.submit(stream_text, srv, "Tell me a story.", 30)
            # (on a loaded host a late beat can make the die slow for a moment before
            # the stall does: wait for the stalled step itself)
            slow = wait_for(lambda: (d := dies(srv)["cpu"])["state"] == "slow"
                            and d["step_s"] >= 1.0 and d, what="die cpu slow in its step")
            assert slow["heartbeat_age_s"] < 1.0                            # beats go on
            health = httpx.get(srv.url + "/health").json()
            assert {w["die"]: w["state"] for w in health["workers"]} == {
                "cpu": "slow", "cpu:1": "ready"}
            served = replicas(srv)
            for _ in range(2):              # routed past the slow replica, not onto it
                r = srv.client().chat.completions.create(
                    model=srv_name(srv), messages=[{"role": "user", "content": "Hi"}],
                    max_tokens=2, logit_bias=NO_EOS)
                assert r.usage.completion_tokens == 2
            after = replicas(srv)
            ids = {r["die"]: r["id"] for r in after.values()}
            assert after[ids["cpu:1"]]["served"] - served[ids["cpu:1"]]["served"] == 2
            assert after[ids["cpu"]]["served"] == served[ids["cpu"]]["served"]
            assert stalled.result() == 30
        wait_for(lambda: dies(srv)["cpu"]["state"] == "ready", what="die cpu ready again")
        assert "lost" not in srv.logs()


def srv_name(srv):
    return admin(srv, "models")["models"][0]["name"]


def start_worker(srv, die="cpu"):
    return subprocess.Popen([sys.executable, "-m", "pantheon.cli", "worker", "--die", die,
                             "--frontend", f"tcp://127.0.0.1:{srv.zport}", "--slots", "2",
                             "--insecure"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def start_unspawned(srv):
    srv.proc = subprocess.Popen([sys.executable, "-m", "pantheon.cli", *srv.args],
                                stdout=srv.log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    wait_for(lambda: up(srv), 60, "frontend up")


def up(srv):
    try:
        return httpx.get(srv.url + "/health", timeout=2).status_code in (200, 503)
    except httpx.HTTPError:
        return False


def test_a_silent_external_worker_is_lost_after_the_grace_then_kept_when_it_returns():
    """SIGSTOP freezes an external worker (its link stays up): slow after 1 s, lost
    after the 3 s grace (its stream fails), and when it resumes it rejoins still holding
    the model, which is kept, not reloaded."""
    srv = Server("--no-spawn", "--insecure", "--ctx", "512", "--worker-timeout", "1",
                 "--worker-lost-after", "3")
    start_unspawned(srv)
    worker = start_worker(srv)
    try:
        srv.wait_healthy(60)
        stream = srv.client().chat.completions.create(
            model="m", messages=[{"role": "user", "content": "A long story."}],
            max_tokens=400, stream=True, logit_bias=NO_EOS)
        next(iter(stream))
        worker.send_signal(signal.SIGSTOP)
        wait_for(lambda: dies(srv)["cpu"]["state"] == "slow", 10, "slow")
        started = time.monotonic()
        with pytest.raises(openai.APIError, match="went away"):
            for _ in stream:
                pass
        assert time.monotonic() - started < 10
        assert dies(srv)["cpu"]["state"] == "lost"
        assert httpx.get(srv.url + "/health").status_code == 503
        worker.send_signal(signal.SIGCONT)
        srv.wait_healthy(30)
        (replica,) = replicas(srv).values()
        assert replica["loads"] == 1                           # kept, not reloaded
        assert "kept, not reloaded" in srv.logs()
        assert dies(srv)["cpu"]["pid"] == worker.pid
        r = srv.client().chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        assert r.usage.completion_tokens == 3
    finally:
        worker.send_signal(signal.SIGCONT)
        worker.kill()
        worker.wait()
        srv.stop()


class FakePeer:
    def __init__(self, srv, ident: bytes):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, ident)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{srv.zport}")

    def send(self, msg):
        self.sock.send(msg if isinstance(msg, bytes) else p.encode(msg))

    def messages(self, seconds: float, count: int = 0):
        """What arrives within `seconds` (or the first `count` messages)."""
        out, deadline = [], time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0 and not 0 < count <= len(out):
            if self.sock.poll(int(left * 1000) + 1):
                out.append(p.decode(self.sock.recv()))
        return out

    def close(self):
        self.sock.close()


def test_strange_peers_are_dropped_and_claimed_replicas_unloaded():
    """Heartbeats before a hello, from the wrong socket or with a wrong pid, malformed
    hellos: dropped and logged, the server unharmed. A worker that claims a replica
    the frontend never placed is told to unload it."""
    srv = Server("--no-spawn", "--insecure", "--ctx", "256")
    start_unspawned(srv)
    peers = []
    try:
        beat = p.Heartbeat("cpu", 0, 0, 1, 1, 1, 0, pid=4242)
        stranger = FakePeer(srv, b"nobody" + p.HEARTBEAT_SUFFIX)
        peers.append(stranger)
        stranger.send(beat)                                     # no hello before it
        assert any(isinstance(m, p.Error) and m.code == "unknown_worker"
                   for m in stranger.messages(1.0))
        main = FakePeer(srv, b"fake-1")
        peers.append(main)
        main.send(beat)                                         # a beat from a main socket
        main.send(msgpack.packb({"v": p.PROTOCOL, "k": "hello", "die": 7}))   # malformed
        main.send(b"\xc1\xc1")
        main.send(p.Hello("cpu", "cpu", "fake", 1 << 30, 1 << 30, 2, pid=4242,
                          models=["ghost#9"],
                          replicas=[p.Resident("ghost#9", "/nowhere.gguf", 2, 256)]))
        got = main.messages(3.0)
        assert p.Unload("ghost#9") in got
        hb = FakePeer(srv, b"fake-1" + p.HEARTBEAT_SUFFIX)
        peers.append(hb)
        hb.send(p.Heartbeat("cpu", 0, 0, 1, 1, 1, 0, pid=9999))  # not the hello's pid
        hb.send(beat)                                           # the right one
        time.sleep(0.5)
        (die,) = admin(srv, "dies")["dies"]
        assert die["pid"] == 4242 and die["state"] == "ready"
        assert die["heartbeat_age_s"] < 1.0
        assert httpx.get(srv.url + "/").status_code == 200
        log = srv.logs()
        assert "dropped Heartbeat before a hello from peer b'nobody~hb'" in log
        assert "dropped a Heartbeat from the wrong socket from peer b'fake-1'" in log
        assert "refused a message" in log and "not placed there" in log
    finally:
        for peer in peers:
            peer.close()
        srv.stop()


@pytest.fixture(scope="module")
def guarded():
    """A default server (spawned CPU worker, no keys) that loses a silent worker after
    3 s; every step lasts at least 50 ms, so a 24-token stream runs for 1.2 s or more."""
    with Server("--ctx", "512", "--slots", "2", "--worker-timeout", "1",
                "--worker-lost-after", "3", env={"PANTHEON_TEST_STEP_FLOOR": "0.05"}) as srv:
        yield srv


def test_a_rogue_hello_is_refused_and_the_worker_keeps_its_streams(guarded):
    """Any local process can reach the worker port: its hello for die cpu is refused
    (no spawn proof, and the die has a live worker), the stream already running
    finishes whole with the text it gives alone, and the rogue never gets a prompt."""
    srv = guarded
    (worker,) = srv.workers()
    ask = {"model": "m", "messages": [{"role": "user", "content": "Tell me about ships."}],
           "max_tokens": 24, "temperature": 0, "logit_bias": NO_EOS}
    want = httpx.post(srv.url + "/v1/chat/completions", json=ask, timeout=120).json()
    stream = Stream(srv.url, ask)
    stream.start()
    assert stream.first.wait(60)
    rogue = FakePeer(srv, b"rogue")
    try:
        rogue.send(p.Hello("cpu", "cpu", "fake", 1 << 30, 1 << 30, 2, pid=4242))
        rogue.send(p.Hello("cpu:9", "cpu", "fake", 1 << 30, 1 << 30, 2, pid=4242,
                           proof="guess"))               # a die nobody holds: no proof
        answers = rogue.messages(10, count=2)
        stream.join(120)
        assert stream.status == 200 and stream.error() is None, stream.events[-3:]
        text = "".join(c["choices"][0]["delta"].get("content") or ""
                       for c in stream.chunks() if c["choices"])
        assert text == want["choices"][0]["message"]["content"]
        assert stream.usage()["completion_tokens"] == 24
        r = srv.client().chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        assert r.usage.completion_tokens == 3
        answers += rogue.messages(0.2)
        assert [(type(m), m.code) for m in answers] == [(p.Error, "refused")] * 2
        assert {d: (x["pid"], x["state"]) for d, x in dies(srv).items()} == {
            "cpu": (worker.pid, "ready")}
        log = full_log(srv)
        assert "refused a hello for die cpu (pid 4242) from peer b'rogue': it is not a " \
            "worker this frontend spawned" in log
        assert log.count("refused a hello") == 1 and "lost" not in log   # once a peer
    finally:
        rogue.close()


def test_a_sigstopped_spawned_worker_is_killed_and_restarted(guarded):
    """SIGSTOP freezes the spawned worker, heartbeat thread and all: it answers no
    probe, so after --worker-lost-after its requests fail (a streamed one with an error
    event, a plain one with a 503 worker_lost) instead of waiting for ever, and the
    frontend kills it and starts another, which serves."""
    srv = guarded
    (worker,) = srv.workers()
    stream = srv.client(timeout=60).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "A long story."}],
        max_tokens=400, stream=True, logit_bias=NO_EOS)
    next(iter(stream))
    with cf.ThreadPoolExecutor(1) as pool:
        plain = pool.submit(httpx.post, srv.url + "/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": [{"role": "user", "content": "Another story."}],
            "max_tokens": 400, "logit_bias": NO_EOS})
        wait_for(lambda: [r["in_flight"] for r in replicas(srv).values()] == [2], 30,
                 "both requests running")
        worker.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(openai.APIError, match="went away"):
                for _ in stream:
                    pass
            r = plain.result()
            assert r.status_code == 503 and r.json()["error"]["code"] == "worker_lost"
            wait_for(lambda: not worker.is_running()
                     or worker.status() == psutil.STATUS_ZOMBIE, 30, "the hung worker killed")
        finally:
            try:
                worker.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass
    srv.wait_healthy(120)                                    # restarted and reloaded
    (again,) = srv.workers()
    assert again.pid != worker.pid and dies(srv)["cpu"]["pid"] == again.pid
    r = srv.client().chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert r.usage.completion_tokens == 3
    log = full_log(srv)
    assert "no answer to a probe" in log and "killing the hung worker for die cpu" in log


def full_log(srv) -> str:
    with open(srv.log.name, errors="replace") as fh:
        return fh.read()
