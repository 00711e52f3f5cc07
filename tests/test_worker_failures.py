"""A worker that dies is seen, its requests fail fast, and the cluster recovers."""
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from cluster import Server
from pantheon.common.default_model import cached_path

pytestmark = pytest.mark.skipif(not cached_path().exists(), reason="default model not fetched")

QUESTION = [{"role": "user", "content": "Tell me a long story."}]
NO_EOS = {"2": -100, "0": -100}


def long_stream(server):
    return server.client().chat.completions.create(
        model="m", messages=QUESTION, max_tokens=400, stream=True, logit_bias=NO_EOS)


def test_killed_spawned_worker_fails_requests_and_is_restarted():
    with Server("--slots", "2", "--ctx", "512") as srv:
        stream = long_stream(srv)
        next(iter(stream))                              # generation is under way
        failure = {}

        def non_stream():
            try:
                srv.client().chat.completions.create(model="m", messages=QUESTION,
                                                     max_tokens=400, logit_bias=NO_EOS)
            except openai.APIStatusError as exc:
                failure["status"] = exc.status_code
        t = threading.Thread(target=non_stream)
        t.start()
        time.sleep(0.5)
        (worker,) = srv.workers()
        worker.kill()
        started = time.monotonic()
        with pytest.raises(openai.APIError, match="went away"):
            for _ in stream:
                pass
        t.join(30)
        assert failure == {"status": 503}
        assert time.monotonic() - started < 10           # seen at once, not at a timeout
        assert httpx.get(srv.url + "/health").status_code == 503   # nothing ready meanwhile
        srv.wait_healthy(60)                             # respawned and reloaded
        assert srv.workers()[0].pid != worker.pid
        (model,) = httpx.get(srv.url + "/admin/models").json()["models"]
        assert model["replicas"][0]["loads"] == 2
        (die,) = httpx.get(srv.url + "/admin/dies").json()["dies"]
        assert die["state"] == "ready" and die["pid"] == srv.workers()[0].pid
        r = srv.client().chat.completions.create(model="m", messages=QUESTION, max_tokens=3)
        assert r.usage.completion_tokens == 3


def start_worker(srv, die="cpu"):
    return subprocess.Popen([sys.executable, "-m", "pantheon.cli", "worker", "--die", die,
                             "--frontend", f"tcp://127.0.0.1:{srv.zport}", "--slots", "2",
                             "--insecure"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def health_when_up(srv, timeout=60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return httpx.get(srv.url + "/health").status_code
        except httpx.ConnectError:
            time.sleep(0.2)
    raise TimeoutError(srv.logs())


def test_external_worker_is_used_again_when_it_reconnects():
    srv = Server("--no-spawn", "--insecure", "--ctx", "512", "--worker-timeout", "2")
    srv.proc = subprocess.Popen([sys.executable, "-m", "pantheon.cli", *srv.args],
                                stdout=srv.log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        assert health_when_up(srv) == 503                           # no worker yet
        worker = start_worker(srv)
        srv.wait_healthy(60)
        stream = long_stream(srv)
        next(iter(stream))
        worker.kill()
        with pytest.raises(openai.APIError, match="went away"):
            for _ in stream:
                pass
        worker.wait()
        assert httpx.get(srv.url + "/health").status_code == 503
        worker = start_worker(srv)                        # the supervisor's restart
        srv.wait_healthy(60)
        r = srv.client().chat.completions.create(model="m", messages=QUESTION, max_tokens=3)
        assert r.usage.completion_tokens == 3
        worker.terminate()
        worker.wait(10)
    finally:
        srv.stop()


def test_spawned_workers_exit_when_their_frontend_dies():
    srv = Server("--slots", "1", "--ctx", "128").start()
    try:
        (worker,) = srv.workers()
        srv.proc.kill()                                   # the frontend only, not its group
        srv.proc.wait()
        worker.wait(15)                                   # raises if still running
    finally:
        srv.stop()
