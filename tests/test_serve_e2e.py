"""End to end: `pantheon serve` on the default model, real processes, real clients."""
import threading
import time

import httpx
import openai
import pytest

from cluster import Server
from pantheon.common.default_model import cached_path

pytestmark = pytest.mark.skipif(not cached_path().exists(), reason="default model not fetched")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
NO_EOS = {"2": -100, "0": -100}      # SmolLM2's <|im_end|> and <|endoftext|>: banned, so a reply runs to max_tokens


@pytest.fixture(scope="module")
def server():
    with Server("--slots", "4", "--ctx", "512", "--max-body-bytes", "100000") as srv:
        yield srv


def test_models_lists_the_default_model(server):
    # the catalog lists the fetched models too, loaded first: the default is the one loaded
    models = server.client().models.list().data
    assert [m.id for m in models if m.status == "loaded"] == ["SmolLM2-135M-Instruct"]
    assert models[0].id == "SmolLM2-135M-Instruct"


def test_non_stream_greedy_reply_and_usage(server):
    r = server.client().chat.completions.create(model="SmolLM2-135M-Instruct",
                                                messages=QUESTION, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (37, 8)   # 7 words + <|im_end|>
    assert r.usage.total_tokens == 45


def test_stream_gives_the_same_reply_with_role_first_and_usage_last(server):
    chunks = list(server.client().chat.completions.create(
        model="any-name-routes-to-the-single-model", messages=QUESTION, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The capital of France is Paris."
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "stop" and set(finals[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert len({c.id for c in chunks}) == 1


def test_ids_are_unique(server):
    client = server.client()
    ids = {client.chat.completions.create(messages=QUESTION, model="m", max_tokens=1).id
           for _ in range(3)}
    assert len(ids) == 3


def test_max_tokens_gives_length(server):
    r = server.client().chat.completions.create(model="m", messages=QUESTION, temperature=0,
                                                max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    assert r.choices[0].message.content == "The capital of"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_the_reply_before_it(server, stream):
    kw = dict(model="m", messages=QUESTION, temperature=0, stop=[" Paris", "xyz"])
    client = server.client()
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = client.chat.completions.create(**kw)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert r.usage.completion_tokens == 6      # generation stopped at " Paris"
    assert (text, finish) == ("The capital of France is", "stop")


def test_seeded_sampling_reproduces(server):
    client = server.client()
    kw = dict(model="m", messages=QUESTION, temperature=1.0, top_p=0.9, seed=1234, max_tokens=12)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


LONG = "word " * 700
BAD_INPUTS = [
    (b"{not json", 400, None), (b"[1, 2]", 400, None), (b"{}", 400, "messages"),
    (b'{"messages": []}', 400, "messages"), (b'{"messages": "hi"}', 400, "messages"),
    (b'{"messages": [42]}', 400, "messages[0]"),
    (b'{"messages": [{"role": "wizard", "content": "hi"}]}', 400, "messages[0].role"),
    (b'{"messages": [{"role": "user", "content": 5}]}', 400, "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 3}', 400, "temperature"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', 400,
     "temperature"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 0}', 400, "top_p"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', 400, "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "n": 17}', 400, "n"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"x": 1}}', 400,
     "logit_bias"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}', 400, "stream"),
    (('{"messages": [{"role": "user", "content": "%s"}]}' % LONG).encode(), 400, "messages"),
    (b'{"messages": [{"role": "user", "content": "' + b"x" * 200_000 + b'"}]}', 413, None),
]


@pytest.mark.parametrize("body, status, param", BAD_INPUTS)
def test_bad_input_gets_an_openai_error_and_the_server_carries_on(server, body, status, param):
    r = httpx.post(server.url + "/v1/chat/completions", content=body, timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    if param == "messages" and b"word word" in body:
        assert err["code"] == "context_length_exceeded" and "512" in err["message"]
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("method, path, status", [("GET", "/nope", 404),
                                                  ("GET", "/v1/chat/completions", 405)])
def test_unknown_routes_are_openai_errors(server, method, path, status):
    r = httpx.request(method, server.url + path)
    assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param",
                                                                  "code"}


def test_health_root_and_no_cors_by_default(server):
    assert httpx.get(server.url + "/").json() == {"service": "pantheon", "status": "ok"}
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["workers"][0]["die"] == "cpu"
    assert all("pid" not in w for w in health["workers"])       # anyone may read /health
    # no --cors-origins: no CORS headers at all, and a page's preflight is refused
    r = httpx.options(server.url + "/v1/chat/completions", headers={
        "Origin": "http://page.example", "Access-Control-Request-Method": "POST"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    assert "access-control-allow-origin" not in httpx.get(server.url + "/v1/models").headers


def active(server, key="active") -> int:
    """Sequences the worker reports running (its heartbeat), or the frontend's in-flight."""
    workers = httpx.get(server.url + "/health").json()["workers"]
    return sum(w[key] + (w["waiting"] if key == "active" else 0) for w in workers)


def wait_for(predicate, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.1)
    return predicate()


def test_cheap_routes_answer_while_generating(server):
    body = {"messages": QUESTION, "max_tokens": 200, "stream": True, "logit_bias": NO_EOS}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if '"content":"' in line and '"content":""' not in line)
        for path in ("/v1/models", "/health", "/"):
            assert httpx.get(server.url + path, timeout=5).status_code == 200
        assert active(server, "in_flight") == 1    # the stream is still generating
        tail = [line for line in lines if line.startswith("data:")]
    assert tail[-1] == "data: [DONE]"


def test_client_disconnect_mid_stream_frees_the_worker(server):
    body = {"messages": QUESTION, "max_tokens": 450, "stream": True, "logit_bias": NO_EOS}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert wait_for(lambda: active(server) == 1), \
            httpx.get(server.url + "/health").json()["workers"]   # the worker reports it running
    # gone after a few chunks: 450 tokens would take far longer than this wait
    assert wait_for(lambda: active(server) == 0, timeout=8)
    assert active(server, "in_flight") == 0
    r = server.client().chat.completions.create(model="m", messages=QUESTION, max_tokens=2)
    assert r.choices[0].finish_reason == "length"


def test_requests_beyond_the_slots_all_complete(server):
    client, results = server.client(), []

    def ask(i):
        r = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=8, seed=i)
        results.append(r.usage.completion_tokens)
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]   # 4 slots
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 6 and all(0 < n <= 8 for n in results)


def test_api_key_is_required_except_on_public_routes():
    with Server("--slots", "2", "--ctx", "256", "--cors-origins", "https://app.example",
                api_key="sekrit") as srv:
        url = srv.url + "/v1/models"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            r = httpx.get(url, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url, headers=srv.headers()).status_code == 200
        for path in ("/", "/health"):
            assert httpx.get(srv.url + path).status_code == 200
        # --cors-origins: that page's preflight needs no key, its calls get CORS headers
        page = {"Origin": "https://app.example"}
        r = httpx.options(srv.url + "/v1/chat/completions", headers={
            **page, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert r.status_code == 204
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        assert "Authorization" in r.headers["access-control-allow-headers"]
        r = httpx.get(url, headers={**page, **srv.headers()})
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        r = httpx.get(srv.url + "/admin/models", headers={**page, **srv.headers()})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0) \
                .chat.completions.create(model="m", messages=QUESTION)
        r = srv.client().chat.completions.create(model="m", messages=QUESTION, max_tokens=2)
        assert r.usage.completion_tokens == 2


@pytest.mark.parametrize("flag", ["--port", "--worker-addr", "--admin-addr"])
def test_a_taken_address_fails_fast_with_a_clear_error(server, flag):
    import subprocess
    import sys
    taken = {"--port": str(server.port), "--worker-addr": f"tcp://127.0.0.1:{server.zport}",
             "--admin-addr": server.args[server.args.index("--admin-addr") + 1]}
    args = {"--port": "0", "--worker-addr": "tcp://127.0.0.1:0",
            "--admin-addr": "tcp://127.0.0.1:0"} | {flag: taken[flag]}
    proc = subprocess.run([sys.executable, "-m", "pantheon.cli", "serve",
                           *[x for kv in args.items() for x in kv]],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "cannot" in proc.stderr and "in use" in proc.stderr and "Traceback" not in proc.stderr


def test_an_fp16_kv_cache_is_reserved_at_its_size_and_serves_the_same_reply():
    """`serve --kv-cache f16`: the workers it spawns hold fp16 KV, the replica's
    reservation counts it at 2 bytes an element, and the greedy reply is unchanged."""
    with Server("--slots", "2", "--ctx", "256", "--kv-cache", "f16",
                "--admin-key", "k") as srv:
        r = srv.client().chat.completions.create(model="SmolLM2-135M-Instruct",
                                                 messages=QUESTION, temperature=0)
        assert r.choices[0].message.content == "The capital of France is Paris."
        models = httpx.get(f"{srv.url}/admin/models", headers={"Authorization": "Bearer k"},
                           timeout=30).json()["models"]
        reserved = models[0]["replicas"][0]["reserved_bytes"]
        kv_token = 2 * 30 * 192 * 2          # layers x (k, v) x kv dim x fp16
        assert 96e6 < reserved - 2 * 256 * kv_token < 98e6, reserved   # the 98.4 MB file
        assert "MB KV" in srv.logs() and " 12 MB KV" in srv.logs(), srv.logs()


def test_a_2048_message_conversation_is_capped_while_health_answers(server):
    """Capping once rendered and tokenized the conversation once per dropped turn
    (cubic: minutes for 2,048 turns, the thread pool full, /health waiting)."""
    messages = [{"role": "system", "content": "Answer briefly."}]
    messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": "x"}
                 for i in range(2046)]
    messages.append({"role": "user", "content": "Say hi."})
    result = {}

    def ask():
        result["r"] = httpx.post(server.url + "/v1/chat/completions", timeout=300, json={
            "messages": messages, "max_tokens": 2})
    asker = threading.Thread(target=ask)
    asker.start()
    health = []
    while asker.is_alive() or not health:
        health.append(httpx.get(server.url + "/health", timeout=60).status_code)
    asker.join()
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.json()["context_capped"] is True and r.json()["usage"]["prompt_tokens"] < 512
    assert set(health) == {200}
