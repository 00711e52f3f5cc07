"""One replica across two CPU dies (`--spawn-workers cpu,cpu`): the two-stage replica's
greedy output equals the one-die replica's token for token, for every family, with
concurrent streams, chunked prefill, n > 1 and a resumed session; bad placements are
refused; a kill -9 of the second stage fails its stream fast and the replica comes back."""
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

import tiny_models as tm
from cluster import Server
from pantheon.common.default_model import cached_path

FAMILIES = ["llama", "qwen35", "gemma3"]
SMOL = cached_path()
# a short prompt, and one longer than --prefill-chunk (chunked, and cut in two micro-batches)
PROMPTS = [[5, 17, 33, 9], [(7 * i + 3) % 300 + 3 for i in range(45)]]
NO_EOS = {"1": -100, "2": -100}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    d = tmp_path_factory.mktemp("two")
    paths = {m: str(tm.write_gguf(m, d / f"{m}.gguf")) for m in FAMILIES}
    srv = Server("--spawn-workers", "cpu,cpu", "--slots", "4", "--ctx", "256",
                 "--prefill-chunk", "16", "--prefix-cache-mb", "16",
                 "--model", paths["llama"], "--name", "llama-one", "--model-dir", str(d),
                 "--model-dir", str(SMOL.parent))
    with srv:
        srv.paths = paths
        for fam in FAMILIES:
            if fam != "llama":
                assert load(srv, {"path": paths[fam], "name": f"{fam}-one",
                                  "dies": ["cpu"]}).status_code == 200
            r = load(srv, {"path": paths[fam], "name": f"{fam}-two", "dies": ["cpu", "cpu:1"]})
            assert r.status_code == 200, r.text
        yield srv


def load(srv, body):
    return httpx.post(f"{srv.url}/admin/models/load", json=body, timeout=120)


def complete(srv, model, prompt, **kw):
    body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "logit_bias": NO_EOS, **kw}
    r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60, headers=kw.pop(
        "headers", None) or {})
    assert r.status_code == 200, r.text
    return r.json()


def texts(out):
    return [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])]


def test_the_split_replica_has_a_stage_on_each_die(fleet):
    models = httpx.get(f"{fleet.url}/admin/models").json()["models"]
    two = next(m for m in models if m["name"] == "llama-two")["replicas"][0]
    assert [s["die"] for s in two["stages"]] == ["cpu", "cpu:1"]
    assert two["stages"][0]["layers"] == [0, 1] and two["stages"][1]["layers"] == [1, 2]
    assert all(s["reserved_bytes"] > 0 for s in two["stages"])
    # both workers run on this host: an ipc link, in a folder of the second stage's own
    assert two["stages"][1]["link"].startswith("ipc://") and not two["stages"][1]["curve"]
    dies = {d["die"]: d for d in httpx.get(f"{fleet.url}/admin/dies").json()["dies"]}
    assert any("llama-two" in m and "layers 1-1" in m for m in dies["cpu:1"]["models"])
    metrics = httpx.get(f"{fleet.url}/metrics").text
    used = [line for line in metrics.splitlines()
            if line.startswith('pantheon:die_memory_used_bytes{die="cpu:1"}')]
    assert used and float(used[0].split()[-1]) >= two["stages"][1]["reserved_bytes"]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_equals_the_one_die_replica(fleet, family):
    for prompt in PROMPTS:
        one = texts(complete(fleet, f"{family}-one", prompt))
        assert texts(complete(fleet, f"{family}-two", prompt)) == one


def test_concurrent_streams_and_n_equal_the_one_die_replica(fleet):
    prompts = [PROMPTS[1][i:] for i in range(4)]
    want = [texts(complete(fleet, "qwen35-one", p)) for p in prompts]
    with ThreadPoolExecutor(4) as pool:     # one step holds them all: two micro-batches
        got = list(pool.map(lambda p: texts(complete(fleet, "qwen35-two", p)), prompts))
    assert got == want
    both = texts(complete(fleet, "gemma3-two", PROMPTS[1], n=2))
    assert both == texts(complete(fleet, "gemma3-one", PROMPTS[1])) * 2


def test_a_resumed_session_restores_both_stages(fleet):
    """A session's state leaves its slot for the host cache (other prompts take every slot)
    and comes back on both dies: the second turn is cached, and still exact."""
    for model in ("qwen35-one", "qwen35-two"):
        first = complete(fleet, model, PROMPTS[1], session_id=f"s-{model}",
                         return_token_ids=True)
        for i in range(4):
            complete(fleet, model, [40 + i] * 20)
        turn = PROMPTS[1] + first["choices"][0]["token_ids"] + [50, 51, 52]
        second = complete(fleet, model, turn, session_id=f"s-{model}")
        if model.endswith("one"):
            want = (texts(first), texts(second))
        else:
            assert (texts(first), texts(second)) == want
            assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.skipif(not SMOL.exists(), reason="default model not fetched")
def test_smollm2_fp32_split_equals_one_die(fleet):
    for name, dies in (("smol-one", ["cpu"]), ("smol-two", ["cpu", "cpu:1"])):
        r = load(fleet, {"path": str(SMOL), "name": name, "dies": dies, "quantize": "none",
                         "slots": 2, "ctx": 128})
        assert r.status_code == 200, r.text
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 30]
    bias = {"0": -100, "2": -100}
    one = texts(complete(fleet, "smol-one", prompt, logit_bias=bias, max_tokens=16))
    assert texts(complete(fleet, "smol-two", prompt, logit_bias=bias, max_tokens=16)) == one
    for name in ("smol-one", "smol-two"):
        httpx.post(f"{fleet.url}/admin/models/unload", json={"name": name}, timeout=60)
    dies = {d["die"]: d for d in httpx.get(f"{fleet.url}/admin/dies").json()["dies"]}
    assert not any("smol" in m for d in dies.values() for m in d["models"])


@pytest.mark.parametrize("body, status, words", [
    ({"dies": ["cpu", "gpu9"]}, 400, "unknown die"),
    ({"dies": ["cpu", "cpu"]}, 400, "twice"),
    ({"dies": ["cpu", "cpu:1", "cpu:2"]}, 400, "at most two"),
    ({"dies": ["cpu", "cpu:1"], "split": [0]}, 400, "each stage needs a layer"),
    ({"dies": ["cpu", "cpu:1"], "split": [2]}, 400, "each stage needs a layer"),
    ({"dies": ["cpu"], "split": [1]}, 400, "split needs two dies"),
    ({"split": [1]}, 400, "split needs two dies"),
    ({"dies": ["cpu", "cpu:1"], "ctx": 10**9}, 507, "does not fit"),
])
def test_bad_split_placements_are_refused(fleet, body, status, words):
    r = load(fleet, {"path": fleet.paths["llama"], "name": "bad", **body})
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]
    names = [m["name"] for m in httpx.get(f"{fleet.url}/admin/models").json()["models"]]
    assert "bad" not in names


@pytest.mark.parametrize("link, words", [("tcp", "keys missing"), ("udp", "link must be")])
def test_a_tcp_link_without_keys_is_refused_and_leaves_both_dies_empty(fleet, link, words):
    """This fleet has no keys and no --insecure: a tcp stage link would carry activations
    unauthenticated, so the load is refused before either stage is sent."""
    r = load(fleet, {"path": fleet.paths["llama"], "name": "bad-link", "dies": ["cpu", "cpu:1"],
                     "link": link})
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]
    dies = httpx.get(f"{fleet.url}/admin/dies").json()["dies"]
    assert not any("bad-link" in m for d in dies for m in d["models"])
    assert "bad-link" not in [m["name"] for m in
                              httpx.get(f"{fleet.url}/admin/models").json()["models"]]


def replica(srv, name):
    models = httpx.get(f"{srv.url}/admin/models").json()["models"]
    return next(m for m in models if m["name"] == name)["replicas"][0]


def wait_reloaded(srv, name, loads):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:     # the die's worker is respawned, both stages reload
        two = replica(srv, name)
        if two["state"] == "ready" and two["loads"] > loads:
            return two
        time.sleep(0.2)
    raise AssertionError(f"{name} did not come back: {two}")


def test_a_stop_string_ends_a_split_stream_and_the_replica_goes_on(fleet):
    want = texts(complete(fleet, "llama-one", PROMPTS[1], max_tokens=40))[0]
    stop = want[10:13]
    got = texts(complete(fleet, "llama-two", PROMPTS[1], max_tokens=40, stop=[stop]))[0]
    assert got == want[:want.index(stop)]
    assert texts(complete(fleet, "llama-two", PROMPTS[1], max_tokens=40))[0] == want


@pytest.mark.parametrize("die", ["cpu", "cpu:1"])
def test_kill_9_of_a_stage_fails_fast_and_the_replica_comes_back(fleet, die):
    want = texts(complete(fleet, "llama-one", PROMPTS[0], max_tokens=200))
    loads = replica(fleet, "llama-two")["loads"]
    tail = next(d["pid"] for d in httpx.get(f"{fleet.url}/admin/dies").json()["dies"]
                if d["die"] == die)
    events, first = [], threading.Event()
    body = {"model": "llama-two", "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0,
            "logit_bias": NO_EOS, "stream": True}

    def stream():
        with httpx.stream("POST", f"{fleet.url}/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()
    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(20)
    import os
    import signal
    os.kill(tail, signal.SIGKILL)
    reader.join(20)
    assert not reader.is_alive()
    assert any('"error"' in e for e in events), events[-3:]
    wait_reloaded(fleet, "llama-two", loads)
    if die == "cpu":                          # the one-die replica came back there too
        wait_reloaded(fleet, "llama-one", 0)
    assert texts(complete(fleet, "llama-two", PROMPTS[0], max_tokens=200)) == want


def test_unload_frees_both_dies(fleet):
    r = httpx.post(f"{fleet.url}/admin/models/unload", json={"name": "llama-two"}, timeout=60)
    assert r.status_code == 200
    dies = {d["die"]: d for d in httpx.get(f"{fleet.url}/admin/dies").json()["dies"]}
    assert not any("llama-two" in m for d in dies.values() for m in d["models"])
