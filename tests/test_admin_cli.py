"""`pantheon admin` with nobody answering: a clear error within the default timeout, and
`admin top` shows that error on its screen and quits on `q` at any time."""
import os
import pty
import select
import subprocess
import sys
import time

import pytest

from cluster import free_port

ADMIN = [sys.executable, "-m", "pantheon.cli", "admin"]


def read_until(fd: int, wanted: bytes, seconds: float) -> bytes:
    seen, deadline = b"", time.monotonic() + seconds
    while wanted not in seen and time.monotonic() < deadline:
        if select.select([fd], [], [], 0.2)[0]:
            try:
                seen += os.read(fd, 65536)
            except OSError:                   # the child closed the terminal
                break
    return seen


def top_on_a_terminal(addr: str, *flags: str):
    leader, follower = pty.openpty()
    env = {**os.environ, "TERM": "xterm", "LINES": "24", "COLUMNS": "100"}
    proc = subprocess.Popen(ADMIN + ["--addr", addr, *flags, "top", "--interval", "0.2"],
                            stdin=follower, stdout=follower, stderr=follower, env=env,
                            close_fds=True)
    os.close(follower)
    return proc, leader


@pytest.fixture(scope="module")
def no_server():
    """An address nobody listens on, and `admin status` against it with the default
    timeout, started first so that the other tests run while it waits."""
    addr = f"tcp://127.0.0.1:{free_port()}"
    status = subprocess.Popen(ADMIN + ["--addr", addr, "status"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    yield addr, status
    status.kill()
    status.wait()


def test_top_without_a_server_shows_at_once_says_so_and_quits_on_q(no_server):
    addr, _ = no_server
    # waiting long for the server: its screen comes at once, and `q` ends it
    waiting, leader = top_on_a_terminal(addr, "--timeout", "60")
    assert b"connecting" in read_until(leader, b"q quits", 15)
    os.write(leader, b"q")
    assert waiting.wait(10) == 0
    os.close(leader)
    # with a short timeout: the error is on the screen, then `q`
    failing, leader = top_on_a_terminal(addr, "--timeout", "1")
    screen = read_until(leader, b"not answering", 15)
    assert b"the server is not answering at " + addr.encode() in screen
    os.write(leader, b"q")
    assert failing.wait(10) == 0
    os.close(leader)


def test_admin_help_shows_the_timeout():
    done = subprocess.run(ADMIN + ["--help"], capture_output=True, text=True, timeout=20)
    assert "--timeout" in done.stdout and "default 10" in done.stdout


def test_a_long_load_outlasts_the_timeout_while_the_server_answers():
    """A server that takes 1.2 s to answer: a load (progress, then the reply) waits for it
    past --timeout 0.5 (the server's socket answers heartbeats); a status does not."""
    import threading

    import zmq

    from pantheon.common import protocol as p
    from pantheon.frontend.admin_cli import call

    server = zmq.Context.instance().socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    port = server.bind_to_random_port("tcp://127.0.0.1")

    def slow_server():
        for _ in range(2):
            ident, _token, data = server.recv_multipart()
            request = p.decode(data)
            time.sleep(1.2)
            if request.cmd == "load":
                server.send_multipart([ident, p.encode(p.LoadProgress("m", 1, 2))])
            server.send_multipart([ident, p.encode(p.AdminReply(200, {"cmd": request.cmd}))])

    thread = threading.Thread(target=slow_server, daemon=True)
    thread.start()
    addr = f"tcp://127.0.0.1:{port}"
    try:
        progress = []
        reply = call(addr, "load", {"path": "/x.gguf"}, None, 0.5, progress.append)
        assert reply.status == 200 and reply.body == {"cmd": "load"} and len(progress) == 1
        with pytest.raises(TimeoutError, match=f"the server at {addr} did not answer `status` within 0.5 s"):
            call(addr, "status", {}, None, 0.5)
        thread.join(10)
    finally:
        server.close()


def test_admin_without_a_server_says_so_within_the_default_timeout(no_server):
    addr, status = no_server
    out, err = status.communicate(timeout=20)
    assert status.returncode == 1 and out == ""
    assert f"the server is not answering at {addr}" in err


@pytest.mark.parametrize("argv, body", [
    (["--spec", "ngram", "--spec-n", "4"], {"spec": {"kind": "ngram", "n": 4}}),
    (["--draft-model", "d.gguf", "--spec-k", "6"],
     {"spec": {"kind": "draft", "k": 6, "draft": os.path.abspath("d.gguf")}}),
    (["--spec", "none"], {"spec": None}),                   # off for this replica
    (["--activations", "int8"], {"activations": "int8"}),
    ([], {}),                                               # the server's own settings
])
def test_admin_load_options_become_the_load_body(argv, body):
    from pantheon.cli import build_parser
    from pantheon.frontend.admin_cli import request_args
    args = build_parser().parse_args(["admin", "load", "m.gguf", *argv])
    got = request_args(args)
    assert got == {"path": os.path.abspath("m.gguf"), "ctx": 0, "slots": 0, **body}
