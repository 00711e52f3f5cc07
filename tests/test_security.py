"""Refusals off loopback (the real `pantheon serve` / `pantheon worker` commands), the
key files, and the model-dir confinement (unit, then over HTTP and the admin socket)."""
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import tiny_models as tm
from cluster import Server, free_port
from pantheon.common import keys
from pantheon.frontend.security import BrowserPolicy, Exposure, LinkAuth, ModelDirs


def pantheon(*args, timeout=60, env=None):
    return subprocess.run([sys.executable, "-m", "pantheon.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def serve_args(*extra):
    return ["serve", "--port", str(free_port()),
            "--worker-addr", f"tcp://127.0.0.1:{free_port()}",
            "--admin-addr", f"tcp://127.0.0.1:{free_port()}", "--no-spawn", *extra]


def test_addresses_on_and_off_this_host():
    local = ["tcp://127.0.0.1:5570", "tcp://127.8.9.1:1", "tcp://localhost:1",
             "tcp://[::1]:5", "ipc:///tmp/pantheon.sock", "inproc://x"]
    remote = ["tcp://0.0.0.0:1", "tcp://*:1", "tcp://10.0.0.1:2", "tcp://host.lan:2",
              "tcp://[::]:3", "tcp://eth0:4"]
    assert all(keys.is_local_address(a) for a in local)
    assert not any(keys.is_local_address(a) for a in remote)
    assert all(keys.is_loopback_host(h) for h in ["127.0.0.1", "::1", "[::1]", "localhost"])
    assert not any(keys.is_loopback_host(h) for h in ["0.0.0.0", "::", "192.168.1.2", "a.b"])


def exposure(**kw):
    base = dict(host="127.0.0.1", worker_addr="tcp://127.0.0.1:1",
                admin_addr="tcp://127.0.0.1:2", api_key=None, admin_key=None, keys_dir=None)
    return Exposure(**{**base, **kw}).problems()


def test_loopback_needs_nothing_and_each_exposure_names_its_flag():
    assert exposure() == []
    assert exposure(worker_addr="ipc:///tmp/w", admin_addr="ipc:///tmp/a") == []
    [api, admin] = exposure(host="0.0.0.0")
    assert "--api-key" in api and "--admin-key" in admin and "--no-http-admin" in admin
    assert exposure(host="0.0.0.0", api_key="k", admin_key="a") == []
    assert exposure(host="0.0.0.0", api_key="k", http_admin=False) == []
    [worker] = exposure(worker_addr="tcp://0.0.0.0:1")
    assert "--worker-addr" in worker and "--keys" in worker
    assert exposure(worker_addr="tcp://0.0.0.0:1", keys_dir="/k") == []
    token, curve = exposure(admin_addr="tcp://*:2")
    assert "--admin-key" in token and "--keys" in curve
    assert exposure(admin_addr="tcp://*:2", admin_key="a", keys_dir="/k") == []


@pytest.mark.parametrize("extra, flag", [
    (["--host", "0.0.0.0"], "--api-key"),
    (["--host", "0.0.0.0", "--api-key", "k"], "--admin-key"),
    (["--worker-addr", "tcp://0.0.0.0:5999"], "--keys"),
    (["--admin-addr", "tcp://0.0.0.0:5998", "--admin-key", "a"], "--keys"),
    (["--admin-addr", "tcp://0.0.0.0:5998", "--keys", "/nonexistent"], "--admin-key"),
    ([], "--no-spawn and the worker link has no keys"),    # nobody could join it
])
def test_serve_refuses_an_unguarded_bind_naming_the_flag(extra, flag):
    r = pantheon(*serve_args(*extra))
    assert r.returncode == 1, r.stderr
    assert "refusing to start" in r.stderr and flag in r.stderr and "--insecure" in r.stderr
    assert "Traceback" not in r.stderr


def test_insecure_starts_and_warns_at_every_start(tmp_path):
    model = tm.write_gguf("llama", tmp_path / "tiny.gguf")
    for _ in range(2):
        srv = Server("--host", "0.0.0.0", "--insecure", "--model", str(model),
                     "--ctx", "128", "--slots", "1")
        with srv:
            r = httpx.get(srv.url + "/admin/status")       # open: nothing guards it
            assert r.status_code == 200
            logs = srv.logs()
        assert logs.count("--insecure: --host 0.0.0.0") == 2       # API key, admin key


def test_admin_routes_keep_the_admin_key_when_the_api_key_is_unset(tmp_path):
    model = tm.write_gguf("llama", tmp_path / "tiny.gguf")
    with Server("--host", "0.0.0.0", "--insecure", "--admin-key", "adm",
                "--model", str(model), "--ctx", "128", "--slots", "1") as srv:
        assert httpx.get(srv.url + "/admin/status").status_code == 401
        assert httpx.get(srv.url + "/v1/models").status_code == 200
        ok = httpx.get(srv.url + "/admin/status", headers={"Authorization": "Bearer adm"})
        assert ok.status_code == 200


def test_no_http_admin_removes_the_routes(tmp_path):
    model = tm.write_gguf("llama", tmp_path / "tiny.gguf")
    with Server("--no-http-admin", "--model", str(model), "--ctx", "128", "--slots", "1") as srv:
        r = httpx.get(srv.url + "/admin/status")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_worker_refuses_a_remote_frontend_without_keys():
    r = pantheon("worker", "--frontend", "tcp://10.255.255.1:5570")
    assert r.returncode == 1 and "refusing to start" in r.stderr and "--keys" in r.stderr


def test_worker_refuses_a_keyless_link_on_loopback_too():
    """Without keys a worker would obey whatever process bound its frontend's port
    first: refused unless --insecure (a worker `serve` spawns holds its spawn proof)."""
    r = pantheon("worker", "--frontend", f"tcp://127.0.0.1:{free_port()}")
    assert r.returncode == 1 and "refusing to start" in r.stderr, r.stderr
    assert "--keys" in r.stderr and "--insecure" in r.stderr and "Traceback" not in r.stderr


def test_a_worker_key_rewritten_in_place_is_read_again(tmp_path):
    """Rotating a worker's key by rewriting authorized/NAME.key in place (the folder's
    own time unchanged): the next connection is judged by the new key, not the old."""
    k = tmp_path / "k"
    keys.generate(k, ["ext"])
    auth = LinkAuth(k)
    old = keys.worker_pair(k / "ext").public
    assert auth.callback("workers", old)
    folder = k / "authorized"
    before = folder.stat()
    rotated = keys.write_pair(tmp_path / "new", "worker")
    (folder / "ext.key").write_bytes(rotated.read_bytes())
    os.utime(folder, ns=(before.st_atime_ns, before.st_mtime_ns))
    new = keys.read_key(rotated, secret=False).public
    assert auth.callback("workers", new)
    assert not auth.callback("workers", old)


def test_keys_generate_writes_the_layout_with_private_secrets(tmp_path):
    r = pantheon("keys", "generate", str(tmp_path / "k"), "--worker", "a", "--worker", "b")
    assert r.returncode == 0, r.stderr
    k = tmp_path / "k"
    server = keys.server_pair(k)
    assert keys.server_public(k) == server.public
    assert keys.authorized_keys(k) == {keys.worker_pair(k / "a").public,
                                       keys.worker_pair(k / "b").public}
    assert keys.server_public(k / "a") == server.public
    for secret in [k / "server.key_secret", k / "a" / "worker.key_secret"]:
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    # a second run keeps the server pair and adds a worker; a taken name is refused
    assert pantheon("keys", "generate", str(k), "--worker", "c").returncode == 0
    assert keys.server_pair(k) == server and len(keys.authorized_keys(k)) == 3
    again = pantheon("keys", "generate", str(k), "--worker", "a")
    assert again.returncode == 1 and "already exists" in again.stderr
    bad = pantheon("keys", "generate", str(k), "--worker", "../x")
    assert bad.returncode == 1 and "bad worker name" in bad.stderr


def test_a_missing_or_broken_key_is_a_clear_error(tmp_path):
    with pytest.raises(keys.KeyFileError, match="not found"):
        keys.server_pair(tmp_path)
    (tmp_path / "server.key_secret").write_text("public-key = \"short\"\n")
    with pytest.raises(keys.KeyFileError, match="does not hold"):
        keys.server_pair(tmp_path)
    r = pantheon(*serve_args("--keys", str(tmp_path)))
    assert r.returncode == 1 and "does not hold" in r.stderr and "Traceback" not in r.stderr


def test_model_dirs_judge_the_resolved_path(tmp_path):
    inside, outside = tmp_path / "models", tmp_path / "elsewhere"
    inside.mkdir()
    outside.mkdir()
    (outside / "secret.gguf").write_bytes(b"x")
    (inside / "link.gguf").symlink_to(outside / "secret.gguf")
    dirs = ModelDirs([str(inside)])
    assert dirs.allows(str(inside / "a.gguf")) and dirs.allows(str(inside / "sub" / "b"))
    assert not dirs.allows(str(outside / "secret.gguf"))
    assert not dirs.allows(str(inside / "link.gguf"))             # points out of it
    assert not dirs.allows(str(inside / ".." / "elsewhere" / "secret.gguf"))
    assert not dirs.allows(str(tmp_path / "models-evil" / "x"))   # a prefix, not a folder
    assert not dirs.allows("bad\0path")
    default = ModelDirs.default(tmp_path / "cache", [str(inside / "start.gguf")])
    assert default.allows(str(inside / "other.gguf"))
    assert default.allows(str(tmp_path / "cache" / "m" / "x.gguf"))
    assert not default.allows(str(outside / "secret.gguf"))


@pytest.fixture(scope="module")
def confined(tmp_path_factory):
    folder = tmp_path_factory.mktemp("served")
    model = tm.write_gguf("llama", folder / "tiny.gguf")
    keys = folder / "admin.keys"                      # the admin key from a file, not argv
    keys.write_text("adm\n")
    keys.chmod(0o600)
    srv = Server("--model", str(model), "--ctx", "128", "--slots", "1",
                 "--admin-key-file", str(keys))
    srv.admin_addr = srv.args[srv.args.index("--admin-addr") + 1]
    srv.folder, srv.keys = folder, keys
    with srv:
        yield srv


def test_the_admin_key_file_is_out_of_argv_and_reread_on_change(confined, tmp_path):
    argv = (Path("/proc") / str(confined.proc.pid) / "cmdline")
    if argv.exists():
        assert b"adm" not in argv.read_bytes().split(b"\0")
    dies = confined.url + "/admin/dies"

    def status(key: str) -> int:
        return httpx.get(dies, headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code

    def until(check) -> bool:                # the server looks at the file once a second
        for _ in range(50):
            if check():
                return True
            time.sleep(0.2)
        return False
    assert status("adm") == 200 and status("adm-next") == 401
    client = tmp_path / "client.key"
    client.write_text("adm-next\n")
    cli = [sys.executable, "-m", "pantheon.cli", "admin", "--addr", confined.admin_addr,
           "--key-file", str(client), "status"]
    try:
        confined.keys.write_text("adm\nadm-next\n")                # rotation: both, then new
        assert until(lambda: status("adm-next") == 200) and status("adm") == 200
        confined.keys.write_text("adm-next\n")
        assert until(lambda: status("adm") == 401) and status("adm-next") == 200
        done = subprocess.run(cli, capture_output=True, text=True, timeout=30)   # the socket too
        assert done.returncode == 0 and '"service": "pantheon"' in done.stdout, done.stderr
    finally:
        confined.keys.write_text("adm\n")
        assert until(lambda: status("adm") == 200)


def test_a_fifo_load_is_400_naming_it_and_never_opened(confined):
    fifo = confined.folder / "fifo.gguf"
    os.mkfifo(fifo)
    try:
        r = httpx.post(confined.url + "/admin/models/load", headers={"Authorization": "Bearer adm"},
                       json={"path": str(fifo), "name": "fifo"}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "path" and f"{fifo} is a FIFO" in err["message"]
    finally:                      # a load that opened it (and blocked) ends: no writer-less hang
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    assert httpx.get(confined.url + "/health", timeout=10).status_code == 200


def test_loads_outside_the_model_dirs_are_403_with_identical_bodies(confined, tmp_path):
    existing = tmp_path / "real.gguf"
    tm.write_gguf("llama", existing)
    headers = {"Authorization": "Bearer adm"}
    answers = []
    for path in [str(existing), str(tmp_path / "missing.gguf"), "/etc/passwd",
                 "/nonexistent/dir/x.gguf"]:
        r = httpx.post(confined.url + "/admin/models/load", headers=headers, timeout=60,
                       json={"path": path, "name": "probe"})
        assert r.status_code == 403
        answers.append(r.content)
    assert len(set(answers)) == 1, answers
    err = json.loads(answers[0])["error"]
    assert err["type"] == "permission_error" and err["param"] == "path"
    assert "--model-dir" in err["message"]
    # the admin socket answers the same
    cli = [sys.executable, "-m", "pantheon.cli", "admin", "--addr", confined.admin_addr,
           "--key", "adm", "--timeout", "60"]
    for path in [str(existing), str(tmp_path / "missing.gguf")]:
        r = subprocess.run(cli + ["load", path, "--name", "probe"], capture_output=True,
                           text=True, timeout=90)
        assert r.returncode == 1 and "(403)" in r.stderr and "--model-dir" in r.stderr
    # inside the model's folder: a load works, and a missing file there is a 404
    inside = tm.write_gguf("llama", confined.folder / "copy.gguf")
    r = httpx.post(confined.url + "/admin/models/load", headers=headers, timeout=120,
                   json={"path": str(inside), "name": "copy", "ctx": 128, "slots": 1})
    assert r.status_code == 200, r.text
    r = httpx.post(confined.url + "/admin/models/load", headers=headers, timeout=60,
                   json={"path": str(confined.folder / "nope.gguf"), "name": "nope"})
    assert r.status_code == 404


def test_browser_policy_hosts_on_and_off_loopback():
    local = BrowserPolicy.build("127.0.0.1")
    for host in ("localhost", "LOCALHOST:8000", "127.0.0.1", "127.0.0.1:80", "[::1]",
                 "[::1]:8000", "localhost."):
        assert local.host_allowed(host), host
    for host in (None, "", "evil.example", "evil.example:8000", "127.0.0.1.nip.io",
                 "localhost:x", "[::1]x", "127.0.0.2"):
        assert not local.host_allowed(host), host
    named = BrowserPolicy.build("127.0.0.1", ["llm.internal"])
    assert named.host_allowed("llm.internal:8000") and not named.host_allowed("other")
    assert BrowserPolicy.build("0.0.0.0").host_allowed("anything")      # unchecked
    some = BrowserPolicy.build("10.0.0.5", ["api.example"])
    assert some.host_allowed("10.0.0.5:8000") and some.host_allowed("api.example")
    assert not some.host_allowed("evil.example")
    assert BrowserPolicy.build("::1").host_allowed("[::1]:1")
    assert BrowserPolicy.build("127.0.0.1", ["*"]).host_allowed("evil.example")


def test_browser_policy_origins():
    none = BrowserPolicy.build("127.0.0.1")
    page = {b"host": b"localhost:8000", b"origin": b"http://evil.example"}
    assert none.cross_site(page, "/v1/models") and not none.cors_allowed(
        "http://evil.example", "/v1/models")
    assert not none.cross_site({b"host": b"localhost:8000",
                                b"origin": b"http://localhost:8000"}, "/admin/dies")
    assert none.cross_site({b"host": b"localhost:8000", b"sec-fetch-site": b"same-site"},
                           "/v1/models")
    assert not none.cross_site({b"host": b"localhost:8000", b"sec-fetch-site": b"none"}, "/")
    assert not none.cross_site({b"host": b"localhost:8000"}, "/v1/models")   # curl, SDKs
    app = BrowserPolicy.build("127.0.0.1", cors_origins=["https://app.example/"])
    ok = {b"host": b"localhost:8000", b"origin": b"https://app.example"}
    assert not app.cross_site(ok, "/v1/chat/completions")
    assert app.cors_allowed("https://app.example", "/v1/chat/completions")
    assert app.cross_site(ok, "/admin/models/unload")                  # never on /admin/
    assert not app.cors_allowed("https://app.example", "/admin/models")
    assert app.cross_site(page, "/v1/models")
