"""Continuous batching, admission and the prefix cache, end to end."""
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from cluster import Server
from pantheon.common.default_model import cached_path

REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "smollm2-reference.json"
pytestmark = pytest.mark.skipif(not cached_path().exists() or not REFERENCE.exists(),
                                reason="default model or reference data missing")
NO_EOS = {"2": -100, "0": -100}


@pytest.fixture(scope="module")
def server():
    with Server("--slots", "8", "--ctx", "1024") as srv:
        yield srv


def test_eight_concurrent_streams_equal_their_greedy_replies_alone(server):
    cases = json.loads(REFERENCE.read_text())["chat_greedy"]
    client = server.client()

    def stream(i):
        case = cases[i % len(cases)]
        chunks = client.chat.completions.create(
            model="m", messages=case["messages"], temperature=0, stream=True,
            max_tokens=len(case["greedy_ids_fp32ref"]))
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(stream, range(8)))
    for i, text in enumerate(texts):
        assert text == cases[i % len(cases)]["greedy_text_fp32ref"]


@pytest.mark.parametrize("how", ["body", "header"])
def test_second_session_turn_reports_cached_tokens(server, how):
    client = server.client()
    session = f"sess-{how}"
    kw = ({"extra_body": {"session_id": session}} if how == "body"
          else {"extra_headers": {"X-Session-Id": session}})
    history = [{"role": "system", "content": f"You answer briefly ({how})."},
               {"role": "user", "content": "Name a large city in Europe."}]
    first = client.chat.completions.create(model="m", messages=history, temperature=0,
                                           max_tokens=16, **kw)
    # a fresh conversation: at most the template's opening is shared with earlier ones
    assert first.usage.prompt_tokens_details.cached_tokens < 10
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And another one?"}]
    second = client.chat.completions.create(model="m", messages=history, temperature=0,
                                            max_tokens=8, **kw)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # everything up to the end of the first reply is reused
    assert first.usage.prompt_tokens < cached < second.usage.prompt_tokens


def long_request(srv, results, key):
    body = {"messages": [{"role": "user", "content": "Tell a story."}], "max_tokens": 150,
            "logit_bias": NO_EOS}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
    results[key] = r.status_code


def wait_in_flight(srv, n, queued=0):
    import time
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health = httpx.get(srv.url + "/health").json()
        rep = health["replicas"][0]
        if sum(r["in_flight"] for r in rep["replicas"]) == n and rep["queued"] == queued:
            return
        time.sleep(0.05)
    raise TimeoutError(health)


def test_queue_overflow_gives_429_with_retry_after():
    with Server("--slots", "2", "--ctx", "512", "--queue-depth", "1") as srv:
        results = {}
        threads = [threading.Thread(target=long_request, args=(srv, results, i)) for i in range(3)]
        for i, t in enumerate(threads):
            t.start()
            wait_in_flight(srv, min(i + 1, 2), queued=max(0, i - 1))
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "hi"}], "stream": True})
        assert r.status_code == 429 and r.headers["retry-after"] == "5"
        assert r.json()["error"]["code"] == "queue_full"
        assert r.headers["content-type"].startswith("application/json")   # not an SSE stream
        for t in threads:
            t.join(120)
        assert results == {0: 200, 1: 200, 2: 200}        # the queued one ran when a slot freed


def test_single_user_mode_refuses_a_second_request_at_once():
    with Server("--slots", "1", "--ctx", "512") as srv:
        results = {}
        t = threading.Thread(target=long_request, args=(srv, results, "first"))
        t.start()
        wait_in_flight(srv, 1)
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert r.status_code == 429 and r.json()["error"]["code"] == "server_busy"
        t.join(120)
        assert results == {"first": 200}
