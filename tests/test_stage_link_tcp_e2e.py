"""A split replica's stage link over tcp with CURVE (`serve --keys DIR`): the first stage on
the spawned worker, the second on an external worker joined with its own keys and
`--stage-bind 127.0.0.1:PORT`, the link forced to tcp on this one host (`"link": "tcp"`).
The two-stage replica equals the one-die replica token for token; its second stage's bytes
show on its die everywhere bytes are counted; the tail lets in the first stage's key only
and drops a frame past its limit unread; a port in use fails the load with nothing left on
either die."""
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import zmq

import tiny_models as tm
from cluster import Server, free_port
from pantheon.common import keys
from pantheon.common.model_file import read_config
from pantheon.frontend.admin_cli import call
from pantheon.worker import stage_link as sl
from test_curve_e2e import ADMIN, dies, pantheon, wait_for, worker

AUTH = {"Authorization": f"Bearer {ADMIN}"}
PROMPTS = [[5, 17, 33, 9], [(7 * i + 3) % 300 + 3 for i in range(45)]]
NO_EOS = {"1": -100, "2": -100}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    base = tmp_path_factory.mktemp("tcp")
    assert pantheon("keys", "generate", str(base / "k"), "--worker", "ext").returncode == 0
    model = tm.write_gguf("llama", base / "tiny.gguf")
    srv = Server("--keys", str(base / "k"), "--model", str(model),
                 "--ctx", "256", "--slots", "4", "--prefill-chunk", "16",
                 "--admin-key", ADMIN, "--model-dir", str(base))
    srv.admin_addr = srv.args[srv.args.index("--admin-addr") + 1]
    srv.keys, srv.base, srv.model = base / "k", base, str(model)
    srv.stage_port = free_port()
    with srv:
        proc = worker(srv, "cpu:1", "--keys", str(base / "k" / "ext"),
                      "--stage-bind", f"127.0.0.1:{srv.stage_port}")
        try:
            assert wait_for(lambda: "cpu:1" in dies(srv)), proc.log.read_text()[-2000:]
            yield srv
        finally:
            proc.kill()
            proc.wait()


def load(srv, **body):
    return httpx.post(f"{srv.url}/admin/models/load", headers=AUTH, timeout=120,
                      json={"path": srv.model, "dies": ["cpu", "cpu:1"], "link": "tcp", **body})


def complete(srv, model, prompt):
    r = httpx.post(f"{srv.url}/v1/completions", timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
        "logit_bias": NO_EOS})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def held(srv) -> dict:
    return {d: [m for m in info["models"] if "two" in m] for d, info in dies(srv).items()}


def test_a_port_in_use_fails_the_load_and_leaves_both_dies_empty(keyed):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", keyed.stage_port))
        taken.listen()
        r = load(keyed, name="two")
    assert r.status_code == 503, r.text
    message = r.json()["error"]["message"]
    assert f"127.0.0.1:{keyed.stage_port}" in message and "in use" in message, message
    assert held(keyed) == {"cpu": [], "cpu:1": []}
    models = httpx.get(f"{keyed.url}/admin/models", headers=AUTH).json()["models"]
    assert "two" not in [m["name"] for m in models]


def test_a_tcp_curve_split_equals_the_one_die_replica(keyed):
    r = load(keyed, name="two")
    assert r.status_code == 200, r.text
    stages = r.json()["loaded"]["stages"]
    assert stages[1]["link"] == f"tcp://127.0.0.1:{keyed.stage_port}" and stages[1]["curve"]
    for prompt in PROMPTS:
        assert complete(keyed, "two", prompt) == complete(keyed, "tiny", prompt)
    prompts = [PROMPTS[1][i:] for i in range(4)]
    want = [complete(keyed, "tiny", p) for p in prompts]
    with ThreadPoolExecutor(4) as pool:        # one step, two micro-batches on the link
        assert list(pool.map(lambda p: complete(keyed, "two", p), prompts)) == want
    # the second stage's bytes on its die: /admin/dies (what admission subtracts), /metrics,
    # and the admin socket's `top` (what `pantheon admin top` draws)
    tail_bytes = stages[1]["reserved_bytes"]
    assert tail_bytes > 0
    die = dies(keyed)["cpu:1"]
    assert die["used_bytes"] == tail_bytes and any("layers 1-1" in m for m in die["models"])
    assert die["free_bytes"] == die["budget_bytes"] - tail_bytes
    metrics = httpx.get(f"{keyed.url}/metrics").text
    used = [float(line.split()[-1]) for line in metrics.splitlines()
            if line.startswith('pantheon:die_memory_used_bytes{die="cpu:1"}')]
    assert used == [tail_bytes]
    top = call(keyed.admin_addr, "top", {}, ADMIN, 30, keys_dir=str(keyed.keys))
    assert {d["die"]: d["used_bytes"] for d in top.body["dies"]}["cpu:1"] == tail_bytes


def test_the_tail_takes_only_the_first_stage_key_and_drops_oversized_frames(keyed):
    address = f"tcp://127.0.0.1:{keyed.stage_port}"
    tail_key = keys.worker_pair(keyed.keys / "ext").public
    ctx = zmq.Context.instance()

    def dealer(pair):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        keys.curve_client(sock, tail_key, pair)
        sock.connect(address)
        return sock

    hello = sl.pack({"op": "hello", "seq": 1})
    stranger = dealer(keys.worker_pair(keyed.keys / "ext"))   # a valid pair, not the head's
    stranger.send(hello)
    assert not stranger.poll(1000)
    head = keys.server_pair(keyed.keys)        # the spawned first stage's worker dials with it
    big = dealer(head)
    big.send(hello)
    assert big.poll(5000) and sl.unpack(big.recv_multipart()[0])["op"] == "hello"
    width = read_config(keyed.model).d_model
    over = np.zeros(sl.frame_limit(width) // 4 + 1, dtype=np.float32)
    big.send_multipart([sl.pack({"op": "forward", "seq": 2, "spans": [[0, 0, 1, True, "", 1]],
                                 "x": {"dtype": "float32", "shape": [1, over.size]}}), over])
    assert not big.poll(1000)                 # dropped by libzmq unread: no answer, no error
    again = dealer(head)
    again.send(hello)
    assert again.poll(5000)
    for s in (stranger, big, again):
        s.close(0)
    assert complete(keyed, "two", PROMPTS[0]) == complete(keyed, "tiny", PROMPTS[0])


def test_unload_frees_both_dies_and_the_port(keyed):
    r = httpx.post(f"{keyed.url}/admin/models/unload", headers=AUTH, json={"name": "two"},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert held(keyed) == {"cpu": [], "cpu:1": []}
    with socket.socket() as s:              # the tail's listening socket is closed
        s.bind(("127.0.0.1", keyed.stage_port))


def test_serve_stage_bind_reaches_spawned_workers_and_insecure_allows_a_keyless_tcp_link(
        tmp_path):
    """`serve --insecure --stage-bind 127.0.0.1:LOW-HIGH`: the spawned second-stage worker
    binds its tcp link in that range, without CURVE (the operator said --insecure), and
    the split replica answers as the one-die replica does."""
    model = str(tm.write_gguf("llama", tmp_path / "tiny.gguf"))
    low = free_port()
    srv = Server("--insecure", "--spawn-workers", "cpu,cpu", "--stage-bind",
                 f"127.0.0.1:{low}-{low + 3}", "--model", model, "--name", "one",
                 "--ctx", "256", "--slots", "2", "--model-dir", str(tmp_path))
    with srv:
        r = httpx.post(f"{srv.url}/admin/models/load", timeout=120, json={
            "path": model, "name": "two", "dies": ["cpu", "cpu:1"], "link": "tcp"})
        assert r.status_code == 200, r.text
        models = httpx.get(f"{srv.url}/admin/models").json()["models"]
        tail = next(m for m in models if m["name"] == "two")["replicas"][0]["stages"][1]
        host, port = tail["link"].removeprefix("tcp://").rsplit(":", 1)
        assert host == "127.0.0.1" and low <= int(port) <= low + 3, tail
        assert not tail["curve"]
        for prompt in PROMPTS:
            assert complete(srv, "two", prompt) == complete(srv, "one", prompt)
