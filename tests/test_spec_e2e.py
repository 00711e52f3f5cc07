"""`serve --spec ngram` end to end: one server holds SmolLM2 with speculation and the
same file again without (an admin load with "spec": null), and real clients compare."""
import subprocess
import sys

from pathlib import Path

import httpx
import pytest

import tiny_models as tm

from cluster import Server, Stream
from pantheon.common.default_model import cached_path

pytestmark = pytest.mark.skipif(not cached_path().exists(), reason="default model not fetched")
SMOL = str(cached_path())
SPEC = "SmolLM2-135M-Instruct"
CODE = "\n".join(f"def area_{i}(width, height):\n    return width * height * {i}\n"
                 for i in range(6))
EDIT = [{"role": "user", "content": "Rename width to w in this file and return the whole "
                                    f"file:\n{CODE}"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("drafts")
    return {"f32": str(tm.write_gguf("llama", folder / "f32.gguf")),
            "f16": str(tm.write_gguf("llama", folder / "f16.gguf", "F16"))}


@pytest.fixture(scope="module")
def srv(tiny):
    with Server("--spec", "ngram", "--spec-k", "8", "--slots", "4", "--ctx", "1024",
                "--model-dir", str(Path(SMOL).parent),
                "--model-dir", str(Path(tiny["f32"]).parent)) as srv:
        r = httpx.post(f"{srv.url}/admin/models/load", timeout=120,
                       json={"path": SMOL, "name": "plain", "spec": None})
        assert r.status_code == 200, r.text
        assert r.json()["loaded"]["spec"] is None
        yield srv


def test_the_same_replies_with_and_without_speculation(srv):
    client = srv.client()
    ask = dict(messages=EDIT, temperature=0, max_tokens=60)
    plain = client.chat.completions.create(model="plain", **ask)
    assert "completion_tokens_details" not in plain.usage.model_dump(exclude_none=True)
    text = plain.choices[0].message.content
    # the predicted output seeds the proposals; n = 2 runs two sequences side by side
    spec = client.chat.completions.create(model=SPEC, n=2, **ask,
                                          extra_body={"prediction": {"type": "content",
                                                                     "content": text}})
    assert [c.message.content for c in spec.choices] == [text, text]
    details = spec.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 10
    assert spec.usage.completion_tokens == 2 * plain.usage.completion_tokens
    # streamed, with a stop string met in the middle of an accepted run
    stop = text[len(text) // 2:len(text) // 2 + 6]
    streams = [Stream(srv.url, {"model": m, "messages": EDIT, "temperature": 0,
                                "max_tokens": 60, "stop": [stop],
                                "prediction": {"type": "content", "content": text}})
               for m in (SPEC, "plain")]
    for s in streams:
        s.start()
    for s in streams:
        s.join(60)
    said = ["".join(c["choices"][0]["delta"].get("content") or "" for c in s.chunks()
                    if c.get("choices")) for s in streams]
    assert said[0] == said[1] == text[:text.index(stop)]
    assert streams[0].usage()["completion_tokens"] == streams[1].usage()["completion_tokens"]
    metrics = httpx.get(f"{srv.url}/metrics").text
    drafted = [line for line in metrics.splitlines()
               if line.startswith(f'vllm:spec_decode_num_accepted_tokens_total{{model_name="{SPEC}"}}')]
    assert drafted and float(drafted[0].split()[-1]) > 10
    assert 'vllm:spec_decode_num_drafts_total{model_name="plain"}' not in metrics
    listed = httpx.get(f"{srv.url}/admin/models").json()["models"]
    assert {m["name"]: m["replicas"][0]["spec"] for m in listed} == {SPEC: "ngram", "plain": None}


@pytest.mark.parametrize("spec, field", [("eagle", "spec.kind"), ({"kind": "ngram", "k": 17},
                                                                   "spec.k")])
def test_a_bad_spec_in_a_load_is_a_400_naming_it(srv, spec, field):
    r = httpx.post(f"{srv.url}/admin/models/load", timeout=60,
                   json={"path": SMOL, "name": "other", "spec": spec})
    assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_a_draft_model_loads_beside_its_target(srv):
    """SmolLM2 drafting for itself: every proposal passes, the replies are the plain
    replica's, and its reservation holds both models."""
    r = httpx.post(f"{srv.url}/admin/models/load", timeout=120, json={
        "path": SMOL, "name": "drafted", "spec": {"kind": "draft", "draft": SMOL, "k": 4}})
    assert r.status_code == 200, r.text
    assert r.json()["loaded"]["spec"] == "draft"
    client = srv.client()
    ask = dict(messages=[{"role": "user", "content": "Name three rivers."}], temperature=0,
               max_tokens=30)
    drafted = client.chat.completions.create(model="drafted", **ask)
    plain = client.chat.completions.create(model="plain", **ask)
    assert drafted.choices[0].message.content == plain.choices[0].message.content
    details = drafted.usage.completion_tokens_details
    # (a draft as big as its target costs as much as it saves: the pacer tries it sparingly)
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens == 0
    listed = {m["name"]: m["replicas"][0] for m in
              httpx.get(f"{srv.url}/admin/models").json()["models"]}
    assert listed["drafted"]["reserved_bytes"] > 1.5 * listed["plain"]["reserved_bytes"]
    r = httpx.post(f"{srv.url}/admin/models/unload", json={"name": "drafted"}, timeout=60)
    assert r.status_code == 200


def test_a_draft_that_cannot_serve_is_refused(srv, tiny):
    def load(path, draft):
        return httpx.post(f"{srv.url}/admin/models/load", timeout=60, json={
            "path": path, "name": "bad", "spec": {"kind": "draft", "draft": draft}})
    outside = load(SMOL, "/nonexistent/draft.gguf")
    assert outside.status_code == 403 and outside.json()["error"]["param"] == "spec.draft"
    other = load(SMOL, tiny["f32"])                       # another vocabulary
    assert other.status_code == 400 and "vocabulary" in other.json()["error"]["message"]
    bigger = load(tiny["f16"], tiny["f32"])
    assert bigger.status_code == 400 and "bigger" in bigger.json()["error"]["message"]
    assert bigger.json()["error"]["param"] == "spec.draft"


def test_a_bad_prediction_is_a_400(srv):
    r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60,
                   json={"messages": EDIT, "prediction": {"type": "text", "content": "x"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prediction"


@pytest.mark.parametrize("flags, says", [
    (["--spec", "eagle"], "--spec must be one of ngram, draft"),
    (["--spec", "ngram", "--spec-k", "0"], "--spec-k"),
    (["--spec", "draft"], "--draft-model (the draft model's path) is required"),
    (["--spec", "draft", "--draft-model", "TINY"], "--draft-model: the draft's vocabulary")])
def test_bad_flags_exit_1(flags, says, tiny):
    flags = [tiny["f32"] if f == "TINY" else f for f in flags]
    proc = subprocess.run([sys.executable, "-m", "pantheon.cli", "serve", "--port", "0",
                           *flags], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and says in proc.stderr and "Traceback" not in proc.stderr
