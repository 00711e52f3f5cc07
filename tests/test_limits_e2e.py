"""Bounded clients against a real server: slow headers and bodies, big headers, the
connection cap, request limits, and a client that stops reading its stream beside one
that is measured. Figures print with `pytest -s`; no assertion is a timing goal."""
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from cluster import Server, Stream
from pantheon.common.default_model import cached_path
from pantheon.frontend.errors import APIError
from pantheon.frontend.limits import BoundedHttp, ConnectionLimits, RequestLimits, json_depth

pytestmark = pytest.mark.skipif(not cached_path().exists(), reason="default model not fetched")
QUESTION = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]
NO_EOS = {"2": -100, "0": -100}


@pytest.fixture(scope="module")
def server():
    with Server("--slots", "4", "--ctx", "1024", "--header-timeout", "2",
                "--body-timeout", "2", "--max-header-bytes", "4096",
                "--max-connections", "8", "--stream-buffer-tokens", "16",
                "--send-buffer-bytes", "4096",
                "--max-messages", "8", "--max-request-tokens", "1000",
                "--max-stop-chars", "20", "--max-tool-schema-bytes", "2000",
                "--max-tool-schema-depth", "10") as srv:
        yield srv


def raw(srv) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.port), timeout=60)


def read_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def error_of(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def ok(srv) -> None:
    """A normal request right after: the server carries on."""
    r = srv.client().chat.completions.create(model="m", messages=QUESTION, max_tokens=2)
    assert r.choices[0].finish_reason == "length"


def slowloris(port: int, every_s: float, give_up_s: float) -> tuple[float, bytes]:
    """Send a request's headers one byte every `every_s`; (seconds until the server
    closed the connection, what it answered), or (give_up_s, b"") if it never did."""
    request = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n" + b"X-Pad: a\r\n" * 50
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(every_s)
    start = time.monotonic()
    try:
        for byte in request:
            if time.monotonic() - start > give_up_s:
                return give_up_s, b""
            try:
                sock.send(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - start, b""
            try:
                data = sock.recv(65536)
            except socket.timeout:
                continue
            except ConnectionResetError:
                return time.monotonic() - start, b""
            return time.monotonic() - start, data + read_all(sock)
        return time.monotonic() - start, b""
    finally:
        sock.close()


def test_a_slowloris_is_cut_off_at_the_header_deadline(server):
    took, answer = slowloris(server.port, every_s=1.0, give_up_s=60)
    print(f"\nslowloris at 1 byte/s, --header-timeout 2: closed after {took:.1f} s")
    assert answer, f"still open after {took:.0f} s"
    status, err = error_of(answer)
    assert status == 408 and err["code"] == "request_timeout"
    ok(server)


def test_a_peer_still_sending_after_the_408_reads_it_and_a_clean_end(server):
    """Bytes that reach a closed socket make the kernel answer with a reset, which can
    cost the peer the 408 still unread; the server shuts only its side and drops what
    comes, so the peer reads the answer and then end of stream."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n")
    start = time.monotonic()
    while time.monotonic() - start < 3.0:     # past the 2 s deadline, still sending
        sock.sendall(b"X-Pad: a\r\n")
        time.sleep(0.05)
    status, err = error_of(read_all(sock))    # a reset here is the failure
    sock.close()
    assert status == 408 and err["code"] == "request_timeout"
    ok(server)


def test_an_idle_connection_is_closed_too(server):
    sock = raw(server)
    start = time.monotonic()
    status, err = error_of(read_all(sock))          # we send nothing at all
    print(f"\nidle connection closed after {time.monotonic() - start:.1f} s")
    assert status == 408


def test_a_stalled_body_is_a_408(server):
    sock = raw(server)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"mess")
    status, err = error_of(read_all(sock))
    assert status == 408 and "body" in err["message"]
    ok(server)


def test_headers_past_the_cap_are_a_431(server):
    sock = raw(server)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 8000 + b"\r\n\r\n")
    status, err = error_of(read_all(sock))
    assert status == 431 and err["code"] == "headers_too_large"
    r = httpx.get(server.url + "/health", headers={"X-Fine": "a" * 1000})
    assert r.status_code == 200


def test_connections_past_the_cap_get_a_503_but_health_is_answered(server):
    held = [raw(server) for _ in range(8)]
    try:
        for sock in held:                        # each in the middle of a request: busy
            sock.sendall(b"GET /health HTTP/1.1\r\n")
        time.sleep(0.3)
        r = httpx.get(server.url + "/v1/models", timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections"
        assert r.headers["connection"] == "close"
        r = httpx.get(server.url + "/health", timeout=30)     # always answered, then closed
        assert r.status_code == 200 and r.headers["connection"] == "close"
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.3)
    assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 200


def test_idle_connections_are_closed_to_make_room(server):
    """1,100 idle sockets once made everyone 503: now the longest idle goes first."""
    held = [raw(server) for _ in range(8)]
    try:
        time.sleep(0.3)
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for _ in range(3):
                assert client.get("/v1/models").status_code == 200
        assert held[0].recv(1) == b""             # the oldest idle one was closed, quietly
    finally:
        for sock in held:
            sock.close()


def deep(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def tool(parameters) -> list:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


@pytest.mark.parametrize("field, param", [
    ({"messages": QUESTION * 9}, "messages"),
    ({"n": 4, "max_tokens": 251}, "max_tokens"),
    ({"stop": ["x" * 21]}, "stop"),
    ({"tools": tool(deep(4))}, "tools"),                 # 12 levels: 3 of them the list's
    ({"tools": tool({"type": "object", "description": "d" * 3000})}, "tools"),
])
def test_request_limits_are_400s_naming_the_field(server, field, param):
    body = {"messages": QUESTION, "max_tokens": 4, **field}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "limit_exceeded"
    ok(server)


def test_n_times_prompts_is_bounded():
    limits = RequestLimits(max_choices=32)
    limits.tokens(16, 1, 2)
    with pytest.raises(APIError) as exc:
        limits.tokens(16, 1, 3)
    assert exc.value.param == "prompt" and exc.value.code == "limit_exceeded"


def test_completions_count_every_prompt_in_the_token_budget(server):
    body = {"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 200}     # 1200 > 1000
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    body["max_tokens"] = 2
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200


def test_within_the_limits_is_fine(server):
    body = {"messages": QUESTION * 8, "n": 4, "max_tokens": 2, "stop": ["x" * 20],
            "tools": tool(deep(2))}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text


def timed_stream(srv, max_tokens: int) -> tuple[str, float, float]:
    """(finish reason, seconds, largest gap between chunks)."""
    body = {"messages": QUESTION, "max_tokens": max_tokens, "stream": True,
            "logit_bias": NO_EOS, "temperature": 0}
    finish, gaps, last = None, [0.0], None
    start = time.monotonic()
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last = now
            finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
    return finish, time.monotonic() - start, max(gaps)


def in_flight(srv) -> int:
    h = httpx.get(srv.url + "/health", timeout=30).json()
    return sum(r["in_flight"] for m in h["replicas"] for r in m["replicas"])


def test_a_client_that_stops_reading_is_aborted_and_stalls_no_one(server):
    alone = timed_stream(server, 60)
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # fills fast
    stalled.connect(("127.0.0.1", server.port))
    body = json.dumps({"messages": QUESTION, "max_tokens": 1000, "stream": True,
                       "logit_bias": NO_EOS}).encode()
    stalled.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                    % (len(body), body))                              # and never reads
    try:
        beside = timed_stream(server, 60)
        deadline = time.monotonic() + 240
        while "left" not in server.logs() and time.monotonic() < deadline:
            time.sleep(0.5)
        logs = server.logs()
        assert "its client left" in logs, logs
        assert alone[0] == beside[0] == "length"        # all 60 tokens, both times
        print(f"\nmeasured stream of 60 tokens: alone {alone[1]:.2f} s (largest gap "
              f"{alone[2] * 1000:.0f} ms); beside a stalled reader {beside[1]:.2f} s "
              f"(largest gap {beside[2] * 1000:.0f} ms)")
        print([line for line in logs.splitlines() if "left" in line][-1])
        deadline = time.monotonic() + 60
        while in_flight(server) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert in_flight(server) == 0                  # its slot is free again
        stalled.settimeout(60)                          # and its connection was dropped
        try:
            read_all(stalled)
        except ConnectionResetError:
            pass
    finally:
        stalled.close()
    ok(server)


def test_json_depth():
    assert json_depth(1) == 0 and json_depth([]) == 1 and json_depth({"a": [1]}) == 2
    assert json_depth(deep(3)) == 2 * 3 + 1
    assert json_depth([[[[[]]]]] * 3) == 5


async def no_content(scope, receive, send):
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def bare_server(protocol, app=no_content) -> tuple[uvicorn.Server, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, lifespan="off", log_level="warning", http=protocol)
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, sock.getsockname()[1]


def test_without_the_guard_uvicorn_holds_a_slowloris_and_with_it_does_not():
    """The control: the same app, uvicorn's own httptools protocol vs ours."""
    plain, plain_port = bare_server("httptools")
    bounded, bounded_port = bare_server(ConnectionLimits(header_timeout_s=1).protocol())
    try:
        took, _ = slowloris(plain_port, every_s=0.25, give_up_s=4)
        assert took == 4, "uvicorn alone closed it: the guard would prove nothing"
        took, answer = slowloris(bounded_port, every_s=0.25, give_up_s=30)
        print(f"\nslowloris at 4 bytes/s: uvicorn alone still open at 4 s; "
              f"--header-timeout 1 closed it after {took:.1f} s")
        assert answer.startswith(b"HTTP/1.1 408")
    finally:
        plain.should_exit = bounded.should_exit = True


def test_a_lone_surrogate_is_a_400_naming_the_field_and_the_connection_lives(server):
    body = b'{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2}'
    with httpx.Client(base_url=server.url, timeout=60) as client:
        r = client.post("/v1/chat/completions", content=body,
                        headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages[0].content" and err["code"] == "invalid_unicode"
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200                      # the same kept-alive connection


@pytest.mark.parametrize("path", ["/admin/models/load", "/admin/models/unload",
                                  "/v1/chat/completions"])
def test_deeply_nested_json_is_a_400_on_every_route(server, path):
    for depth in (200, 100_000):
        body = b'{"model": ' + b"[" * depth + b"]" * depth + b"}"
        r = httpx.post(server.url + path, content=body, timeout=60,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "nests more than" in r.json()["error"]["message"]


def test_a_web_page_cannot_drive_the_server(server):
    """A page's fetch() without a preflight: text/plain body, its own Origin."""
    page = {"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"}
    body = json.dumps({"messages": QUESTION, "max_tokens": 2})
    for path in ("/v1/chat/completions", "/admin/models/unload"):
        r = httpx.post(server.url + path, content=body, timeout=60,
                       headers={**page, "Content-Type": "text/plain"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "cross_site_refused"
        assert "access-control-allow-origin" not in r.headers
    r = httpx.options(server.url + "/v1/chat/completions", timeout=60, headers={
        **page, "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers
    # without an Origin (a form's no-cors post looks the same to us): a 415
    r = httpx.post(server.url + "/v1/chat/completions", content=body, timeout=60,
                   headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["param"] == "Content-Type"
    assert httpx.get(server.url + "/v1/models").status_code == 200      # no CORS: none
    assert "access-control-allow-origin" not in httpx.get(server.url + "/v1/models").headers


@pytest.mark.parametrize("host, status", [("evil.example", 400), ("evil.example:80", 400),
                                          ("localhost", 200), ("127.0.0.1:1", 200),
                                          ("[::1]:8000", 200)])
def test_the_host_header_is_checked_against_a_loopback_bind(server, host, status):
    """DNS rebinding: a page's own name resolving to 127.0.0.1 reaches us as its Host."""
    r = httpx.get(server.url + "/v1/models", headers={"Host": host}, timeout=30)
    assert r.status_code == status
    if status == 400:
        assert r.json()["error"]["code"] == "invalid_host"


def test_health_shows_no_process_ids(server):
    h = httpx.get(server.url + "/health", timeout=30).json()
    assert h["workers"] and all("pid" not in w for w in h["workers"])


def test_n_16_on_a_4_slot_replica_leaves_room_for_another_client(server):
    """One request's 16 choices hold at most 2 of the 4 slots: another client's request
    is served while they still run (it used to wait for all 16, or get a 429)."""
    body = {"messages": QUESTION, "n": 16, "max_tokens": 16, "logit_bias": NO_EOS}
    big = Stream(server.url, body)
    big.start()
    assert big.first.wait(120)
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json={"messages": QUESTION, "max_tokens": 2})
    assert r.status_code == 200
    assert big.is_alive()                                 # the other finished first
    big.join(300)
    ends = [c["index"] for e in big.chunks() for c in e.get("choices", [])
            if c.get("finish_reason")]
    assert big.status == 200 and sorted(ends) == list(range(16))


class FakeTransport:
    def __init__(self):
        self.closed = False

    def is_closing(self):
        return self.closed

    def close(self):
        self.closed = True


def connection(conns, ip, busy=False, idle_since=0.0, limits=ConnectionLimits()):
    """A BoundedHttp with only what the connection caps look at."""
    c = BoundedHttp.__new__(BoundedHttp)
    c.connections, c.client, c.transport = conns, (ip, 1), FakeTransport()
    c.busy, c.idle_since, c.limits = busy, idle_since, limits
    conns.add(c)
    return c


def test_the_caps_close_the_longest_idle_first_and_count_per_client():
    limits = ConnectionLimits(max_connections=4, max_connections_per_client=2)
    conns = set()
    a1 = connection(conns, "10.0.0.1", idle_since=5, limits=limits)
    a2 = connection(conns, "10.0.0.1", busy=True, limits=limits)
    b1 = connection(conns, "10.0.0.2", idle_since=1, limits=limits)
    b2 = connection(conns, "10.0.0.2", busy=True, limits=limits)
    # over the total: b1, idle the longest, goes
    assert connection(conns, "10.0.0.3", limits=limits).make_room()
    assert b1.transport.closed and not a1.transport.closed
    # a third from 10.0.0.1: its own idle one goes, not another client's
    assert connection(conns, "10.0.0.1", busy=True, limits=limits).make_room()
    assert a1.transport.closed
    # a fourth from 10.0.0.1 with all of its own busy (and the total free): refused
    conns -= {a1, b1}
    assert not connection(conns, "10.0.0.1", limits=limits).make_room()
    assert not a2.transport.closed and not b2.transport.closed


def test_an_unexpected_error_is_a_500_and_the_kept_alive_connection_lives():
    """Starlette answers an unhandled error with our 500 and then raises it again;
    uvicorn used to drop the connection for it, without `Connection: close`, so the
    client's next request on it failed too."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from pantheon.frontend.app import Guard, RequestLog
    from pantheon.frontend.errors import APIError

    async def boom(request):
        raise RuntimeError("a bug")

    async def fine(request):
        return JSONResponse({"ok": True})

    async def server_error(request, exc):
        return JSONResponse(APIError(500, "internal server error", type="server_error").body(),
                            status_code=500)
    app = Starlette(routes=[Route("/boom", boom), Route("/fine", fine)],
                    exception_handlers={Exception: server_error})
    server, port = bare_server(ConnectionLimits().protocol(),
                               RequestLog(Guard(app, None)))
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            r = client.get("/boom")
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
            assert r.headers.get("connection") != "close"
            assert client.get("/fine").json() == {"ok": True}
    finally:
        server.should_exit = True
