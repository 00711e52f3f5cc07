"""Models come and go by themselves (frontend/autoload.py), on a real server.

One server with nothing loaded at start (--no-preload), a model dir holding two tiny
models, a file that is not a model and two copies of SmolLM2, an external worker whose
--budget-mb holds one SmolLM2 (and the tiny ones beside it), never two.
"""
import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import tiny_models as tm
from cluster import Server, Stream
from pantheon.common.default_model import cached_path
from pantheon.common.model_file import read_config
from pantheon.frontend.dies import replica_bytes

pytestmark = pytest.mark.skipif(not cached_path().exists(), reason="default model not fetched")
SLOTS, CTX = 2, 256
NO_EOS = {"2": -100, "0": -100}
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    tm.write_gguf("qwen2", d / "tiny-a.gguf")
    tm.write_gguf("llama", d / "tiny-b.gguf")
    (d / "notes.gguf").write_bytes(b"this is not a model")
    for name in ("smol-a", "smol-b"):
        shutil.copyfile(cached_path(), d / f"{name}.gguf")
    smol = replica_bytes(str(cached_path()), read_config(cached_path()), "cpu", SLOTS, CTX)
    server = Server("--no-spawn", "--insecure", "--no-preload", "--model-dir", str(d),
                    "--alias", f"tiny={d / 'tiny-a.gguf'}", "--alias", "also-tiny=tiny",
                    "--keep-alive", "2", "--slots", str(SLOTS), "--ctx", str(CTX),
                    "--queue-timeout", "60")
    server.launch()
    worker = subprocess.Popen(
        [sys.executable, "-m", "pantheon.cli", "worker", "--die", "cpu", "--frontend",
         server.args[server.args.index("--worker-addr") + 1], "--insecure",
         "--budget-mb", f"{1.5 * smol / 2**20:.1f}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        server.wait_healthy()
        server.dir = d
        yield server
    finally:
        server.stop()
        worker.terminate()
        worker.wait(15)


def models(srv) -> dict:
    return {m["id"]: m for m in httpx.get(srv.url + "/v1/models", timeout=30).json()["data"]}


def chat(srv, model, **extra):
    return httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
        "model": model, "messages": HI, "max_tokens": 4, "logit_bias": NO_EOS, **extra})


def metric(srv, name: str, **labels) -> float:
    total = 0.0
    for line in httpx.get(srv.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def until(check, timeout=30.0):
    """Poll `check` until it is true (a bounded wait on the server's state, not a timing)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "the server never got there"
        time.sleep(0.1)


def test_catalog_lists_every_model_with_its_status(srv):
    found = models(srv)
    for name in ("tiny-a", "tiny-b", "smol-a", "smol-b", "tiny", "also-tiny"):
        assert found[name]["status"] == "available", found[name]
    assert "notes" not in found                        # not a model: skipped at scan
    assert found["tiny"]["alias_of"] == found["also-tiny"]["alias_of"] == "tiny-a"
    assert sorted(found["tiny-a"]["aliases"]) == ["also-tiny", "tiny"]
    assert srv.logs().count("skipping") == 1            # one warning for the bad file
    # the CLI shows the same
    out = subprocess.run([sys.executable, "-m", "pantheon.cli", "models", "list", "--url",
                          srv.url], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split()[1] for line in out.stdout.splitlines()[1:]}
    assert rows["tiny-b"] == "available" and rows["also-tiny"] == "available"
    # a file added later is found on a rescan
    tm.write_gguf("llama", srv.dir / "late.gguf")
    r = httpx.post(srv.url + "/admin/models/rescan", json={}, timeout=30)
    assert r.status_code == 200 and r.json()["added"] == ["late"], r.text
    assert models(srv)["late"]["status"] == "available"


def test_unknown_names_and_paths_are_404_listing_what_is_served(srv):
    for name in ("nope", str(srv.dir / "tiny-a.gguf"), "../tiny-a", "/etc/passwd"):
        r = chat(srv, name)
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and "tiny-b" in err["message"]
    assert models(srv)["tiny-a"]["status"] == "available"     # nothing was opened


def test_two_concurrent_first_requests_share_one_load(srv):
    """Through an alias: both answer, the model loaded once, the alias shows it loaded."""
    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda _: chat(srv, "tiny"), range(2)))
    assert [r.status_code for r in replies] == [200, 200], [r.text for r in replies]
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in replies)
    assert metric(srv, "pantheon:model_loads_total", model_name="tiny-a",
                  reason="request", outcome="loaded") == 1
    found = models(srv)
    assert found["tiny"]["status"] == found["tiny-a"]["status"] == "loaded"
    (replica,) = found["tiny-a"]["replicas"]
    assert replica["state"] == "ready"
    # one model loaded: any other name goes to it (the single-model shortcut), a path never
    assert chat(srv, "gpt-4o").json()["model"] == "tiny-a"
    for path in (str(srv.dir / "tiny-b.gguf"), "../tiny-b.gguf", "~/x"):
        assert chat(srv, path).status_code == 404
    assert models(srv)["tiny-b"]["status"] == "available"
    # --keep-alive 2: left alone, it goes (idle), and comes back on the next request
    until(lambda: models(srv)["tiny-a"]["status"] == "available")
    assert metric(srv, "pantheon:model_unloads_total", model_name="tiny-a", reason="idle") == 1
    assert chat(srv, "also-tiny").status_code == 200
    assert metric(srv, "pantheon:model_loads_total", model_name="tiny-a", reason="request") == 2


def shown(srv, path: str, body: dict) -> list[str]:
    """The `model` of a reply, whole and streamed (every event that carries one)."""
    r = httpx.post(srv.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    names = [r.json()["model"]]
    with httpx.stream("POST", srv.url + path, json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            data = json.loads(line[6:]) if line.startswith("data: {") else {}
            data = data.get("message") or data.get("response") or data
            if "model" in data:
                names.append(data["model"])
    return names


def test_the_answer_shows_the_name_the_client_asked_by(srv):
    """An alias is echoed (as Ollama and llama-swap do) on every API, streamed or not;
    the catalog name shows its own name."""
    cases = [("/v1/chat/completions", {"messages": HI, "max_tokens": 2}),
             ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
             ("/v1/messages", {"messages": HI, "max_tokens": 2}),
             ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "store": False})]
    for path, body in cases:
        names = shown(srv, path, {"model": "also-tiny", **body})
        assert len(names) >= 2 and set(names) == {"also-tiny"}, (path, names)
    assert set(shown(srv, "/v1/chat/completions", {"model": "tiny-a", **cases[0][1]})) \
        == {"tiny-a"}


def test_keep_alive_in_the_request(srv):
    for bad in (True, "soon", -5, "5 minutes", 10**9, [1]):
        r = chat(srv, "tiny-b", keep_alive=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive", (bad, r.text)
    assert models(srv)["tiny-b"]["status"] == "available"      # a refused request loads nothing
    r = chat(srv, "tiny-b", keep_alive="1h")
    assert r.status_code == 200, r.text
    assert models(srv)["tiny-b"]["keep_alive_s"] == 3600
    r = chat(srv, "tiny-b", keep_alive=0)                      # 0: unload after this one
    assert r.status_code == 200, r.text
    until(lambda: models(srv)["tiny-b"]["status"] == "available")


def test_counting_and_embedding_load_the_model_they_name(srv):
    """Not the single loaded model's tokenizer: the one named, loaded for it."""
    assert models(srv)["tiny-b"]["status"] == "available"
    r = httpx.post(srv.url + "/tokenize", json={"model": "tiny-b", "prompt": "hi"}, timeout=60)
    assert r.status_code == 200, r.text
    assert models(srv)["tiny-b"]["status"] == "loaded"
    r = httpx.post(srv.url + "/v1/messages/count_tokens", timeout=60,
                   json={"model": "also-tiny", "messages": HI})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text
    r = httpx.post(srv.url + "/v1/embeddings", json={"model": "also-tiny", "input": "hi",
                                                     "keep_alive": "5s"}, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "also-tiny", r.text
    assert models(srv)["tiny-a"]["keep_alive_s"] == 5


def test_a_busy_replica_is_neither_unloaded_nor_evicted(srv):
    """smol-a streams with keep_alive 0 (idle, it would go at once); smol-b does not fit
    beside it: its request waits until smol-a's stream is over, then smol-a goes."""
    busy = Stream(srv.url, {"model": "smol-a", "messages": HI, "max_tokens": 120,
                            "logit_bias": NO_EOS, "keep_alive": 0})
    busy.start()
    assert busy.first.wait(60)
    assert models(srv)["smol-a"]["status"] == "loaded"
    second = chat(srv, "smol-b", keep_alive="1h")     # it stays until evicted (next test)
    assert second.status_code == 200, second.text
    busy.join(60)
    assert busy.status == 200 and busy.error() is None
    assert busy.usage()["completion_tokens"] == 120           # ran to its end, never cut
    found = models(srv)
    assert found["smol-a"]["status"] == "available" and found["smol-b"]["status"] == "loaded"
    # once idle it went once: evicted for smol-b, or unloaded first by its keep_alive 0
    assert metric(srv, "pantheon:model_unloads_total", model_name="smol-a") == 1


def admin_load(srv, name, **extra):
    return httpx.post(srv.url + "/admin/models/load", timeout=120, json={
        "path": str(srv.dir / f"{name}.gguf"), "name": name, **extra})


def test_an_idle_replica_is_evicted_but_a_pinned_one_never(srv):
    """smol-b is idle: a request for smol-a evicts it. An admin load evicts the same way
    (unless its body says "evict": false), and says what it evicted. Then smol-a, loaded
    by an admin with "pin": true, stays: a request for smol-b is a 507 that names what
    holds the memory, at once (nothing could go)."""
    assert chat(srv, "smol-a").status_code == 200
    assert metric(srv, "pantheon:model_unloads_total", model_name="smol-b",
                  reason="evicted") == 1
    r = httpx.post(srv.url + "/admin/models/unload", json={"name": "smol-a"}, timeout=60)
    assert r.status_code == 200, r.text
    # room for it: nothing evicted (it keeps the keep_alive 1h its last request set)
    r = admin_load(srv, "smol-b")
    assert r.status_code == 200 and r.json()["evicted"] == [], r.text
    (held,) = models(srv)["smol-b"]["replicas"]
    r = admin_load(srv, "smol-a", pin=True, evict=False)
    assert r.status_code == 507 and f"evicting {held['id']} (idle" in r.text, r.text
    assert models(srv)["smol-b"]["status"] == "loaded"
    r = admin_load(srv, "smol-a", pin=True)
    assert r.status_code == 200, r.text
    assert r.json()["evicted"] == [{"id": held["id"], "model": "smol-b", "die": "cpu"}]
    assert metric(srv, "pantheon:model_unloads_total", model_name="smol-b",
                  reason="evicted") == 2
    r = chat(srv, "smol-b")
    assert r.status_code == 507, r.text
    assert "smol-a#" in r.json()["error"]["message"] and "pinned" in r.json()["error"]["message"]
    assert models(srv)["smol-a"]["status"] == "loaded" and models(srv)["smol-a"]["pinned"]
    assert chat(srv, "smol-a").status_code == 200


def test_max_loaded_evicts_the_least_recently_used_unpinned_model(tmp_path):
    """--max-loaded 2 with tiny-a pinned: a third model evicts the LRU unpinned one (b),
    never the pinned a, though a was used first; `admin top` counts it all by reason."""
    for name, arch in (("tiny-a", "qwen2"), ("tiny-b", "llama"), ("tiny-c", "qwen2")):
        tm.write_gguf(arch, tmp_path / f"{name}.gguf")
    with Server("--no-preload", "--model-dir", str(tmp_path), "--max-loaded", "2",
                "--pin", "tiny-a", "--keep-alive", "-1", "--slots", "2", "--ctx", "64") as s:
        for name in ("tiny-a", "tiny-b", "tiny-c"):
            r = chat(s, name)
            assert r.status_code == 200, r.text
        found = models(s)
        assert [found[n]["status"] for n in ("tiny-a", "tiny-b", "tiny-c")] == [
            "loaded", "available", "loaded"]
        assert found["tiny-a"]["pinned"] and not found["tiny-c"]["pinned"]
        assert metric(s, "pantheon:model_unloads_total", model_name="tiny-b",
                      reason="evicted") == 1
        assert "unloading tiny-b#2 from die cpu (reason: evicted)" in s.logs()
        top = subprocess.run([sys.executable, "-m", "pantheon.cli", "admin", "--addr",
                              s.args[s.args.index("--admin-addr") + 1], "top", "--once"],
                             capture_output=True, text=True, timeout=60)
        assert top.returncode == 0, top.stderr
        assert "LOADS    request 3" in top.stdout and "UNLOADS  evicted 1" in top.stdout
