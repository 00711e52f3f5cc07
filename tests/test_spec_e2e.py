"""`serve --spec ngram` end to end: one server holds SmolLM2 with speculation and the
same file again without (an admin load with "spec": null), and real clients compare."""
import subprocess
import sys

import httpx
import pytest

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
def srv():
    with Server("--spec", "ngram", "--spec-k", "8", "--slots", "4", "--ctx", "1024") as srv:
        r = httpx.post(f"{srv.url}/admin/models/load", timeout=120,
                       json={"path": SMOL, "name": "plain", "spec": None})
        assert r.status_code == 200, r.text
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


@pytest.mark.parametrize("spec, field", [("draft", "spec.kind"), ({"kind": "ngram", "k": 17},
                                                                   "spec.k")])
def test_a_bad_spec_in_a_load_is_a_400_naming_it(srv, spec, field):
    r = httpx.post(f"{srv.url}/admin/models/load", timeout=60,
                   json={"path": SMOL, "name": "other", "spec": spec})
    assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_a_bad_prediction_is_a_400(srv):
    r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60,
                   json={"messages": EDIT, "prediction": {"type": "text", "content": "x"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prediction"


@pytest.mark.parametrize("flags, says", [(["--spec", "eagle"], "--spec must be one of ngram"),
                                         (["--spec", "ngram", "--spec-k", "0"], "--spec-k")])
def test_bad_flags_exit_1(flags, says):
    proc = subprocess.run([sys.executable, "-m", "pantheon.cli", "serve", "--port", "0",
                           *flags], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and says in proc.stderr and "Traceback" not in proc.stderr
