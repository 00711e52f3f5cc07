"""Graceful drain, with real signals sent to a real `pantheon serve` mid-stream."""
import signal
import threading
import time

import httpx
import psutil
import pytest

from cluster import Server, Stream
from pantheon.common.default_model import cached_path

pytestmark = pytest.mark.skipif(not cached_path().exists(), reason="default model not fetched")

NO_EOS = {"2": -100, "0": -100}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Tell me a long story."}],
        "logit_bias": NO_EOS}


def chat_stream(srv: Server, max_tokens: int) -> Stream:
    return Stream(srv.url, {**CHAT, "max_tokens": max_tokens})


def wait_draining(srv: Server) -> dict:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        r = httpx.get(srv.url + "/health", timeout=5)
        if r.status_code == 503:
            return r.json()
        time.sleep(0.05)
    raise AssertionError("/health never turned 503")


def gone(procs: list[psutil.Process]) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in procs):
            return True
        time.sleep(0.1)
    return False


def test_sigterm_finishes_running_and_queued_streams_and_refuses_new_requests():
    with Server("--slots", "2", "--ctx", "512", "--shutdown-timeout", "120") as srv:
        workers = srv.workers()
        streams = [chat_stream(srv, 150) for _ in range(3)]   # two run, the third waits
        for s in streams:
            s.start()
        waiting = 'vllm:num_requests_waiting{model_name="SmolLM2-135M-Instruct"} 1.0'
        deadline = time.monotonic() + 60          # whichever two run, the third waits
        while waiting not in httpx.get(srv.url + "/metrics").text:
            assert time.monotonic() < deadline, ("the third stream never waited",
                                                 [x.status for x in streams], srv.logs())
            time.sleep(0.05)
        srv.proc.send_signal(signal.SIGTERM)
        assert wait_draining(srv)["status"] == "draining"
        refused = httpx.post(srv.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2},
                             timeout=30)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "shutting_down"
        assert int(refused.headers["retry-after"]) > 0
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        assert "pantheon:draining 1.0" in metrics
        rejected = [line for line in metrics.splitlines()
                    if line.startswith("pantheon:requests_rejected_total")]
        assert rejected == ['pantheon:requests_rejected_total{model_name="SmolLM2-135M-'
                            'Instruct",reason="shutting_down",status="503"} 1.0'], rejected
        for s in streams:
            s.join(120)
            assert s.status == 200 and s.error() is None, s.events[-3:]
            assert s.usage()["completion_tokens"] == 150
            assert s.events[-1] == "[DONE]"
        assert srv.proc.wait(60) == 0, srv.logs()
        assert gone(workers), "a worker outlived its frontend"
        assert "draining" in srv.logs()


def test_the_deadline_ends_what_still_runs_with_an_error_and_exits_0():
    with Server("--slots", "2", "--ctx", "512", "--shutdown-timeout", "1") as srv:
        stream = chat_stream(srv, 450)
        stream.start()
        whole = {}

        def non_stream():
            r = httpx.post(srv.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 450},
                           timeout=120)
            whole.update(status=r.status_code, body=r.json())
        t = threading.Thread(target=non_stream, daemon=True)
        t.start()
        stream.first.wait(60)
        time.sleep(0.3)
        srv.proc.send_signal(signal.SIGTERM)
        stream.join(60)
        t.join(60)
        assert stream.error()["code"] == "shutting_down" and stream.events[-1] == "[DONE]"
        assert whole["status"] == 503 and whole["body"]["error"]["code"] == "shutting_down"
        assert srv.proc.wait(30) == 0, srv.logs()


def test_a_second_signal_skips_the_wait():
    with Server("--slots", "2", "--ctx", "512", "--shutdown-timeout", "300") as srv:
        workers = srv.workers()
        stream = chat_stream(srv, 450)
        stream.start()
        stream.first.wait(60)
        srv.proc.send_signal(signal.SIGINT)
        wait_draining(srv)
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(30) == 0, srv.logs()
        stream.join(30)
        assert stream.error()["code"] == "shutting_down"
        assert gone(workers)


def test_sigterm_during_a_model_load_cancels_it_cleanly(tmp_path):
    # the default model's load is stalled once at start, and again in the test
    with Server("--slots", "1", "--ctx", "256", env={"PANTHEON_TEST_LOAD_STALL": "2"}) as srv:
        workers = srv.workers()
        result = {}

        def load():
            r = httpx.post(srv.url + "/admin/models/load", timeout=60,
                           json={"path": str(cached_path()), "name": "second"})
            result.update(status=r.status_code, body=r.json())
        t = threading.Thread(target=load, daemon=True)
        t.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "second" not in httpx.get(
                srv.url + "/admin/models", timeout=5).json()["loading"]:
            time.sleep(0.05)
        srv.proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert result["status"] == 503, result
        assert "cancelled" in result["body"]["error"]["message"]
        assert srv.proc.wait(30) == 0, srv.logs()
        assert gone(workers)


def test_a_worker_given_sigterm_says_so_and_its_stream_fails_fast():
    with Server("--slots", "2", "--ctx", "512") as srv:
        (worker,) = srv.workers()
        stream = chat_stream(srv, 450)
        stream.start()
        stream.first.wait(60)
        worker.send_signal(signal.SIGTERM)
        stream.join(30)
        assert not stream.is_alive()
        assert stream.error()["code"] == "worker_lost" and "stopping" in \
            stream.error()["message"]
        srv.wait_healthy(90)                 # restarted, its model loaded again
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "exited with code 0" not in srv.logs():
            time.sleep(0.2)
        assert "exited with code 0" in srv.logs()
        r = httpx.post(srv.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 3},
                       timeout=60)
        assert r.status_code == 200
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        assert 'pantheon:worker_restarts_total{die="cpu"} 1.0' in metrics
        assert 'pantheon:worker_up{die="cpu"} 1.0' in metrics
