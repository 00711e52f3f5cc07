"""The fleet: two CPU dies, models loaded and unloaded live, over HTTP, ZeroMQ and the CLI."""
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

import tiny_models as tm
from cluster import Server, free_port
from pantheon.common.default_model import cached_path

pytestmark = pytest.mark.skipif(not cached_path().exists(), reason="default model not fetched")
SMOL = str(cached_path())
KEY = "admin-secret"
NAME = "SmolLM2-135M-Instruct"
NO_EOS = {"2": -100, "0": -100}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tiny = tm.write_gguf("qwen2", tmp_path_factory.mktemp("m") / "tiny.gguf")
    srv = Server("--spawn-workers", "cpu,cpu", "--slots", "4", "--ctx", "512",
                 "--max-models", "4", "--admin-key", KEY,
                 "--admin-addr", f"tcp://127.0.0.1:{free_port()}",
                 # loads come from the test's folders and the cache
                 "--model-dir", str(tmp_path_factory.getbasetemp()),
                 "--model-dir", str(Path(SMOL).parent))
    srv.admin_addr = srv.args[srv.args.index("--admin-addr") + 1]
    with srv:
        srv.tiny = str(tiny)
        yield srv


def admin(srv, cmd, body=None, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if body is None:
        return httpx.get(f"{srv.url}/admin/{cmd}", headers=headers, timeout=120)
    return httpx.post(f"{srv.url}/admin/models/{cmd}", json=body, headers=headers, timeout=120)


def cli(srv, *args, key=KEY):
    return subprocess.run([sys.executable, "-m", "pantheon.cli", "admin", "--addr",
                           srv.admin_addr, "--key", key, *args], capture_output=True,
                          text=True, timeout=120)


def test_die_table_lists_both_dies_with_their_budgets(fleet):
    dies = admin(fleet, "dies").json()["dies"]
    assert [d["die"] for d in dies] == ["cpu", "cpu:1"]
    assert all(d["alive"] and d["kind"] == "cpu" and d["budget_bytes"] > 0 for d in dies)
    assert sum(len(d["models"]) for d in dies) == 1            # the default model, on one die
    assert sum(d["used_bytes"] > 0 for d in dies) == 1


def test_admin_routes_need_the_admin_key(fleet):
    assert admin(fleet, "dies", key=None).status_code == 401
    assert admin(fleet, "dies", key="wrong").status_code == 401
    assert httpx.get(fleet.url + "/v1/models").status_code == 200   # no API key set


def test_load_a_second_model_and_route_by_name(fleet):
    r = admin(fleet, "load", {"path": fleet.tiny, "name": "tiny"})
    assert r.status_code == 200, r.text
    loaded = r.json()["loaded"]
    assert loaded["state"] == "ready" and loaded["progress"]["done"] == 2
    # auto-placement took the die with the most free budget: the empty one
    home = next(d["die"] for d in admin(fleet, "dies").json()["dies"] if "SmolLM2" in
                " ".join(d["models"]))
    assert loaded["die"] != home
    client = fleet.client()
    # /v1/models lists the catalog too (models in the --model-dir folders): these are loaded
    assert {m.id for m in client.models.list().data if m.status == "loaded"} == {NAME, "tiny"}
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, logit_bias=NO_EOS)   # (its EOS is id 2 too)
    assert r.model == "tiny" and r.usage.completion_tokens == 4
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_a_replica_under_the_same_name_shares_the_load(fleet):
    other = next(d["die"] for d in admin(fleet, "dies").json()["dies"]
                 if not any(NAME in m for m in d["models"]))
    seen_during_load = {"models": 0, "chat": 0}

    def busy_elsewhere():
        client = fleet.client()
        while admin(fleet, "status").json()["loading"] or not seen_during_load["models"]:
            if httpx.get(fleet.url + "/v1/models").status_code == 200:
                seen_during_load["models"] += 1
            r = client.chat.completions.create(model="tiny", max_tokens=2,
                                               messages=[{"role": "user", "content": "x"}])
            if r.usage.completion_tokens == 2 and admin(fleet, "status").json()["loading"]:
                seen_during_load["chat"] += 1
    t = threading.Thread(target=busy_elsewhere)
    t.start()
    r = admin(fleet, "load", {"path": SMOL, "name": NAME, "dies": [other]})
    t.join(60)
    assert r.status_code == 200 and r.json()["loaded"]["die"] == other
    assert seen_during_load["models"] > 0 and seen_during_load["chat"] > 0
    assert [m.id for m in fleet.client().models.list().data].count(NAME) == 1
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda i: fleet.client().chat.completions.create(
            model=NAME, max_tokens=24, logit_bias=NO_EOS, seed=i,
            messages=[{"role": "user", "content": f"Count to {i}."}]), range(6)))
    (smol,) = [m for m in admin(fleet, "models").json()["models"] if m["name"] == NAME]
    assert len(smol["replicas"]) == 2 and all(r["served"] > 0 for r in smol["replicas"])


def test_n_choices_of_a_request_go_to_one_replica(fleet):
    """With two replicas of the name, the four choices of one request still land on one
    worker, which prefills the prompt once and forks it (its scheduler's WAIT slots)."""
    def served():
        (smol,) = [m for m in admin(fleet, "models").json()["models"] if m["name"] == NAME]
        assert len(smol["replicas"]) == 2
        return {r["id"]: r["served"] for r in smol["replicas"]}
    before = served()
    for seed in range(2):
        r = fleet.client().chat.completions.create(
            model=NAME, n=4, max_tokens=4, seed=seed, logit_bias=NO_EOS,
            messages=[{"role": "user", "content": f"Name a colour ({seed})."}])
        assert len(r.choices) == 4 and r.usage.completion_tokens == 16
        after = served()
        assert sorted(after[k] - before[k] for k in after) == [0, 4]
        before = after


def test_replicas_are_known_by_content_not_by_path(fleet):
    """The same file through a symlink, or a byte-identical copy elsewhere, is one more
    replica of the name; another model under a taken name is a 409 saying what differs."""
    folder = Path(fleet.tiny).parent
    link, copy = folder / "link.gguf", folder / "copy" / "tiny.gguf"
    link.symlink_to(fleet.tiny)
    copy.parent.mkdir()
    copy.write_bytes(Path(fleet.tiny).read_bytes())
    (tiny,) = [m for m in admin(fleet, "models").json()["models"] if m["name"] == "tiny"]
    other = next(d["die"] for d in admin(fleet, "dies").json()["dies"]
                 if d["die"] != tiny["replicas"][0]["die"])
    for path in (link, copy):
        r = admin(fleet, "load", {"path": str(path), "name": "tiny", "dies": [other]})
        assert r.status_code == 200, r.text
        (tiny,) = [m for m in admin(fleet, "models").json()["models"] if m["name"] == "tiny"]
        assert len(tiny["replicas"]) == 2 and all(x["state"] == "ready" for x in tiny["replicas"])
        assert fleet.client().completions.create(model="tiny", prompt="a", max_tokens=2).usage
        assert admin(fleet, "unload", {"name": "tiny", "die": other}).status_code == 200
    different = tm.write_gguf("llama", folder / "other.gguf")
    r = admin(fleet, "load", {"path": str(different), "name": "tiny"})
    assert r.status_code == 409, r.text
    message = r.json()["error"]["message"]
    assert "different model" in message and ("bytes against" in message or "header" in message)


@pytest.mark.parametrize("body, status", [
    ({"name": "x"}, 400),                                          # no path
    ({"path": str(Path(SMOL).parent / "no-such-model.gguf")}, 404),  # in a --model-dir
    ({"path": "/no/such/model.gguf"}, 403),                        # outside them
    ({"path": SMOL, "name": "big", "ctx": 10_000_000}, 507),       # KV would not fit
    ({"path": SMOL, "name": "two", "dies": ["cpu", "cpu:1", "cpu:2"]}, 400),  # 3 dies
    ({"path": SMOL, "name": "q", "quantize": "q3"}, 400),             # lists the choices
    ({"path": SMOL, "name": "q", "quantize": 7}, 400),
    ({"path": SMOL, "name": "a", "activations": "int4"}, 400),       # lists the choices
    ({"path": SMOL, "name": "a", "activations": 8}, 400),
    ({"path": SMOL, "name": "e", "evict": "no"}, 400),             # a boolean
    ({"path": SMOL, "name": NAME, "dies": ["gpu9"]}, 507),         # no such die
])
def test_load_errors(fleet, body, status):
    r = admin(fleet, "load", body)
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_quantize_is_honoured_and_reserved_bytes_are_the_workers(fleet):
    """quantize "none" holds the same file as fp32 (5.6x the bytes); the reservation of a
    loaded replica is what its worker reports, not an estimate."""
    r = admin(fleet, "load", {"path": SMOL, "name": "smol-fp32", "quantize": "none",
                              "slots": 1, "ctx": 128})
    try:
        assert r.status_code == 200, r.text
        fp32 = r.json()["loaded"]["reserved_bytes"]
        (smol,) = [m for m in admin(fleet, "models").json()["models"] if m["name"] == NAME]
        quantized = smol["replicas"][0]["reserved_bytes"]
    finally:
        assert admin(fleet, "unload", {"name": "smol-fp32"}).status_code == 200
    kv_token = 2 * 30 * 192 * 4                  # SmolLM2: layers x (k, v) x kv dim x fp32
    weights_fp32, weights_q = fp32 - 128 * kv_token, quantized - 4 * 512 * kv_token
    assert weights_fp32 == 538_060_032 and 96e6 < weights_q < 98e6     # vs a 98.4 MB file


def test_unreadable_tensor_types_and_unknown_quantize_modes_are_400(fleet):
    iq = tm.write_gguf("qwen2", Path(fleet.tiny).parent / "iq.gguf", tensor_type="MXFP4")
    r = admin(fleet, "load", {"path": str(iq), "name": "iq"})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "type MXFP4" in message and "tensor blk.0." in message or "token_embd" in message
    bad = admin(fleet, "load", {"path": SMOL, "name": "q", "quantize": "q3"})
    assert bad.status_code == 400 and "auto, none, q8_0, q4" in bad.json()["error"]["message"]
    bad = admin(fleet, "load", {"path": SMOL, "name": "a", "activations": "int4"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "activations"
    assert "auto, int8, int16, not 'int4'" in bad.json()["error"]["message"]


def test_bad_model_files_are_400_naming_the_tensor_or_architecture(fleet):
    folder = Path(fleet.tiny).parent
    good = {a: tm.write_gguf(a, folder / f"{a}.gguf") for a in ("gemma3", "qwen35")}
    for arch, change, message in [
            ("gemma3", {"drop": ["blk.4.post_ffw_norm.weight"]},
             "lacks tensor blk.4.post_ffw_norm.weight"),
            ("gemma3", {"reshape": {"blk.1.attn_q.weight": 64}},
             "tensor blk.1.attn_q.weight has shape [64, 64]"),
            ("gemma3", {"arch": "mamba"}, "unsupported model architecture 'mamba'"),
            ("qwen35", {"drop": ["blk.3.ssm_conv1d.weight"]}, "lacks tensor blk.3.ssm_conv1d.weight"),
            ("qwen35", {"reshape": {"blk.1.ssm_out.weight": 32}},
             "tensor blk.1.ssm_out.weight has shape [32, 96]"),
            ("qwen35", {"drop_keys": ["qwen35.ssm.group_count"]},
             "GGUF key qwen35.ssm.group_count is missing")]:
        bad = tm.rewrite_gguf(good[arch], folder / "bad.gguf", **change)
        r = admin(fleet, "load", {"path": str(bad), "name": "bad"})
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert "bad" not in admin(fleet, "status").json()["ready"]     # nothing placed, no crash


def test_duplicate_load_in_progress_is_409(fleet):
    body = {"path": SMOL, "name": "smol-b"}               # a load of a few seconds
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(admin, fleet, "load", body)
            deadline = time.monotonic() + 30
            while "smol-b" not in admin(fleet, "status").json()["loading"]:
                assert time.monotonic() < deadline and not first.done(), first.result().text
                time.sleep(0.02)
            second = admin(fleet, "load", body)
            assert first.result().status_code == 200
        assert second.status_code == 409 and "in progress" in second.json()["error"]["message"]
        full = admin(fleet, "load", {"path": fleet.tiny, "name": "t3"})
        assert full.status_code == 507 and "full" in full.json()["error"]["message"]
    finally:
        admin(fleet, "unload", {"name": "smol-b"})


def test_unload_drains_then_frees(fleet):
    result = {}

    def stream():
        chunks = list(fleet.client().chat.completions.create(
            model="tiny", max_tokens=60, stream=True, messages=[{"role": "user", "content": "x"}]))
        result["finish"] = chunks[-1].choices[0].finish_reason
    t = threading.Thread(target=stream)
    t.start()
    time.sleep(0.3)
    r = admin(fleet, "unload", {"name": "tiny", "timeout_s": 30})
    t.join(30)
    assert r.status_code == 200 and r.json()["aborted"] == 0
    assert result["finish"] in ("length", "stop")            # it ran to its end, unharmed
    assert "tiny" not in {m.id for m in fleet.client().models.list().data}
    assert admin(fleet, "unload", {"name": "tiny"}).status_code == 404


def test_unload_deadline_aborts_what_remains(fleet):
    errors = []

    def stream():
        try:
            for _ in fleet.client().chat.completions.create(
                    model=NAME, max_tokens=400, stream=True, logit_bias=NO_EOS,
                    extra_body={"session_id": "pinned"},
                    messages=[{"role": "user", "content": "Tell a long story."}]):
                pass
        except openai.APIError as exc:
            errors.append(str(exc))
    threads = [threading.Thread(target=stream) for _ in range(2)]
    for t in threads:
        t.start()
    # unload as soon as both streams run on their replica: a fixed sleep let a fast host
    # finish one of the 400 tokens before the deadline
    deadline = time.monotonic() + 30
    while True:
        busy = [r for m in admin(fleet, "models").json()["models"] if m["name"] == NAME
                for r in m["replicas"] if r["in_flight"]]
        if (busy and busy[0]["in_flight"] == len(threads)) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    time.sleep(0.3)                           # both past their prefill, generating
    die = busy[0]["die"]                      # unload a replica that is generating
    r = admin(fleet, "unload", {"name": NAME, "die": die, "timeout_s": 0.5})
    for t in threads:
        t.join(60)
    assert r.status_code == 200 and r.json()["unloaded"] == [{"id": r.json()["unloaded"][0]["id"],
                                                              "die": die}]
    aborted = r.json()["aborted"]
    assert aborted == busy[0]["in_flight"] >= 1
    assert len(errors) == aborted and "unloaded" in errors[0]
    # the other replica still serves the name
    assert fleet.client().chat.completions.create(
        model=NAME, max_tokens=2, messages=[{"role": "user", "content": "x"}]).usage


def test_zeromq_admin_and_cli(fleet):
    proc = cli(fleet, "status")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["ready"] == [NAME]
    proc = cli(fleet, "load", fleet.tiny, "--name", "tiny-cli")
    assert proc.returncode == 0, proc.stderr
    assert "layers" in proc.stderr and json.loads(proc.stdout)["loaded"]["state"] == "ready"
    proc = cli(fleet, "load", str(Path(fleet.tiny).parent / "no-such.gguf"))
    assert proc.returncode == 1 and "error (404)" in proc.stderr and "not found" in proc.stderr
    proc = cli(fleet, "unload", "tiny-cli")
    assert proc.returncode == 0 and json.loads(proc.stdout)["unloaded"]
    proc = cli(fleet, "dies", key="wrong")
    assert proc.returncode == 1 and "error (401)" in proc.stderr


def test_a_relative_path_is_refused_asking_for_an_absolute_one(fleet):
    r = admin(fleet, "load", {"path": "models/tiny.gguf"})
    assert r.status_code == 400 and "must be absolute" in r.json()["error"]["message"]
    # the CLI resolves a relative path in its own folder, as its user means it
    proc = subprocess.run([sys.executable, "-m", "pantheon.cli", "admin", "--addr",
                           fleet.admin_addr, "--key", KEY, "load", Path(fleet.tiny).name,
                           "--name", "tiny-rel"], capture_output=True, text=True, timeout=120,
                          cwd=Path(fleet.tiny).parent)
    assert proc.returncode == 0, proc.stderr
    assert admin(fleet, "unload", {"name": "tiny-rel"}).status_code == 200


def test_corrupt_files_are_400_naming_the_tensor_and_never_load(fleet):
    folder = Path(fleet.tiny).parent
    q8 = tm.write_gguf("qwen2", folder / "q8.gguf", tensor_type="Q8_0")
    for bad, says in [
            (tm.truncate_gguf(fleet.tiny, folder / "cut.gguf"), "the file is truncated"),
            (tm.poison_gguf(fleet.tiny, folder / "nan.gguf", "blk.0.attn_k.weight"),
             "tensor blk.0.attn_k.weight holds NaN or Inf"),
            (tm.poison_gguf(q8, folder / "inf.gguf", "blk.1.ffn_down.weight", float("inf")),
             "tensor blk.1.ffn_down.weight holds NaN or Inf")]:
        r = admin(fleet, "load", {"path": str(bad), "name": "corrupt"})
        assert r.status_code == 400, r.text
        assert says in r.json()["error"]["message"] and r.json()["error"]["param"] == "path"
    cut = admin(fleet, "load", {"path": str(folder / "cut.gguf"), "name": "corrupt"}).json()
    assert "tensor blk.1." in cut["error"]["message"] and "bytes at offset" in cut["error"]["message"]
    assert all(m["name"] != "corrupt" for m in admin(fleet, "models").json()["models"])


def test_replicas_with_different_contexts_serve_what_the_largest_holds(fleet):
    """Two replicas of one model, contexts 512 and 1024: a prompt only the larger holds
    goes there (the smaller does not shrink the model), /v1/models reports the largest;
    unloading that one replica by its id leaves the other serving."""
    dies = [d["die"] for d in admin(fleet, "dies").json()["dies"]]
    ids = []
    for die, ctx in zip(dies, (512, 1024)):
        r = admin(fleet, "load", {"path": fleet.tiny, "name": "tiny-ctx", "dies": [die],
                                  "ctx": ctx, "slots": 1})
        assert r.status_code == 200 and r.json()["loaded"]["ctx"] == ctx, r.text
        ids.append(r.json()["loaded"]["id"])
    small, big = ids
    client = fleet.client()
    try:
        (card,) = [m for m in httpx.get(fleet.url + "/v1/models").json()["data"]
                   if m["id"] == "tiny-ctx"]
        assert card["max_model_len"] == 1024
        for _ in range(2):                         # whichever replica is idle, it goes big
            done = client.completions.create(model="tiny-ctx", prompt=[7] * 660, max_tokens=1)
            assert done.usage.prompt_tokens == 660
        with pytest.raises(openai.BadRequestError, match="maximum context length is 1024"):
            client.completions.create(model="tiny-ctx", prompt=[7] * 1100, max_tokens=1)
        proc = cli(fleet, "unload", "--id", big)             # that replica alone (the CLI)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["unloaded"] == [{"id": big, "die": dies[1]}]
        (tiny,) = [m for m in admin(fleet, "models").json()["models"] if m["name"] == "tiny-ctx"]
        assert [x["id"] for x in tiny["replicas"]] == [small]
        with pytest.raises(openai.BadRequestError, match="maximum context length is 512"):
            client.completions.create(model="tiny-ctx", prompt=[7] * 660, max_tokens=1)
        assert client.completions.create(model="tiny-ctx", prompt=[7] * 400, max_tokens=1)
        assert admin(fleet, "unload", {"id": "nope#9"}).status_code == 404
        proc = cli(fleet, "unload")
        assert proc.returncode != 0 and "NAME, or --id" in proc.stderr
        assert admin(fleet, "unload", {"id": small, "name": NAME}).status_code == 404
    finally:
        admin(fleet, "unload", {"name": "tiny-ctx"})


def test_a_request_without_model_is_400_when_several_are_served(fleet):
    assert admin(fleet, "load", {"path": fleet.tiny, "name": "tiny"}).status_code == 200
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        r = httpx.post(fleet.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["message"].startswith("model is required") and error["param"] == "model"
        assert NAME in error["message"] and "tiny" in error["message"]
    finally:
        assert admin(fleet, "unload", {"name": "tiny"}).status_code == 200
    alone = httpx.post(fleet.url + "/v1/chat/completions", json=body, timeout=60)
    assert alone.status_code == 200, alone.text           # one model: it serves any request


def test_models_retrieve_answers_like_openai(fleet):
    client = fleet.client()
    model = client.models.retrieve(NAME)
    assert (model.id, model.object, model.owned_by) == (NAME, "model", "pantheon")
    assert model.created > 0
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.body["code"] == "model_not_found"


def test_activations_travel_in_the_load_and_the_workers_choice_is_shown(fleet, tmp_path):
    """"activations" in the load body reaches the worker (in its load message); the
    replica shows what the worker's products take: int8 where its build has int8 products
    (AVX2 builds), int16 elsewhere (the test process builds the same kernels)."""
    from kquants import rewrite_as_k_quants
    from pantheon.worker import kernels_cpu as kc
    from test_kquant_model import q4_k_m, widened
    with widened("qwen2") as name:
        f32 = tm.write_gguf(name, Path(fleet.tiny).parent / f"{name}.gguf")
    path = rewrite_as_k_quants(f32, Path(fleet.tiny).parent / f"{name}-k.gguf", q4_k_m)
    r = admin(fleet, "load", {"path": str(path), "name": "k8", "activations": "int8",
                              "slots": 1, "ctx": 64})
    try:
        assert r.status_code == 200, r.text
        kc.library()
        assert r.json()["loaded"]["activations"] == ("int8" if kc.HAS_X8[0] else "int16")
        (smol,) = [m for m in admin(fleet, "models").json()["models"] if m["name"] == NAME]
        assert smol["replicas"][0]["activations"] == "int16"     # Q4_1: nothing to change
    finally:
        assert admin(fleet, "unload", {"name": "k8"}).status_code == 200
