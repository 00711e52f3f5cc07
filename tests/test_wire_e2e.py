"""The wire's limits end to end, on one real server with the tiny model: a request's
grammar failure ends it alone; every field the worker's decoder would refuse is a 400 at
the edge; the prefix cache is scoped per API key and cache_salt; the admin socket reads
nothing before it is allowed and nothing unbounded."""
import json

import httpx
import psutil
import pytest
import zmq

import tiny_models as tm
from cluster import Server, Stream
from pantheon.common import limits
from pantheon.common import protocol as p

ADMIN_KEY = "adm"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tm.write_gguf("llama", tmp_path_factory.mktemp("wire") / "tiny.gguf")
    # steps of at least 20 ms: the normal streams are still running when the bad one fails
    srv = Server("--model", str(model), "--name", "tiny", "--ctx", "256", "--slots", "6",
                 "--admin-key", ADMIN_KEY, env={"PANTHEON_TEST_STEP_FLOOR": "0.02"})
    srv.admin_addr = srv.args[srv.args.index("--admin-addr") + 1]
    with srv:
        yield srv


def chat(srv, body: dict, headers: dict | None = None) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, **body}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, headers=headers or {},
                      timeout=60)


PATHOLOGICAL = {"type": "json_schema", "json_schema": {
    "name": "x", "schema": {"type": "string", "pattern": "^(a{1000}){1000}$"}}}


def test_a_failing_grammar_fails_its_request_alone(server):
    normal = [Stream(server.url, {"model": "tiny", "max_tokens": 60, "temperature": 0,
                                  "messages": [{"role": "user", "content": f"story {i}"}]})
              for i in range(4)]
    for s in normal:
        s.start()
    for s in normal:
        assert s.first.wait(60)                  # all four are decoding
    bad = Stream(server.url, {"model": "tiny", "max_tokens": 20, "response_format": PATHOLOGICAL,
                              "messages": [{"role": "user", "content": "a"}]})
    bad.run()
    for s in normal:
        s.join(120)
        assert s.status == 200 and s.error() is None, s.events[-3:]
        finishes = [c["choices"][0]["finish_reason"] for c in s.chunks() if c.get("choices")]
        assert finishes[-1] == "length" and s.usage()["completion_tokens"] == 60
    if bad.status == 200:                        # failed after its first byte: an SSE error
        err = bad.error()
    else:
        err = json.loads("".join(bad.events) or "{}").get("error")
    assert err is not None and err["message"], bad.events
    assert len(err["message"]) < 400 and "{1000}" not in err["message"]
    assert "story" not in err["message"]
    assert chat(server, {}).status_code == 200


def big_schema() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "description": "d" * (limits.MAX_GRAMMAR_CHARS + 1)}}}


@pytest.mark.parametrize("body, headers, param", [
    ({"session_id": "s" * (limits.MAX_SESSION_ID_CHARS + 1)}, None, "session_id"),
    ({}, {"x-session-id": "s" * (limits.MAX_SESSION_ID_CHARS + 1)}, "session_id"),
    ({"cache_salt": "c" * (limits.MAX_CACHE_SALT_CHARS + 1)}, None, "cache_salt"),
    ({"logit_bias": {str(i): 1 for i in range(65_537)}}, None, "logit_bias"),
    ({"logit_bias": {str(2**64): 1}}, None, "logit_bias"),
    ({"logit_bias": {"320": 1}, "stream": True}, None, "logit_bias"),   # past the vocabulary
    ({"response_format": big_schema()}, None, "response_format"),
], ids=["session_id", "session_header", "cache_salt", "logit_bias_65537", "logit_bias_2**64",
        "logit_bias_vocab", "schema"])
def test_what_the_worker_would_refuse_is_a_400_at_the_edge(server, body, headers, param):
    r = chat(server, body, headers)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    assert chat(server, {}).status_code == 200


def cached(srv, prompt: str, headers: dict | None = None, **body) -> int:
    r = chat(srv, {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1,
                   **body}, headers)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_the_prefix_cache_is_scoped_per_key_and_cache_salt(server):
    prompt = "the secret of the vault is 4711, " * 6
    alice, bob = {"authorization": "Bearer alice"}, {"authorization": "Bearer bob"}
    assert cached(server, prompt, alice) == 0
    assert cached(server, prompt, bob) == 0                    # another key learns nothing
    assert cached(server, prompt, alice, cache_salt="tenant-2") == 0
    hit = cached(server, prompt, alice)                         # the same key does hit
    assert hit > 100
    assert cached(server, prompt, alice, cache_salt="tenant-2") == hit
    # the keyless scope shares at most the chat template's opening with earlier requests
    assert cached(server, prompt) < 40


def rss(srv) -> int:
    return psutil.Process(srv.proc.pid).memory_info().rss


def admin_socket(srv) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(srv.admin_addr)
    return sock


def reply(sock) -> p.AdminReply:
    assert sock.poll(30_000), "no admin reply"
    return p.decode(sock.recv())


def test_the_admin_socket_decodes_nothing_unbounded_or_unauthenticated(server):
    before = rss(server)
    # empty msgpack maps inside an array: on the wire one byte each, ~64 bytes decoded
    bomb = b"\xdd" + (limits.ADMIN.max_bytes - 8).to_bytes(4, "big") + \
        b"\x80" * (limits.ADMIN.max_bytes - 8)
    sock = admin_socket(server)
    try:
        sock.send_multipart([b"wrong", bomb])        # no token: refused unread
        assert reply(sock).status == 401
        sock.send(bomb)                               # a one-frame request: the same
        assert reply(sock).status == 401
        sock.send_multipart([ADMIN_KEY.encode(), bomb])   # past the token: bounded decode
        refused = reply(sock)
        assert refused.status == 400 and "error" in refused.body
        sock.send_multipart([ADMIN_KEY.encode(), p.encode(p.AdminRequest("status"))])
        assert reply(sock).body["service"] == "pantheon"
    finally:
        sock.close()
    # a frame past the admin socket's MAXMSGSIZE: the peer is dropped inside libzmq
    for _ in range(2):
        sock = admin_socket(server)
        n = 16 << 20
        sock.send_multipart([ADMIN_KEY.encode(), b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n])
        assert not sock.poll(1000)
        sock.close()
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    sock = admin_socket(server)
    try:
        sock.send_multipart([ADMIN_KEY.encode(), p.encode(p.AdminRequest("status"))])
        assert reply(sock).status == 200
    finally:
        sock.close()
    assert rss(server) - before < 100 << 20, (before, rss(server))


def test_text_completions_take_the_same_limits(server):
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "hi", "max_tokens": 2,
        "logit_bias": {str(2**64): 1}, "session_id": "s"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "hi", "max_tokens": 2, "cache_salt": 7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
