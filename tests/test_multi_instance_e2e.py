"""Two `pantheon serve` instances behind a real vllm-router (PyPI 0.1.17, installed into
the test venv when absent), each joining it by itself through PANTHEON_REGISTRY_URL:
sessions stick to one instance (turn 2 cached), streams pass through intact, load is
polled cheaply, a router that comes up late is joined, and a `kill -9`ed instance
leaves the ring so that its sessions move once and stick to the survivor."""
import json
import os
import signal
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from cluster import Router, Server, Stream, free_port, router_bin
from pantheon.common.default_model import cached_path

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not cached_path().exists(), reason="default model not fetched")]

FAST = {"PANTHEON_HEARTBEAT_S": "0.5"}
STEP_FLOOR, STREAM_TOKENS = 0.05, 160     # the draining stream: 8 s at least
WORDS = ("amber basalt cinder delta ember fjord glacier harbor island juniper kettle "
         "lantern meadow nectar orchard pebble quartz raven saffron timber").split()


@pytest.fixture(scope="module")
def vllm_router():
    binary = router_bin()
    if binary is None:
        pytest.skip("vllm-router==0.1.17 is not installed and `pip install` failed (offline?)")
    return binary


@pytest.fixture(scope="module")
def cluster(vllm_router):
    router = Router(vllm_router).start()
    env = {"PANTHEON_REGISTRY_URL": router.url, **FAST}
    a = Server("--slots", "4", "--ctx", "256", env={**env, "PANTHEON_NODE_ID": "a"})
    b = Server("--slots", "4", "--ctx", "256", env={**env, "PANTHEON_NODE_ID": "b"})
    try:
        a.launch(), b.launch()
        a.wait_healthy(), b.wait_healthy()
        wait_until(lambda: sorted(router.healthy()) == sorted([a.url, b.url]), 30,
                   lambda: router.logs() + a.logs() + b.logs())
        yield SimpleNamespace(router=router, a=a, b=b, servers=[a, b])
    finally:
        a.stop(), b.stop(), router.stop()


def wait_until(check, timeout: float, why=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not met within {timeout} s:\n{why()}"
        time.sleep(0.1)


def served(server: Server) -> int:
    models = httpx.get(server.url + "/admin/models", timeout=10).json()["models"]
    return sum(r["served"] for m in models for r in m["replicas"])


def chat(url: str, messages: list, session: str | None = None, max_tokens: int = 4,
         headers: dict | None = None) -> httpx.Response:
    head = {"X-Session-Id": session} if session else {}
    return httpx.post(url + "/v1/chat/completions", headers={**head, **(headers or {})},
                      json={"model": "SmolLM2-135M-Instruct", "messages": messages,
                            "max_tokens": max_tokens,
                            "temperature": 0}, timeout=60)


def turn(url: str, servers: list, messages: list, session: str) -> tuple[dict, Server]:
    """One turn (sequential); the answer and the instance that served it."""
    before = [served(s) for s in servers]
    r = chat(url, messages, session)
    assert r.status_code == 200, r.text
    (home,) = [s for s, n in zip(servers, before) if served(s) != n]
    messages += [r.json()["choices"][0]["message"], {"role": "user", "content": "Say more."}]
    return r.json()["usage"], home


def opening(i: int) -> list:
    """A first turn of its own: a shared prefix (the system prompt) is a small part."""
    words = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(24))
    return [{"role": "user", "content": f"Conversation {i}: tell a story with {words}."}]


def cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_sessions_stick_to_one_instance_and_turn_two_is_cached(cluster):
    homes: dict[str, list] = {s.url: [] for s in cluster.servers}
    for i in range(24):
        if min(len(v) for v in homes.values()) >= 3:
            break
        session, messages = f"stick-{i}", opening(i)
        first, home = turn(cluster.router.url, cluster.servers, messages, session)
        second, again = turn(cluster.router.url, cluster.servers, messages, session)
        assert again is home, f"{session} moved from {home.url} to {again.url}"
        assert cached(second) >= first["prompt_tokens"], (session, first, second)
        homes[home.url].append(session)
    assert min(len(v) for v in homes.values()) >= 3, homes     # spread over both


def test_the_smg_routing_key_is_a_session_key_too(cluster):
    messages = opening(100)
    key = {"X-SMG-Routing-Key": "smg-1"}
    r1 = chat(cluster.a.url, messages, headers=key)
    messages += [r1.json()["choices"][0]["message"], {"role": "user", "content": "More."}]
    r2 = chat(cluster.a.url, messages, headers=key)
    assert cached(r2.json()["usage"]) >= r1.json()["usage"]["prompt_tokens"]


def test_streaming_through_the_router_matches_direct(cluster):
    import openai
    kwargs = dict(model="SmolLM2-135M-Instruct", max_tokens=24, temperature=0, stream=True,
                  messages=[{"role": "user", "content": "Name three rivers of Europe."}],
                  stream_options={"include_usage": True})

    def streamed(base: str):
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        chunks = list(client.chat.completions.create(**kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        return text, finish, chunks[-1].usage.completion_tokens
    direct = streamed(cluster.a.url)
    assert direct[0] and direct == streamed(cluster.router.url) == streamed(cluster.b.url)


def test_load_is_served_without_a_body_and_shows_running_requests(cluster):
    seen = {}

    def poll():
        for _ in range(200):
            load = httpx.get(cluster.a.url + "/get_load", timeout=5).json()
            if load["running"]:
                seen["load"] = load
                seen["v1"] = httpx.get(cluster.a.url + "/v1/loads", timeout=5).json()
                seen["router"] = httpx.get(cluster.router.url + "/get_loads", timeout=5).json()
                return
            time.sleep(0.02)
    poller = threading.Thread(target=poll)
    poller.start()
    r = chat(cluster.a.url, [{"role": "user", "content": "Count to twenty."}], max_tokens=48)
    poller.join()
    assert r.status_code == 200
    assert seen["load"]["load"] >= 1 and seen["load"]["capacity"] == 4, seen
    assert seen["v1"]["loads"][0]["num_running_reqs"] >= 1
    loads = {w["worker"]: w["load"] for w in seen["router"]["workers"]}
    assert loads[cluster.b.url] == 0 and cluster.a.url in loads
    idle = httpx.get(cluster.a.url + "/get_load", timeout=5).json()
    assert idle == {"load": 0, "running": 0, "waiting": 0, "capacity": 4}


def test_an_instance_joins_a_router_that_comes_up_later(vllm_router):
    port = free_port()
    late_url = f"http://127.0.0.1:{port}"
    with Server("--slots", "2", "--ctx", "256",
                env={"PANTHEON_REGISTRY_URL": late_url, **FAST}) as c:
        assert chat(c.url, opening(7)).status_code == 200       # serving is not affected
        wait_until(lambda: "unreachable" in c.logs(), 10, c.logs)
        time.sleep(1.5)                                          # several more tries
        with Router(vllm_router, port=port) as late:
            wait_until(lambda: c.url in late.healthy(), 30, lambda: late.logs() + c.logs())
            assert chat(late.url, opening(8)).status_code == 200
            # one line per change of state, not one per try
            assert c.logs().count("unreachable") == 1, c.logs()
            assert c.logs().count(": registered:") == 1, c.logs()


def test_sigterm_deregisters_first_finishes_its_stream_and_gets_no_new_requests(
        vllm_router, cluster):
    a = cluster.a
    with Router(vllm_router) as router, \
            Server("--slots", "4", "--ctx", "1024", "--shutdown-timeout", "120",
                   env={"PANTHEON_REGISTRY_URL": router.url, **FAST,
                        "PANTHEON_TEST_STEP_FLOOR": str(STEP_FLOOR)}) as c:
        httpx.post(router.url + "/add_worker", params={"url": a.url}, timeout=30)
        wait_until(lambda: sorted(router.healthy()) == sorted([a.url, c.url]), 30,
                   router.logs)
        for i in range(400, 432):                   # a session that lives on c
            session = f"draining-{i}"
            if turn(router.url, [a, c], opening(i), session)[1] is c:
                break
        else:
            pytest.fail("no session hashed to the draining instance")
        # c's steps last at least STEP_FLOOR: the stream outlasts the drain's checks
        # (a few seconds) on any host, 8 s or more
        stream = Stream(router.url, {"messages": opening(900), "max_tokens": STREAM_TOKENS,
                                     "logit_bias": {"2": -100, "0": -100}},
                        {"X-Session-Id": session})
        stream.start()
        assert stream.first.wait(60)
        served_a = served(a)
        c.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        wait_until(lambda: c.url not in router.workers(), 10, c.logs)
        left = time.monotonic() - sent
        assert stream.is_alive(), "the stream ended before the instance left the router"
        for k in range(4):                          # during the drain: all go elsewhere
            r = chat(router.url, opening(500 + k), session if k < 2 else f"new-{k}", 2)
            assert r.status_code == 200, r.text
        assert served(a) == served_a + 4
        assert stream.is_alive(), "the drain was over too soon to tell"
        stream.join(120)
        chunks = [json.loads(e) for e in stream.events if e != "[DONE]"]
        assert stream.status == 200 and stream.events[-1] == "[DONE]"
        assert not any("error" in ch for ch in chunks), ([ch for ch in chunks if "error" in ch], len(chunks), c.logs())
        assert [ch for ch in chunks if ch.get("usage")][-1]["usage"]["completion_tokens"] == STREAM_TOKENS
        assert c.proc.wait(30) == 0
        logs = c.logs()
        assert logs.index("deregistered") < logs.index("drain: every request finished"), logs
        print(f"left the router {left:.2f} s after SIGTERM")


def test_a_killed_instance_leaves_the_ring_and_its_session_moves_once(cluster):
    router, a, b = cluster.router, cluster.a, cluster.b
    for i in range(200, 232):                   # a conversation that lives on b
        session, messages = f"moving-{i}", opening(i)
        first, home = turn(router.url, cluster.servers, messages, session)
        if home is b:
            break
    else:
        pytest.fail("no session hashed to the second instance")
    second, _ = turn(router.url, cluster.servers, messages, session)
    assert cached(second) >= first["prompt_tokens"]

    os.killpg(b.proc.pid, signal.SIGKILL)
    b.proc.wait(10)
    killed, failures = time.monotonic(), 0
    while True:                                 # the router notices within its health interval
        assert time.monotonic() - killed < 30, router.logs()
        before = served(a)
        r = chat(router.url, messages, session)
        if r.status_code == 200:
            break
        failures += 1
        time.sleep(0.2)
    moved = time.monotonic() - killed
    print(f"requests succeed on the survivor {moved:.2f} s after kill -9 "
          f"({failures} failed before)")
    assert served(a) == before + 1
    third = r.json()["usage"]
    assert cached(third) < second["prompt_tokens"]          # re-prefilled on its new home
    messages += [r.json()["choices"][0]["message"], {"role": "user", "content": "And then?"}]
    fourth, home = turn(router.url, [a], messages, session)
    assert home is a and cached(fourth) >= third["prompt_tokens"]   # and sticks there
    for i in range(4):                           # everyone else is served too
        assert chat(router.url, opening(300 + i), f"after-{i}").status_code == 200


def smg_bin() -> str | None:
    """SMG's launcher, when installed (this test does not install it: a 37 MB wheel
    with grpcio; `pip install smg` into the venv, or put it on PATH, to run it)."""
    import shutil
    import sys
    return shutil.which("smg", path=os.path.dirname(sys.executable)) or shutil.which("smg")


def test_smg_registration_routing_key_and_drain():
    binary = smg_bin()
    if binary is None:
        pytest.skip("smg (the SGLang model gateway) is not installed")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    import subprocess
    import tempfile
    log = tempfile.TemporaryFile()
    gateway = subprocess.Popen(
        [binary, "launch", "--host", "127.0.0.1", "--port", str(port), "--prometheus-port",
         str(free_port()), "--policy", "consistent_hashing", "--health-check-interval-secs",
         "1"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def listed() -> list[dict]:
        try:
            return httpx.get(url + "/workers", timeout=2).json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError):
            return []
    try:
        with Server(env={"PANTHEON_REGISTRY_URL": url, "PANTHEON_REGISTRY_KIND": "smg",
                         **FAST}) as c:
            wait_until(lambda: any(w["url"] == c.url and w["is_healthy"] for w in listed()),
                       60, c.logs)
            (worker,) = listed()
            assert worker["labels"]["instance_id"].endswith(":SmolLM2-135M-Instruct")
            messages, key = opening(600), {"X-SMG-Routing-Key": "smg-session"}
            r1 = chat(url, messages, headers=key)
            assert r1.status_code == 200, r1.text
            messages += [r1.json()["choices"][0]["message"], {"role": "user", "content": "More."}]
            r2 = chat(url, messages, headers=key)
            assert cached(r2.json()["usage"]) >= r1.json()["usage"]["prompt_tokens"]
            c.proc.send_signal(signal.SIGTERM)
            assert c.proc.wait(30) == 0
            assert "deregistered" in c.logs(), c.logs()
            wait_until(lambda: listed() == [], 20)        # SMG drains 5 s, then removes
    finally:
        os.killpg(gateway.pid, signal.SIGKILL)
        gateway.wait(10)
