"""CURVE on the ZeroMQ links: `serve --keys DIR` with its spawned worker, an external
worker with an allowed key, a rogue with an unlisted one and one with none, a worker
that meets a frontend with another key, and the admin socket through `pantheon admin
--keys`."""
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import tiny_models as tm
from cluster import Server
from pantheon.common import keys

ADMIN = "adm"


def pantheon(*args, **kw):
    return subprocess.run([sys.executable, "-m", "pantheon.cli", *args], capture_output=True,
                          text=True, timeout=kw.pop("timeout", 90), **kw)


def worker(srv, die, *extra):
    log = srv.base / f"{die}.log"
    proc = subprocess.Popen([sys.executable, "-m", "pantheon.cli", "worker", "--die", die,
                             "--frontend", f"tcp://127.0.0.1:{srv.zport}", "--slots", "1",
                             *extra], stdout=subprocess.DEVNULL, stderr=log.open("w"))
    proc.log = log
    return proc


def dies(srv) -> dict:
    r = httpx.get(srv.url + "/admin/dies", headers={"Authorization": f"Bearer {ADMIN}"},
                  timeout=30)
    return {d["die"]: d for d in r.json()["dies"]}


def wait_for(predicate, timeout=60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    base = tmp_path_factory.mktemp("curve")
    assert pantheon("keys", "generate", str(base / "k"), "--worker", "ext").returncode == 0
    model = tm.write_gguf("llama", base / "tiny.gguf")
    srv = Server("--keys", str(base / "k"), "--model", str(model), "--ctx", "128",
                 "--slots", "1", "--admin-key", ADMIN)
    srv.admin_addr = srv.args[srv.args.index("--admin-addr") + 1]
    srv.keys = base / "k"
    srv.base = base
    with srv:
        yield srv


def test_the_spawned_worker_joins_over_curve_with_the_servers_folder(secured):
    [proc] = secured.workers()
    cmd = proc.cmdline()
    assert Path(cmd[cmd.index("--keys") + 1]) == secured.keys
    assert "CURVE on" in secured.logs() and "refused" not in secured.logs()
    r = secured.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_an_allowed_worker_joins_and_a_rogue_or_keyless_one_does_not(secured):
    rogue_dir = secured.base / "rogue"        # knows the server's public key; not allowed
    keys.worker_folder(rogue_dir, secured.keys / "server.key")
    procs = [worker(secured, "cpu:rogue", "--keys", str(rogue_dir)),
             worker(secured, "cpu:plain", "--insecure"),
             worker(secured, "cpu:ext", "--keys", str(secured.keys / "ext"))]
    try:
        assert wait_for(lambda: "cpu:ext" in dies(secured)), secured.logs()
        assert dies(secured)["cpu:ext"]["alive"]
        assert wait_for(lambda: "refused a worker connection" in secured.logs())
        rogue_key = keys.worker_pair(rogue_dir).public.decode()
        assert rogue_key in secured.logs()
        # the rogue hears why (libzmq does not always report the keyless one's failure)
        assert wait_for(lambda: "authorized/ folder" in procs[0].log.read_text()), \
            procs[0].log.read_text()[-3000:]
        time.sleep(2)                      # both had as long as the allowed one, and more
        assert set(dies(secured)) == {"cpu", "cpu:ext"}
        assert all(p.poll() is None for p in procs)     # nothing crashed, on either side
        assert secured.client().models.list().data
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_worker_talks_only_to_the_frontend_whose_key_it_holds(secured):
    """Whoever binds the port a worker dials gains nothing: a rogue keyless frontend, or
    one with CURVE under another key, completes no handshake with a worker holding the
    real server's key, so it never hears a hello (or anything); the worker says why."""
    import zmq
    from cluster import free_port
    ctx = zmq.Context.instance()
    rogues, procs = [], []
    try:
        for curve in (False, True):
            sock = ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            if curve:
                sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
                sock.curve_server = True
            port = free_port()
            sock.bind(f"tcp://127.0.0.1:{port}")
            rogues.append(sock)
            log = secured.base / f"fooled-{curve}.log"
            proc = subprocess.Popen(
                [sys.executable, "-m", "pantheon.cli", "worker", "--die", "cpu",
                 "--frontend", f"tcp://127.0.0.1:{port}", "--keys", str(secured.keys / "ext")],
                stdout=subprocess.DEVNULL, stderr=log.open("w"))
            proc.log = log
            procs.append(proc)
        for proc in procs:
            assert wait_for(lambda: "refused the link's handshake" in proc.log.read_text()
                            or "no handshake with the frontend" in proc.log.read_text(), 60), \
                proc.log.read_text()[-2000:]
        assert not any(sock.poll(0) for sock in rogues)       # not a byte of a message
        assert all(proc.poll() is None for proc in procs)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        for sock in rogues:
            sock.close()


def test_the_admin_socket_needs_the_server_key(secured):
    base = ["admin", "--addr", secured.admin_addr, "--key", ADMIN]
    ok = pantheon(*base, "--keys", str(secured.keys), "status")
    assert ok.returncode == 0 and '"service": "pantheon"' in ok.stdout, ok.stderr
    # a worker's folder holds the server key too; the token is still checked
    assert pantheon(*base, "--keys", str(secured.keys / "ext"), "status").returncode == 0
    wrong = pantheon("admin", "--addr", secured.admin_addr, "--key", "nope", "--keys",
                     str(secured.keys), "status")
    assert wrong.returncode == 1 and "(401)" in wrong.stderr
    clear = pantheon(*base, "--timeout", "3", "status")        # no CURVE: no answer
    assert clear.returncode == 1 and "pass --keys DIR" in clear.stderr, clear.stderr


def test_a_drop_before_the_handshake_is_reported_like_a_refusal():
    """The worker's link monitor: a connection dropped before its handshake completed
    is a refusal (the frontend's ERROR frame may lose the race with its close); a drop
    after a completed handshake (a frontend restart) is not."""
    import types
    import zmq
    from pantheon.worker.main import Worker
    seen = []
    w = types.SimpleNamespace(rehello=False, link_up=False, unacknowledged_since=None,
                              handshake_failed=lambda: seen.append("refused"))
    for event in (zmq.EVENT_CONNECTED, zmq.EVENT_DISCONNECTED):
        Worker.link_event(w, event)
    assert seen == ["refused"] and w.rehello
    for event in (zmq.EVENT_CONNECTED, zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_DISCONNECTED):
        Worker.link_event(w, event)
    assert seen == ["refused"]
    Worker.link_event(w, zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    assert seen == ["refused", "refused"]


def test_a_connection_left_without_a_handshake_is_reported_like_a_refusal(monkeypatch):
    """No event at all after CONNECTED (a refusal libzmq reports to neither side's
    monitor): after HANDSHAKE_WAIT_S it is reported; a completed handshake never is."""
    import types
    import zmq
    from pantheon.worker import main
    said, now = [], [1000.0]
    monkeypatch.setattr(main.time, "monotonic", lambda: now[0])
    w = types.SimpleNamespace(rehello=False, link_up=False, unacknowledged_since=None,
                              connected_once=False,
                              handshake_failed=lambda seen=True: said.append(
                                  "refused" if seen else "no link"))
    main.Worker.link_event(w, zmq.EVENT_CONNECTED)
    now[0] += main.HANDSHAKE_WAIT_S - 0.1
    main.Worker.check_handshake(w)
    assert said == []
    now[0] += 0.2
    main.Worker.check_handshake(w)
    main.Worker.check_handshake(w)
    assert said == ["refused"]                   # once, not on every turn of the loop
    main.Worker.link_event(w, zmq.EVENT_CONNECTED)
    main.Worker.link_event(w, zmq.EVENT_HANDSHAKE_SUCCEEDED)
    now[0] += 100
    main.Worker.check_handshake(w)
    assert said == ["refused"]


def test_a_link_with_no_event_at_all_is_reported_after_the_wait(monkeypatch):
    """Not even CONNECTED (a loaded host, or a frontend not up): the wait runs from the
    connect itself, and the line says both causes."""
    import zmq
    from pantheon.worker import main
    now = [1000.0]
    monkeypatch.setattr(main.time, "monotonic", lambda: now[0])
    w = main.Worker.__new__(main.Worker)
    w.unacknowledged_since, w.connected_once, w.warned_at = now[0], False, -60.0
    w.keys = (b"server", None)
    lines = []
    monkeypatch.setattr(main.log, "warning", lambda fmt, *a: lines.append(fmt % a))
    now[0] += main.HANDSHAKE_WAIT_S - 0.1
    main.Worker.check_handshake(w)
    assert lines == []
    now[0] += 0.2
    main.Worker.check_handshake(w)
    assert len(lines) == 1 and "not up yet" in lines[0] and "authorized/ folder" in lines[0]
    main.Worker.link_event(w, zmq.EVENT_CONNECTED)   # now it connects: refused in time
    w.link_up = False
    now[0] += 61
    main.Worker.link_event(w, zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    assert "refused the link's handshake" in lines[-1]
